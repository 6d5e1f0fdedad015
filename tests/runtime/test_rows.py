"""reduction="none": out.rows holds every term's and metric's per-row values; the terms' rows are
differentiable, with upstream gradients on several outputs at once (one backward pass), on logits,
through head.linear and under torch.compile. References: float64 torch written from the formulas."""
import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen.testing import compare
from helpers import DEVICE, both_backends, make_inputs, run_backward
import reference as R

# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto")
pytestmark = pytest.mark.usefixtures("backend")


def _reference_rows(z, labels):
    """float64 per-row cross entropy, z-loss, entropy, log p_y and accuracy (0 on ignored rows)."""
    valid = labels != -100
    logp = torch.log_softmax(z, -1)
    y = labels.clamp_min(0)
    rows = {"cross_entropy": -logp.gather(-1, y[..., None])[..., 0], "z_loss": torch.logsumexp(z, -1) ** 2,
            "entropy": -(logp.exp() * logp).sum(-1), "logprob": logp.gather(-1, y[..., None])[..., 0],
            "token_accuracy": (z.argmax(-1) == labels).double()}
    return {k: torch.where(valid, v, torch.zeros_like(v)) for k, v in rows.items()}


def _upstream(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_and_their_gradients_on_logits(dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=0.7), lcg.ZLoss(weight=0.1),
                        metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    logits, labels, _ = make_inputs(R=12, V=96, dtype=dtype, shape=(3, 4), ignored=(1, 6))
    x = logits.clone().to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), reduction="none")
    assert set(out.rows) == {"cross_entropy", "z_loss", "entropy", "token_accuracy"}
    assert all(r.shape == labels.shape and r.dtype == torch.float32 for r in out.rows.values())
    assert out.rows["cross_entropy"].requires_grad and out.rows["z_loss"].requires_grad
    assert not out.rows["entropy"].requires_grad and not out.rows["token_accuracy"].requires_grad
    a, b, c = _upstream(labels.shape, 1)
    # upstream gradients on the per-row loss and on both terms' rows, in one backward
    (out.loss * a.float().to(DEVICE) + out.rows["cross_entropy"] * b.float().to(DEVICE)
     + out.rows["z_loss"] * c.float().to(DEVICE)).sum().backward()

    z = logits.double().requires_grad_()
    want = _reference_rows(z, labels)
    loss = 0.7 * want["cross_entropy"] + 0.1 * want["z_loss"]
    (loss * a + want["cross_entropy"] * b + want["z_loss"] * c).sum().backward()
    compare("loss", out.loss, loss.detach(), dtype)
    for name, got in out.rows.items():
        compare(name, got, want[name].detach(), dtype)
    compare("gradient", x.grad, z.grad, dtype)


def test_per_token_logprobs_and_entropy_for_a_trainer():
    """LogProb as a term, Entropy as a metric: per-token log-probs (with their gradient) and
    entropies from one pass; the trainer builds its loss from them in torch."""
    head = lcg.HeadLoss(lcg.LogProb(), metrics=(lcg.Entropy(),))
    logits, labels, _ = make_inputs(R=10, V=64, ignored=(3,))
    x = logits.clone().to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), reduction="none")
    advantages = torch.randn(10, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (-(out.rows["logprob"] * advantages.float().to(DEVICE)).sum() - 0.01 * out.rows["entropy"].sum()).backward()
    z = logits.double().requires_grad_()
    want = _reference_rows(z, labels)
    (-(want["logprob"] * advantages).sum()).backward()          # the entropy rows carry no gradient
    compare("logprob", out.rows["logprob"], want["logprob"].detach(), torch.float32)
    compare("entropy", out.rows["entropy"], want["entropy"].detach(), torch.float32)
    compare("gradient", x.grad, z.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_and_their_gradients_through_head_linear(dtype):
    head = lcg.HeadLoss(lcg.LogProb(), lcg.ZLoss(weight=0.2), metrics=(lcg.Entropy(),))
    g = torch.Generator().manual_seed(4)
    R, H, V = 11, 16, 80
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (R,), generator=g)
    labels[2] = -100
    h, w, b = (t.to(dtype).to(DEVICE).requires_grad_() for t in (hidden, weight, bias))
    out = head.linear(h, w, labels.to(DEVICE), bias=b, chunk_rows=4, reduction="none")
    assert set(out.rows) == {"logprob", "z_loss", "entropy"} and not out.rows["entropy"].requires_grad
    a, c, _ = _upstream((R,), 5)
    (out.loss * a.float().to(DEVICE) + out.rows["logprob"] * c.float().to(DEVICE)).sum().backward()

    h64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (h, w, b))
    want = _reference_rows(h64 @ w64.t() + b64, labels)
    loss = want["logprob"] + 0.2 * want["z_loss"]
    (loss * a + want["logprob"] * c).sum().backward()
    tol = None if dtype == torch.float32 else (1e-2, 1e-2, 3e-2)   # bf16: the logits are rounded
    compare("loss", out.loss, loss.detach(), dtype, tolerances=tol)
    for name in ("logprob", "entropy"):
        compare(name, out.rows[name], want[name].detach(), dtype, tolerances=tol)
    for name, got, ref in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad), ("bias", b.grad, b64.grad)):
        compare("gradient", got, ref, dtype, tolerances=tol, where=name)


