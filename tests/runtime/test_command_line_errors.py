"""`python -m losscodegen`'s ordinary mistakes are one line, `file:line: message` or `--option: message`,
and exit status 1, never a traceback (docs/api.md, "The command line"). main() runs here in this
process: a SystemExit carrying a message is what the process prints as it exits with status 1; one
run as a process checks that. `check` going on after a failing head, and a class weight's vocabulary,
are tests/runtime/test_parity_tool.py's."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import losscodegen as lcg
from losscodegen.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def _message(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert isinstance(done.value.code, str), done.value.code    # (a message: exit status 1)
    return done.value.code


def test_a_manifest_path_that_does_not_exist_is_named_as_a_process_would_say(tmp_path):
    missing = tmp_path / "no-such-manifest"
    for command in ("check", "generate", "tune"):
        assert _message([command, "--manifest", str(missing)]).startswith(
            f"--manifest: cannot read {missing} (No such file or directory)")
    assert _message(["check", "--manifest", str(tmp_path)]).startswith(f"--manifest: cannot read {tmp_path} (Is a")
    done = subprocess.run([sys.executable, "-m", "losscodegen", "check", "--manifest", str(missing)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.strip().splitlines() == [_message(["check", "--manifest", str(missing)])], done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_check_and_fuzz_on_cuda_without_cuda_say_so():
    for command in (["check", "--device", "cuda"], ["fuzz", "--device", "cuda", "--minutes", "0"]):
        assert _message(command).startswith("--device: cuda is not available here")


def test_a_bad_option_exits_with_status_1(capsys):
    assert "argument --vocab: must be a positive int, got 0" in _message(["check", "--vocab", "0"])
    assert "invalid choice" in _message(["check", "--device", "tpu"])


def test_generate_names_the_line_of_a_head_whose_kernel_fails_to_generate(tmp_path, monkeypatch):
    manifest = tmp_path / "manifest"
    manifest.write_text("HeadLoss(CrossEntropy())\n\nHeadLoss(ReverseKL())\n")
    real = lcg.HeadLoss.source

    def source(head, *args, **kwargs):
        if head.loss_terms[0].name == "reverse_kl":
            raise NotImplementedError("no triton printing for Foo: foo(x)")
        return real(head, *args, **kwargs)
    monkeypatch.setattr(lcg.HeadLoss, "source", source)
    out = tmp_path / "kernels"
    assert _message(["generate", "--manifest", str(manifest), "--out", str(out)]) == (
        f"{manifest}:3: NotImplementedError generating its kernel: no triton printing for Foo: foo(x)")
    assert not out.exists()     # (nothing written: every kernel is generated before any is written)


def test_a_manifest_line_that_fails_is_named_as_file_and_line(tmp_path):
    # (the manifest runs as a module, no exec of a line: its traceback's line in the file is the one named)
    manifest = tmp_path / "manifest"
    manifest.write_text("HeadLoss(CrossEntropy())\n# a comment\nTsallis = nosuch + 1\n")
    assert _message(["generate", "--manifest", str(manifest), "--out", str(tmp_path)]) == (
        f"{manifest}:3: NameError: name 'nosuch' is not defined")
    manifest.write_text("HeadLoss(CrossEntropy())\n1 + 2\n")
    assert _message(["generate", "--manifest", str(manifest), "--out", str(tmp_path)]) == (
        f"{manifest}:2: TypeError: a head line must make a HeadLoss, this one makes int")
