"""CONTRACT.md "Build-time generation", "What is refused" (kernel hashes) and the fuzzer's command
line, checked as a user would, each head in a fresh process (the cache is chosen at import)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a head that no manifest ships: generated at first use into LOSSCODEGEN_CACHE
SCRIPT = """
import os, warnings, torch, losscodegen as lcg
from losscodegen import symbols as S
T = lcg.declare_term("contract_gen_probe", S.lse * 0.5 + S.vsum(S.softmax ** 3))
x = torch.linspace(-3, 3, 6 * 17).reshape(6, 17)
y = torch.arange(6)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out = lcg.HeadLoss(T())(x, y)
z = x.double()
want = (0.5 * torch.logsumexp(z, -1) + (torch.softmax(z, -1) ** 3).sum(-1)).mean()
print("VALUE_OK" if abs(float(out.loss) - float(want)) < 1e-5 else f"VALUE_BAD {float(out.loss)} {float(want)}")
print("WARNINGS", [str(m.message)[:200] for m in w if "losscodegen" in str(m.message).lower() or "hash" in str(m.message).lower() or "regenerat" in str(m.message).lower()])
"""


def _run(env_extra, code=SCRIPT):
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1", **env_extra}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def _kernel_files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith("head_loss_") and f.endswith(".py")]


def test_a_tampered_cache_file_is_regenerated_with_a_warning(tmp_path):
    cache = str(tmp_path / "cache")
    first = _run({"LOSSCODEGEN_CACHE": cache})
    assert first.returncode == 0 and "VALUE_OK" in first.stdout, first.stdout + first.stderr
    files = _kernel_files(cache)
    assert files, "the new head was generated into LOSSCODEGEN_CACHE"
    for f in files:
        with open(f, "a") as fh:
            fh.write("\n# tampered\n")
    second = _run({"LOSSCODEGEN_CACHE": cache})
    assert second.returncode == 0 and "VALUE_OK" in second.stdout, second.stdout + second.stderr
    assert not any("# tampered" in open(f).read() for f in _kernel_files(cache)), "the damaged file was generated again"
    assert "WARNINGS []" not in second.stdout, second.stdout + second.stderr


def test_an_unwritable_cache_is_a_clear_error_naming_it(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    if os.access(ro, os.W_OK):      # root ignores the mode: a path under a regular file cannot be created
        (tmp_path / "file").write_text("")
        ro = tmp_path / "file" / "cache"
    out = _run({"LOSSCODEGEN_CACHE": str(ro)})
    assert out.returncode != 0, out.stdout
    assert "LOSSCODEGEN_CACHE" in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]


def test_fuzz_command_line_exists(capsys):
    # (the command line's main() in this process: `python -m losscodegen` as a process is the tests'
    # above and tests/compiler/test_packaging.py's)
    from losscodegen.__main__ import main
    with pytest.raises(SystemExit) as done:
        main(["fuzz", "--help"])
    assert done.value.code == 0
    stdout = capsys.readouterr().out
    for opt in ("--minutes", "--seed", "--device"):
        assert opt in stdout, stdout


HEAD_SCRIPT = """
import torch, losscodegen as lcg
x = torch.linspace(-3, 3, 6 * 19).reshape(6, 19)
y = torch.arange(6)
out = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.JSD(beta=0.25, temperature=3.0))(x, y, teacher_logits=x.flip(0))
print("LOSS", float(out.loss))
"""


def test_downstream_kernels_folder_generate_check_and_read_only_mismatch(tmp_path, monkeypatch, capsys):
    # (``generate`` and ``--check`` run here, through the command line's own ``main``: their exit
    # status as a process is tests/compiler/test_packaging.py's; the heads load in fresh processes)
    from losscodegen.__main__ import main
    manifest = tmp_path / "manifest"
    manifest.write_text("HeadLoss(CrossEntropy(label_smoothing=0.1), JSD(beta=0.25, temperature=3.0))\n")
    out_dir = tmp_path / "kernels"
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path / "cache"))
    command = ["generate", "--manifest", str(manifest), "--out", str(out_dir)]
    assert main(command) == 0
    assert main(command + ["--check"]) == 0, capsys.readouterr().out
    files = _kernel_files(str(out_dir))
    assert files
    first = _run({"LOSSCODEGEN_KERNELS": str(out_dir), "LOSSCODEGEN_CACHE": str(tmp_path / "cache")}, HEAD_SCRIPT)
    assert first.returncode == 0, first.stderr[-2000:]
    assert not _kernel_files(str(tmp_path / "cache")), "the head came from LOSSCODEGEN_KERNELS, not generated again"
    for f in files:
        with open(f, "a") as fh:
            fh.write("\n# edited\n")
    assert main(command + ["--check"]) != 0, "--check exits non-zero when DIR is out of date"
    bad = _run({"LOSSCODEGEN_KERNELS": str(out_dir), "LOSSCODEGEN_CACHE": str(tmp_path / "cache")}, HEAD_SCRIPT)
    assert bad.returncode != 0, bad.stdout
    assert any(os.path.basename(f) in bad.stderr for f in files), bad.stderr[-2000:]


def test_processes_generating_the_same_new_kernel_at_once_leave_one_valid_file(tmp_path):
    cache = str(tmp_path / "cache")
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1", "LOSSCODEGEN_CACHE": cache}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0 and "VALUE_OK" in o, o + e[-2000:]
    files = _kernel_files(cache)
    assert len(files) == 1, files
    again = _run({"LOSSCODEGEN_CACHE": cache})
    assert "VALUE_OK" in again.stdout and "WARNINGS []" in again.stdout, again.stdout + again.stderr[-1000:]
