"""Every input either computes the right value or gets a clear error naming the argument: the
runtime cases (arguments, higher-order gradients, copies and pickles of heads, logits layouts,
top-k ids, threads, damaged kernel files), each written as a user would hit it."""
import copy
import io
import math
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import losscodegen as lcg
from helpers import DEVICE, check_head, make_inputs


def _ce_z():
    return lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.5), metrics=(lcg.Entropy(),))


# ---- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    (dict(softcap=math.inf), "softcap"), (dict(softcap=math.nan), "softcap"), (dict(softcap=0.0), "softcap"),
    (dict(softcap=-3.0), "softcap"), (dict(logit_scale=math.nan), "logit_scale"),
    (dict(logit_scale=math.inf), "logit_scale"), (dict(logit_scale=-math.inf), "logit_scale"),
    (dict(ignore_index=2**70), "ignore_index"), (dict(ignore_index=-2**63 - 1), "ignore_index"),
])
def test_bad_head_options_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        lcg.HeadLoss(lcg.CrossEntropy(), **kwargs)


def test_int64_edges_of_ignore_index_work():   # (on the CPU: its inputs are made here)
    logits, labels, _ = make_inputs(R=6, V=64, ignored=())
    for ignore in (2**63 - 1, -2**63):
        labels[2] = ignore
        x = logits.clone().requires_grad_()
        loss = lcg.HeadLoss(lcg.CrossEntropy(), ignore_index=ignore)(x, labels).loss
        loss.backward()
        ref_x = logits.double().requires_grad_()
        ref = torch.nn.functional.cross_entropy(ref_x, labels, ignore_index=ignore)
        ref.backward()
        torch.testing.assert_close(loss.double(), ref)
        torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("divisor", [0, 0.0, -2, -1.5, math.nan, math.inf])
def test_bad_python_divisor_is_refused(divisor):
    logits, labels, _ = make_inputs(R=6, V=64)
    with pytest.raises(ValueError, match="divisor"):
        _ce_z()(logits.to(DEVICE), labels.to(DEVICE), divisor=divisor)


def test_cpu_tensors_without_the_interpreter_say_how_to_run_them(tmp_path):
    script = textwrap.dedent("""
        import torch, losscodegen as lcg
        head = lcg.HeadLoss(lcg.CrossEntropy())
        try:
            head(torch.randn(4, 32), torch.randint(0, 32, (4,)))
        except ValueError as e:
            print("ERROR:", e)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert "ERROR:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


# ---- higher-order gradients ------------------------------------------------------------------------
def test_create_graph_through_a_head_is_an_error():
    logits, labels, _ = make_inputs(R=6, V=64)
    hidden = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, 16, device=DEVICE, requires_grad=True)
    head, labels = _ce_z(), labels.to(DEVICE)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(head(hidden @ weight.t(), labels).loss, weight, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(head.linear(hidden, weight, labels).loss, weight, create_graph=True)
    # a first-order gradient is still one call away
    (g,) = torch.autograd.grad(head(hidden @ weight.t(), labels).loss, weight)
    assert g.grad_fn is None and torch.isfinite(g).all()


def test_create_graph_through_a_compiled_head_is_an_error():
    head = _ce_z()
    hidden = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, 16, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 64, (6,), device=DEVICE)
    step = torch.compile(lambda h, w, y: head(h @ w.t(), y).loss)
    (g,) = torch.autograd.grad(step(hidden, weight, labels), weight, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):   # (AOTAutograd refuses it itself)
        (g ** 2).sum().backward()


# ---- identity and pickling -------------------------------------------------------------------------
def _copies(head):
    buf = io.BytesIO()
    torch.save(torch.nn.ModuleDict({"head": head}), buf)
    buf.seek(0)
    return [copy.deepcopy(head), pickle.loads(pickle.dumps(head)),
            torch.load(buf, weights_only=False)["head"]]


def test_copies_of_a_head_compute_its_values_before_and_after_its_first_call():
    logits, labels, _ = make_inputs(R=8, V=96)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=0.25), logit_scale=0.5,
                        softcap=8.0, metrics=(lcg.Entropy(),))
    before = _copies(head)
    check_head(head, logits, labels)
    after = _copies(head)
    ids = {h.head_id for h in [head, *before, *after]}
    assert len(ids) == 7, "every copy has an id of its own"
    for h in before + after:
        check_head(h, logits, labels)


_OTHER_PROCESS = """
import sys, torch, losscodegen as lcg
sys.path.insert(0, {tests!r})
from helpers import check_head, make_inputs
# a head with the same formulas, made first here: it must not be taken for the loaded one
other = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1.0))
logits, labels, _ = make_inputs(R=6, V=64)
other(logits, labels)
for path in sys.argv[1:]:
    head = torch.load(path, weights_only=False)
    check_head(head, logits, labels)                       # eager
    loss = torch.compile(lambda x, y: head(x, y).loss)(logits, labels)
    ref = torch.load(path, weights_only=False)(logits, labels).loss
    torch.testing.assert_close(loss, ref)                 # compiled: this head's weights
    print("ok", head.head_id != other.head_id)
"""


def test_a_head_saved_before_and_after_its_first_call_loads_in_another_process(tmp_path):
    logits, labels, _ = make_inputs(R=6, V=64)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=7.0))
    torch.save(head, tmp_path / "before.pt")
    head(logits, labels)
    torch.save(head, tmp_path / "after.pt")
    script = _OTHER_PROCESS.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "before.pt"), str(tmp_path / "after.pt")],
                         capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == ["ok", "True", "ok", "True"], out.stdout + out.stderr
