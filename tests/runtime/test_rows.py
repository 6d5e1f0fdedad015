"""reduction="none": out.rows holds every term's and metric's per-row values; the terms' rows are
differentiable, with upstream gradients on several outputs at once (one backward pass), on logits,
through head.linear and under torch.compile. References: float64 torch written from the formulas."""
import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen.testing import compare
from helpers import DEVICE, make_inputs

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
