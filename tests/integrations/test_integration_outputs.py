"""What a trainer does with a head's outputs: every tensor in ``out`` is a tensor of its own to
autograd (not a view), so in-place ops work on it (the Hugging Face Trainer scales the loss with
``loss *= ...``), from ``head()`` and ``head.linear()``, under every reduction, eager and compiled;
the gradient then follows the modified loss (against a float64 autograd reference)."""
import pytest
import torch

import losscodegen as lcg

R, H, V = 9, 12, 64
Z = 1e-2   # z-loss weight


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (R,), generator=g)
    labels[[2, 5]] = -100
    return hidden, weight, labels


def _reference(logits, labels, reduction):
    """CE + Z * z-loss in float64, from the formulas: the loss for ``reduction``."""
    z = logits.double()
    lse = torch.logsumexp(z, -1)
    valid = labels != -100
    rows = (lse - z.gather(-1, labels.clamp_min(0)[:, None])[:, 0] + Z * lse ** 2) * valid
    return {"none": rows, "sum": rows.sum(), "mean": rows.sum() / valid.sum()}[reduction]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("entry", ["head", "linear"])
def test_every_output_takes_inplace_ops_and_the_gradient_follows(entry, reduction, compiled):
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=Z), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    hidden, weight, labels = _inputs()

    def step(h, w, y):
        if entry == "head":
            out = head(h @ w.t(), y, reduction=reduction)
        else:
            out = head.linear(h, w, y, reduction=reduction)
        out.loss *= 2                      # in place, inside the (compiled) function too
        out.terms["z_loss"] += 0
        return out.loss, out.terms, out.metrics

    # head.linear is a graph break under compile (it runs eagerly), so no fullgraph for it
    fn = torch.compile(step, backend="aot_eager", fullgraph=entry == "head") if compiled else step
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, terms, metrics = fn(h, w, labels)
    for name, t in [("loss", loss), *terms.items(), *metrics.items()]:
        assert not t._is_view(), name
        t.mul_(1)                          # in place, outside
    loss.mul_(0.5)
    (loss.sum() if reduction == "none" else loss).mul(3).backward()

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference(hr @ wr.t(), labels, reduction)
    (ref.sum() if reduction == "none" else ref).mul(3).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-6)
    # an in-place op on one output leaves the others alone
    ce = terms["cross_entropy"].clone()
    terms["z_loss"].fill_(7.0)
    metrics["entropy"].fill_(7.0)
    assert torch.equal(terms["cross_entropy"], ce) and metrics["token_accuracy"].item() != 7.0
