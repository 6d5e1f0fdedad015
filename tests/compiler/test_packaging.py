"""Installable like a library (CONTRACT.md "Build-time generation"): build-time generation for downstream
projects (generate --check, a generated folder in LOSSCODEGEN_KERNELS), stale files, many processes
generating at once, an unwritable cache, and a wheel that carries the templates and the prebuilt
kernels. A damaged file in the cache or in a kernel folder is tests/runtime/test_robustness.py's."""
import errno
import importlib.metadata
import multiprocessing as mp
import os
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import losscodegen as lcg
from losscodegen import interface, load
from losscodegen import symbols as S

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = """\
# a downstream project's heads: its own declared term, and a built-in combination
Tsallis = declare_term("tsallis", (1 - S.vsum(S.softmax ** 2)) / 1)
HeadLoss(CrossEntropy(), metrics=(Tsallis(),))
HeadLoss(CrossEntropy(label_smoothing=0.05), ZLoss())
"""


def _cli(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "losscodegen", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=600)


def test_generate_then_check_names_what_differs(tmp_path):
    manifest = tmp_path / "manifest"
    manifest.write_text(MANIFEST)
    out = tmp_path / "kernels"
    assert _cli("generate", "--manifest", str(manifest), "--out", str(out)).returncode == 0
    files = sorted(out.glob("head_loss_*.py"))
    assert len(files) == 2
    done = _cli("generate", "--manifest", str(manifest), "--out", str(out), "--check")
    assert done.returncode == 0 and "up to date" in done.stdout
    files[0].write_text(files[0].read_text() + "# edited\n")
    files[1].unlink()
    (out / "head_loss_0000000000000000.py").write_text("")
    done = _cli("generate", "--manifest", str(manifest), "--out", str(out), "--check")
    assert done.returncode == 1, done.stdout
    assert f"stale: {files[0]}" in done.stdout and f"missing: {files[1]}" in done.stdout
    assert "not in the manifest" in done.stdout and "head_loss_0000000000000000.py" in done.stdout


def test_a_generated_folder_serves_its_heads_before_the_cache(tmp_path, monkeypatch):
    # (``generate`` through the command line's own main(): its exit status as a process is the test's above)
    from losscodegen.__main__ import main
    manifest = tmp_path / "manifest"
    manifest.write_text("HeadLoss(CrossEntropy(label_smoothing=0.1), JSD(beta=0.25, temperature=3.0))\n")
    out = tmp_path / "kernels"
    assert main(["generate", "--manifest", str(manifest), "--out", str(out)]) == 0
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.JSD(beta=0.25, temperature=3.0))
    monkeypatch.setenv("LOSSCODEGEN_KERNELS", str(out))
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path / "cache"))
    assert load.module_path(head.key) == out / load.file_name(head.key)   # (the file the manifest's line made)
    assert interface.intact(load.module_path(head.key).read_bytes())


def _own_kernel(name: str, c: int):
    """A head whose kernel no other test loads: parameter values and weights are kernel arguments, so
    a distinct formula (a constant inside it) is what makes a distinct kernel."""
    return lcg.HeadLoss(lcg.declare_term(name, S.lse - S.target_logit + c * S.lse ** 2 / 100)())


def test_kernel_folders_come_before_the_cache(tmp_path, monkeypatch):
    head = _own_kernel("folders_first", 3)
    folder = tmp_path / "built"
    load.write_atomic(folder / load.file_name(head.key), head.source().text)
    monkeypatch.setenv("LOSSCODEGEN_KERNELS", f"{tmp_path / 'empty'}{os.pathsep}{folder}")
    assert load.module_path(head.key) == folder / load.file_name(head.key)
    assert Path(head.kernel.__file__) == folder / load.file_name(head.key)


