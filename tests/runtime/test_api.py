"""Bad input gets a clear error naming the argument; generated/ is what the generator emits."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy
import torch

import losscodegen as lcg
from helpers import make_inputs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def head():
    return lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))


@pytest.mark.cpu
def test_bad_inputs_name_the_argument(head):
    logits, labels, _ = make_inputs(R=6, V=256)
    bad = labels.clone()
    bad[0] = 256
    with pytest.raises(ValueError, match="labels"):
        head(logits, bad)
    bad[0] = -3
    with pytest.raises(ValueError, match="labels"):
        head(logits, bad)
    with pytest.raises(ValueError, match="labels"):
        head(logits, labels[:5])
    with pytest.raises(TypeError, match="logits"):
        head(logits.long(), labels)
    with pytest.raises(TypeError, match="labels"):
        head(logits, labels.float())
    with pytest.raises(ValueError, match="labels"):
        head(logits, None)
    with pytest.raises(ValueError, match="loss_mask"):
        head(logits, labels, loss_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="loss_mask"):
        head(logits, labels, loss_mask=torch.ones(6))
    with pytest.raises(ValueError, match="reduction"):
        head(logits, labels, reduction="max")
    with pytest.raises(TypeError, match="unexpected keyword"):
        head(logits, labels, advantagez=torch.ones(6))


def test_validate_false_skips_the_value_check():
    logits, labels, _ = make_inputs(R=6, V=256)
    checked, unchecked = lcg.HeadLoss(lcg.CrossEntropy()), lcg.HeadLoss(lcg.CrossEntropy(), validate=False)
    torch.testing.assert_close(unchecked(logits, labels).loss, checked(logits, labels).loss, rtol=0, atol=0)
    bad = labels.clone()
    bad[2] = 10_000
    with pytest.raises(ValueError, match="10000"):
        checked(logits, bad)
    unchecked(logits, bad)          # no check: no error, now or at the next call
    unchecked(logits, labels)


def test_bad_heads():
    with pytest.raises(TypeError, match="calling"):
        lcg.HeadLoss(lcg.CrossEntropy)
    with pytest.raises(ValueError, match="metric"):
        lcg.HeadLoss(lcg.TokenAccuracy())
    with pytest.raises(ValueError, match="unique"):
        lcg.HeadLoss(lcg.CrossEntropy(), lcg.CrossEntropy(weight=2.0))
    with pytest.raises(ValueError, match="softcap"):
        lcg.HeadLoss(lcg.CrossEntropy(), softcap=0.0)
    with pytest.raises(ValueError, match="temperature"):
        lcg.ForwardKL(temperature=0.0)


def test_explain_names_reads_gradient_and_file(head):
    text = head.explain()
    for needle in ("cross_entropy", "dL/dz_i", "reads of the vocabulary: 1", "bytes per element",
                   "head_loss_"):
        assert needle in text
    assert "exact" in lcg.HeadLoss(lcg.JSD()).explain()


# The sympy that wrote generated/: another sympy prints some expressions differently (each file's
# CODEGEN stamp hashes the version, so at run time they are regenerated, never used stale).
GENERATED_WITH_SYMPY = "1.14.0"


@pytest.mark.skipif(sympy.__version__ != GENERATED_WITH_SYMPY,
                    reason=f"generated/ was written under sympy {GENERATED_WITH_SYMPY}; its byte-for-byte "
                           f"check runs under that version only (this is sympy {sympy.__version__})")
def test_generated_is_up_to_date(tmp_path, capsys):
    # (the command line's main() in this process, its default manifest: `python -m losscodegen
    # generate` as a process is tests/compiler/test_packaging.py's)
    from losscodegen.__main__ import main
    assert main(["generate", "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    fresh = {p.name: p.read_bytes() for p in tmp_path.glob("head_loss_*.py")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "generated").glob("head_loss_*.py")}
    assert fresh.keys() == committed.keys(), "run `python -m losscodegen generate` and commit generated/"
    for name in fresh:
        assert fresh[name] == committed[name], f"generated/{name} is stale"


def test_manifest_heads_load_from_generated():
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss())
    assert (ROOT / "generated" / f"head_loss_{head.key}.py").exists()
    assert Path(head.kernel.__file__).parent == ROOT / "generated"


def test_readme_demo_runs_as_a_user_starts_it(tmp_path):
    """`python -m losscodegen demo` from a plain shell: no TRITON_INTERPRET set, a fresh cache. On the
    CPU it runs the Triton kernel in Triton's interpreter (README), and says so; numpy's warnings of
    the interpreter's arithmetic on padded lanes ("invalid value encountered in add") are not printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LOSSCODEGEN_CACHE"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "losscodegen", "demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss = " in done.stdout and "forward_kl" in done.stdout
    assert "Warning" not in done.stderr, done.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "on cpu: the triton backend in Triton's interpreter" in done.stdout, done.stdout[:500]