@pytest.mark.cpu
def test_rows_under_torch_compile_match_eager():
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), metrics=(lcg.Entropy(),))
    logits, labels, _ = make_inputs(R=8, V=64)
    a, b, _ = (t.float() for t in _upstream((8,), 6))

    def step(x):
        out = head(x, labels, reduction="none")
        return (out.loss * a + out.rows["z_loss"] * b).sum(), out.rows["entropy"], out.rows["cross_entropy"]
    results = []
    for fn in (torch.compile(step, fullgraph=True, backend="aot_eager"), step):
        x = logits.clone().requires_grad_()
        total, entropy, ce = fn(x)
        total.backward()
        results.append((total.detach(), entropy, ce.detach(), x.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cpu
def test_a_declared_term_and_a_second_backward():
    head = lcg.HeadLoss(lcg.declare_term("neg_logprob", S.lse - S.target_logit)())
    logits, labels, _ = make_inputs(R=6, V=32)
    x = logits.clone().requires_grad_()
    out = head(x, labels, reduction="none")
    out.rows["neg_logprob"].sum().backward(retain_graph=True)   # an upstream gradient on the rows only
    z = logits.double().requires_grad_()
    F.cross_entropy(z, labels, reduction="sum").backward()
    compare("gradient", x.grad, z.grad, torch.float32)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.sum().backward()


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_zero_valid_rows_give_zero_and_zero_gradient(backend):
    x, y, t = R.rows_in(8, 32, seed=8, ignored=range(8))
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), metrics=(lcg.Entropy(), lcg.TokenAccuracy()), backend=backend)
    out, g = run_backward(head, x, y, teacher_logits=t)
    for name, val in [("loss", out.loss), *out.terms.items(), *out.metrics.items()]:
        assert float(val) == 0.0, (name, val)
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_reduction_none_sum_and_divisor(backend):
    x, y, _ = R.rows_in(3 * 5, 40, seed=9, ignored=(2, 9))
    x, y = x.reshape(3, 5, 40), y.reshape(3, 5)
    v = R.valid_rows(y)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), backend=backend)

    def rows(z):
        return torch.where(v, R.ce_rows(z, y) + 0.1 * R.z_loss_rows(z), torch.zeros(()).double())
    # none: labels' shape, 0 on invalid rows, differentiable with any upstream gradient
    up = torch.randn(3, 5, dtype=torch.float64)
    xx = x.clone().requires_grad_(True)
    out = head(xx, y, reduction="none")
    assert out.loss.shape == (3, 5)
    R.close(out.loss, rows(x.double()), R.FP32, "rows")
    out.loss.backward(up.float())
    R.close(xx.grad, R.grad(lambda z: (rows(z) * up).sum(), x), R.FP32, "none grad")
    # sum: no divisor
    out, g = run_backward(head, x, y, reduction="sum")
    R.close(out.loss, rows(x.double()).sum(), R.FP32, "sum")
    R.close(g, R.grad(lambda z: rows(z).sum(), x), R.FP32, "sum grad")
    # divisor: a global token count
    out, g = run_backward(head, x, y, divisor=37)
    R.close(out.loss, rows(x.double()).sum() / 37, R.FP32, "divisor")
    R.close(out.terms["z_loss"], R.mean_over(R.z_loss_rows(x.double()), v, 37), R.FP32, "divisor term")
    R.close(g, R.grad(lambda z: rows(z).sum() / 37, x), R.FP32, "divisor grad")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_metrics_stay_means_over_valid_rows_whatever_divisor(backend):
    x, y, _ = R.rows_in(12, 40, seed=10)
    v = R.valid_rows(y)
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),), backend=backend)
    for kw in ({"divisor": 100}, {"reduction": "sum"}, {"reduction": "none"}):
        out = head(x, y, **kw)
        R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), R.FP32, f"entropy {kw}")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_loss_mask_marks_rows_invalid(backend):
    x, y, t = R.rows_in(12, 40, seed=11)
    mask = torch.tensor([True, True, False, True, False, True, True, True, False, True, True, True])
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), backend=backend)
    out, g = run_backward(head, x, y, teacher_logits=t, loss_mask=mask)
    v = R.valid_rows(y, mask)

    def loss(z):
        return R.mean_over(R.ce_rows(z, y), v) + R.mean_over(R.forward_kl_rows(z, t), v)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(g, R.grad(loss, x), R.FP32, "grad")