@pytest.mark.cpu
def test_a_stale_kernel_file_is_never_used(tmp_path, monkeypatch):
    head = _own_kernel("stale_file", 35)
    folder = tmp_path / "built"
    stale = folder / load.file_name(head.key)
    load.write_atomic(stale, head.source().text.replace(f'CODEGEN = "{load.codegen_version()}"',
                                                        'CODEGEN = "0123456789ab"'))
    monkeypatch.setenv("LOSSCODEGEN_KERNELS", str(folder))
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match=str(stale)):
        path = load.module_path(head.key)
    assert path == tmp_path / "cache" / load.codegen_version() / load.file_name(head.key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # one warning a file, not one a call
        assert load.module_path(head.key) == path
    logits = torch.randn(4, 32)
    assert torch.isfinite(head(logits, torch.arange(4)).loss)
    assert Path(head.kernel.__file__) == path


def _generate_and_run(cache, barrier, results):
    os.environ["LOSSCODEGEN_CACHE"] = cache
    import losscodegen as lcg_  # noqa: F401  (a fresh process: its own module cache)
    head = lcg_.HeadLoss(lcg_.CrossEntropy(label_smoothing=0.4), lcg_.ZLoss(weight=0.5))
    barrier.wait()
    loss = head(torch.randn(6, 40, generator=torch.Generator().manual_seed(1)), torch.arange(6)).loss
    results.put(float(loss))


@pytest.mark.slow   # (four fresh interpreters at once; the writes' atomicity alone: test_a_full_disk_leaves_no_temporary_file_in_the_cache)
def test_many_processes_generating_one_kernel_leave_one_valid_file(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_generate_and_run, args=(str(tmp_path), barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    losses = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(set(losses)) == 1
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".py", files
    assert interface.intact(files[0].read_bytes()), "the one file is whole: a later process uses it as it is"


def test_an_unwritable_cache_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(blocker / "cache"))
    head = _own_kernel("unwritable_cache", 45)
    with pytest.raises(RuntimeError, match="LOSSCODEGEN_CACHE"):
        head.kernel


def test_a_full_disk_leaves_no_temporary_file_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    head = _own_kernel("full_disk", 46)
    real_fdopen = os.fdopen

    class _Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:100])      # (a part written, then the disk is full)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(load.os, "fdopen", lambda fd, mode: _Full(real_fdopen(fd, mode)))
    with pytest.raises(RuntimeError, match="No space left on device.*LOSSCODEGEN_CACHE"):
        head.kernel
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    monkeypatch.setattr(load.os, "fdopen", real_fdopen)   # space again: the next call writes it whole
    assert head.kernel.KEY == head.key
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [load.file_name(head.key)]


def test_version_and_typing_marker():
    assert lcg.__version__ == importlib.metadata.version("losscodegen")
    assert (Path(lcg.__file__).parent / "py.typed").exists()


def test_the_wheel_carries_templates_and_kernels(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=600)
    names = set(zipfile.ZipFile(next(tmp_path.glob("losscodegen-*.whl"))).namelist())
    kernels = {f"losscodegen/generated/{p.name}" for p in (ROOT / "generated").glob("head_loss_*.py")}
    assert kernels and kernels <= names
    # every template, those a template includes (templates/triton/: the Triton file's phases) too
    templates = {f"losscodegen/templates/{p.relative_to(ROOT / 'templates').as_posix()}"
                 for p in (ROOT / "templates").rglob("*.j2")}
    assert "losscodegen/templates/triton/_grad.j2" in templates and templates <= names
    assert {"losscodegen/templates/head_loss.py.j2", "losscodegen/generated/manifest",
            "losscodegen/backends/triton/tiles.json", "losscodegen/py.typed", "losscodegen/integrations/transformers.py",
            "losscodegen/integrations/trl.py", "losscodegen/templates/head_loss_torch.py.j2",
            "losscodegen/templates/_spec_constants.j2",
            "losscodegen/backends/torch/render.py"} <= names


def test_triton_is_required_on_linux_only():
    """Where Triton cannot be installed (macOS, Windows) the wheel installs, and heads run on the
    torch backend."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (triton,) = [d for d in deps if d.startswith("triton")]
    assert triton.replace(" ", "").endswith(";platform_system=='Linux'"), triton
