"""Terms no built-in covers, declared in a few lines: compiled and differentiated like built-ins."""
import pytest
import torch

import losscodegen as lcg
from helpers import check_head, make_inputs
from losscodegen import symbols as S

p_y = S.exp(S.target_logit - S.lse)
Poly1 = lcg.declare_term("poly1", S.lse - S.target_logit + S.param("eps") * (1 - p_y))
Focal = lcg.declare_term("focal", -(1 - p_y) ** S.param("gamma") * (S.target_logit - S.lse))
Collision = lcg.declare_term("collision", S.vsum(S.softmax ** 2))
Weighted = lcg.declare_term("weighted_ce", S.token("token_weight") * (S.lse - S.target_logit))
MeanAbs = lcg.declare_term("mean_abs_logit", S.vsum(S.Abs(S.logit)) / S.vocab_size)


def _ref(name, x, y, valid, token_weight=None):
    z = x.double()
    lse = torch.logsumexp(z, -1)
    zy = z.gather(-1, y.clamp_min(0)[:, None])[:, 0]
    py = torch.exp(zy - lse)
    per_row = {"poly1": lse - zy + 2.0 * (1 - py),
               "focal": -(1 - py) ** 2 * (zy - lse),
               "collision": (z.softmax(-1) ** 2).sum(-1),
               "weighted_ce": (token_weight.double() * (lse - zy)) if token_weight is not None else None,
               "mean_abs_logit": z.abs().mean(-1)}[name]
    return torch.where(valid, per_row, 0.0).sum() / valid.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("term,name", [(Poly1(eps=2.0), "poly1"), (Focal(gamma=2.0), "focal"),
                                       (Collision(), "collision"), (MeanAbs(), "mean_abs_logit")])
def test_declared_term_vs_autograd(term, name, dtype):
    logits, labels, _ = make_inputs(R=16, V=500, dtype=dtype)
    valid = labels != -100
    x = logits.detach().clone().requires_grad_()
    out = lcg.HeadLoss(term)(x, labels)
    out.loss.backward()
    xd = logits.detach().double().requires_grad_()
    ref = _ref(name, xd, labels, valid)
    ref.backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=tol, atol=tol)
    gtol = 2e-4 if dtype == torch.float32 else 1e-2
    assert (x.grad.double() - xd.grad).abs().max() <= gtol * xd.grad.abs().max()


def test_per_token_weight_and_collision_metric():
    logits, labels, g = make_inputs(R=16, V=256)
    weight = torch.rand(16, generator=g)
    valid = labels != -100
    head = lcg.HeadLoss(Weighted(), metrics=(Collision(),))
    x = logits.detach().clone().requires_grad_()
    out = head(x, labels, token_weight=weight)
    out.loss.backward()
    xd = logits.detach().double().requires_grad_()
    ref = _ref("weighted_ce", xd, labels, valid, token_weight=weight)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(out.metrics["collision"].double(),
                               _ref("collision", logits, labels, valid), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="token_weight"):
        head(x, labels)


@pytest.mark.parametrize("formula", [
    S.vsum(S.Abs(S.logit - S.token("center"))) / S.vocab_size,          # online: read in the stats loop
    S.vsum(S.softmax * S.log(1 + S.exp(S.logsoftmax - S.token("center")))),  # exact: a second read
])
def test_token_inside_a_reduction(formula):
    """A per-row input used inside vsum(...) is known to every read of the row."""
    Term = lcg.declare_term("in_vsum", formula)
    logits, labels, g = make_inputs(R=12, V=256)
    center = torch.randn(12, generator=g)
    valid = labels != -100
    x = logits.detach().clone().requires_grad_()
    out = lcg.HeadLoss(Term())(x, labels, center=center)
    out.loss.backward()
    xd = logits.detach().double().requires_grad_()
    c = center.double()[:, None]
    if formula.has(S.Abs):
        per_row = (xd - c).abs().mean(-1)
    else:
        logp = torch.log_softmax(xd, -1)
        per_row = (logp.exp() * torch.log1p(torch.exp(logp - c))).sum(-1)
    ref = torch.where(valid, per_row, 0.0).sum() / valid.sum()
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-7)


def test_collision_is_an_online_reduction_and_abs_is_too():
    for term in (Collision(), MeanAbs()):
        lw = lcg.HeadLoss(term).lowered()
        assert not lw.has_exact, str(lw)


def test_declare_errors():
    with pytest.raises(TypeError, match="missing parameter"):
        Poly1()
    with pytest.raises(TypeError, match="unknown parameter"):
        Poly1(eps=1.0, gamma=2.0)
    with pytest.raises(ValueError, match="identifier"):
        lcg.declare_term("not a name", S.lse)
    with pytest.raises(ValueError, match="nested"):
        lcg.declare_term("nested", S.vsum(S.vsum(S.logit)))
    with pytest.raises(ValueError, match="inside vsum"):
        lcg.declare_term("loose", S.logit - S.lse)
