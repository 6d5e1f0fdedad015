"""Terms no built-in covers, declared in a few lines: compiled and differentiated like built-ins,
checked with losscodegen.testing.assert_parity (and one hand-written reference, to check the checker)."""
import pytest
import torch

import losscodegen as lcg
from helpers import make_inputs
from losscodegen import symbols as S
from losscodegen.testing import assert_parity

# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto")
pytestmark = pytest.mark.usefixtures("backend")

p_y = S.exp(S.target_logit - S.lse)
Poly1 = lcg.declare_term("poly1", S.lse - S.target_logit + S.param("eps") * (1 - p_y))
Focal = lcg.declare_term("focal", -(1 - p_y) ** S.param("gamma") * (S.target_logit - S.lse))
Collision = lcg.declare_term("collision", S.vsum(S.softmax ** 2))
Weighted = lcg.declare_term("weighted_ce", S.token("token_weight") * (S.lse - S.target_logit))
MeanAbs = lcg.declare_term("mean_abs_logit", S.vsum(S.Abs(S.logit)) / S.vocab_size)


def _ref(name, x, y, valid):
    z = x.double()
    lse = torch.logsumexp(z, -1)
    zy = z.gather(-1, y.clamp_min(0)[:, None])[:, 0]
    py = torch.exp(zy - lse)
    per_row = {"poly1": lse - zy + 2.0 * (1 - py), "focal": -(1 - py) ** 2 * (zy - lse),
               "collision": (torch.softmax(z, -1) ** 2).sum(-1)}[name]
    return torch.where(valid, per_row, 0.0).sum() / valid.sum()


@pytest.mark.parametrize("term", [Poly1(eps=2.0), Focal(gamma=2.0), Collision(), MeanAbs()], ids=lambda t: t.name)
def test_declared_term_parity(term):
    assert_parity(lcg.HeadLoss(term), rows=16, vocab=500)


@pytest.mark.cpu
@pytest.mark.parametrize("term,name", [(Poly1(eps=2.0), "poly1"), (Focal(gamma=2.0), "focal"),
                                       (Collision(), "collision")])
def test_declared_term_vs_hand_written_autograd(term, name):
    """The checker's check: a reference written by hand, with autograd for the gradient."""
    logits, labels, _ = make_inputs(R=16, V=500)
    valid = labels != -100
    x = logits.detach().clone().requires_grad_()
    out = lcg.HeadLoss(term)(x, labels)
    out.loss.backward()
    xd = logits.detach().double().requires_grad_()
    ref = _ref(name, xd, labels, valid)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-4, atol=1e-4)
    assert (x.grad.double() - xd.grad).abs().max() <= 2e-4 * xd.grad.abs().max()


@pytest.mark.cpu
def test_per_token_weight_and_collision_metric():
    head = lcg.HeadLoss(Weighted(), metrics=(Collision(),))
    assert_parity(head, rows=16, vocab=256)
    logits, labels, _ = make_inputs(R=16, V=256)
    with pytest.raises(ValueError, match="token_weight"):
        head(logits, labels)


@pytest.mark.cpu
@pytest.mark.parametrize("formula", [
    S.vsum(S.Abs(S.logit - S.token("center"))) / S.vocab_size,          # online: read in the stats loop
    S.vsum(S.softmax * S.log(1 + S.exp(S.logsoftmax - S.token("center")))),  # exact: a second read
])
def test_token_inside_a_reduction(formula):
    """A per-row input used inside vsum(...) is known to every read of the row."""
    assert_parity(lcg.HeadLoss(lcg.declare_term("in_vsum", formula)()), rows=12, vocab=256)


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
        lcg.declare_term("nested", S.vsum(S.vsum(S.vsum(S.logit))))   # (one vsum inside another is allowed)
    with pytest.raises(ValueError, match="inside vsum"):
        lcg.declare_term("loose", S.logit - S.lse)