@pytest.mark.cpu
def test_a_users_call_in_the_interpreter_warns_nothing():
    """Under Triton's interpreter numpy computes the padded lanes and the untaken side of each tl.where
    (-inf - -inf, log(0)): its RuntimeWarnings are silenced around our launches, so a user's call (a
    masked teacher, a width of no whole tile, backward) warns nothing, while numpy elsewhere still does."""
    import warnings

    import numpy
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 37, generator=g).requires_grad_()
    teacher = torch.randn(6, 37, generator=g)
    teacher[:, 5:9] = -torch.inf
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ReverseKL(), metrics=(lcg.Entropy(),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        head(logits, torch.arange(6), teacher_logits=teacher).loss.backward()
    assert torch.isfinite(logits.grad).all()
    with pytest.warns(RuntimeWarning, match="divide by zero"):
        numpy.log(numpy.zeros(1))


USER_SCRIPT = """
import torch, losscodegen as lcg
head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4))
out = head(torch.randn(8, 300), torch.randint(0, 300, (8,)))
lcg.testing.assert_parity(head, rows=8, vocab=300)
print("BACKEND", head.backend_name, type(head.backend).__module__)
"""


def test_a_users_script_on_the_cpu_runs_the_torch_backend(tmp_path):
    """A user's script on a machine without CUDA (backend="auto", no TRITON_INTERPRET): the head, and
    assert_parity's run of it, compute on the torch backend (README, docs/api.md), and say so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOSSCODEGEN_CACHE=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", USER_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "BACKEND torch losscodegen.backends.torch" in done.stdout, done.stdout
    assert "Warning" not in done.stderr, done.stderr[-2000:]


def test_backend_name_is_the_backend_that_runs(monkeypatch):
    """head.backend_name is "triton" or "torch", never "auto": the backend whose kernel file the calls
    run. A copy keeps the option as given, so "auto" is resolved again where it is loaded."""
    import copy
    import pickle

    from losscodegen import backends, load
    head = lcg.HeadLoss(lcg.CrossEntropy())
    assert head.backend_name == backends.resolve("auto") == head.backend.name
    logits, labels, _ = make_inputs(R=6, V=40)
    head(logits, labels)
    assert Path(head.kernel.__file__).name == load.file_name(head.key, backends.get(head.backend_name))
    with pytest.raises(AttributeError):
        head.backend_name = "auto"
    pinned = lcg.HeadLoss(lcg.CrossEntropy(), backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)      # (now a process where "auto" is torch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for copied in (pickle.loads(pickle.dumps(head)), copy.deepcopy(head)):
        assert copied.backend_name == "torch"
    assert pickle.loads(pickle.dumps(pinned)).backend_name == "triton"
    state = head.__getstate__()                 # (a head pickled when the option was kept as backend_name)
    state["backend_name"] = state.pop("_backend_option")
    old = lcg.HeadLoss.__new__(lcg.HeadLoss)
    old.__setstate__(state)
    assert old.backend_name == "torch" and "backend_name" not in vars(old)



def test_softcap_is_fixed_at_construction():
    # the kernel is built with or without it: a later assignment could only be silently ignored
    head = lcg.HeadLoss(lcg.CrossEntropy())
    with pytest.raises(AttributeError):
        head.softcap = 30.0


def test_backend_auto_on_an_amd_gpu_runs_the_torch_backend(monkeypatch):
    """ROCm's torch reports a "cuda" device for an AMD GPU, where the Triton kernels do not compile yet
    (docs/api.md, "Portable builds"): backend="auto" runs the torch backend there, not a failing Triton."""
    import torch

    from losscodegen import backends
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert backends.resolve("auto") == "torch"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert backends.resolve("auto") == "triton"
