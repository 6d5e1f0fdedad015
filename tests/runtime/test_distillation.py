"""Distillation terms (teacher logits, temperatures, top-k teacher) against float64 references."""
import pytest
import torch

import losscodegen as lcg
from helpers import both_backends, check_head, make_inputs, run_backward
import reference as R

# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto")
pytestmark = pytest.mark.usefixtures("backend")


def _teacher(logits, g, dtype=None):
    t = torch.randn(logits.shape, generator=g) * 2 + 0.5 * logits.float()
    return t.to(dtype or logits.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1.0, 2.0])
@pytest.mark.parametrize("make", [lcg.ForwardKL, lcg.ReverseKL])
def test_kl(make, T, dtype):
    logits, labels, g = make_inputs(R=16, V=500, dtype=dtype)
    check_head(lcg.HeadLoss(make(temperature=T)), logits, labels, teacher_logits=_teacher(logits, g))


@pytest.mark.parametrize("beta", [0.25, 0.5, 0.9])
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_jsd(beta, T):
    logits, labels, g = make_inputs(R=16, V=500)
    check_head(lcg.HeadLoss(lcg.JSD(beta=beta, temperature=T)), logits, labels,
               teacher_logits=_teacher(logits, g))


def test_jsd_bf16():
    logits, labels, g = make_inputs(R=16, V=4099, dtype=torch.bfloat16)
    check_head(lcg.HeadLoss(lcg.JSD(beta=0.5)), logits, labels, teacher_logits=_teacher(logits, g))


def test_bf16_teacher_fp32_student_and_no_labels():
    logits, _, g = make_inputs(R=16, V=500)
    teacher = _teacher(logits, g, torch.bfloat16)
    mask = torch.rand(16, generator=g) > 0.3
    head = lcg.HeadLoss(lcg.ForwardKL(temperature=2.0), lcg.ReverseKL(weight=0.5))
    check_head(head, logits, None, teacher_logits=teacher, loss_mask=mask)
    check_head(head, logits, None, teacher_logits=teacher)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [256, 4099])
def test_mix_with_cross_entropy(V, dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.ZLoss(weight=1e-3),
                        lcg.ForwardKL(weight=0.5, temperature=2.0), metrics=(lcg.Entropy(),))
    logits, labels, g = make_inputs(R=16, V=V, dtype=dtype)
    check_head(head, logits, labels, teacher_logits=_teacher(logits, g))


@pytest.mark.parametrize("T", [1.0, 2.0])
@pytest.mark.parametrize("K", [1, 8, 128])
def test_topk_forward_kl(K, T):
    R, V = 12, 500
    logits, labels, g = make_inputs(R=R, V=V)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R)])
    lps = torch.log_softmax(torch.randn(R, K + 3, generator=g), -1)[:, :K]
    head = lcg.HeadLoss(lcg.TopKForwardKL(temperature=T), lcg.CrossEntropy(weight=0.3))
    check_head(head, logits, labels, teacher_topk_ids=ids, teacher_topk_logprobs=lps)


def test_plans():
    fkl = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(weight=0.5),
                       metrics=(lcg.Entropy(),)).plan()
    assert fkl.reads == 1 and not fkl.lowered.has_exact
    assert len(fkl.launches(sharded=False, grad=True)) == 1
    jsd = lcg.HeadLoss(lcg.JSD()).plan()
    assert jsd.reads == 2 and jsd.lowered.has_exact
    mixed = lcg.HeadLoss(lcg.ForwardKL(temperature=1.0), lcg.ReverseKL(temperature=2.0)).plan()
    assert mixed.reads == 1


@pytest.mark.cpu
def test_missing_teacher_is_named():
    logits, labels, _ = make_inputs(R=4, V=256)
    with pytest.raises(ValueError, match="teacher_logits"):
        lcg.HeadLoss(lcg.ForwardKL())(logits, labels)
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        lcg.HeadLoss(lcg.TopKForwardKL())(logits, labels)
    with pytest.raises(ValueError, match="teacher_logits"):
        lcg.HeadLoss(lcg.ForwardKL())(logits, labels, teacher_logits=logits[:, :10])


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_distillation_terms_with_temperature_match_formulas(backend):
    x, y, t = R.rows_in(12, 50, seed=2)
    head = lcg.HeadLoss(lcg.ForwardKL(weight=0.5, temperature=2.0), lcg.ReverseKL(weight=0.3, temperature=0.7),
                        lcg.JSD(beta=0.3, temperature=1.5), backend=backend)
    out, g = run_backward(head, x, y, teacher_logits=t)
    v = R.valid_rows(y)
    parts = {"forward_kl": lambda z: R.forward_kl_rows(z, t, 2.0), "reverse_kl": lambda z: R.reverse_kl_rows(z, t, 0.7),
             "jsd": lambda z: R.jsd_rows(z, t, 0.3, 1.5)}
    weights = {"forward_kl": 0.5, "reverse_kl": 0.3, "jsd": 1.0}

    def loss(z):
        return sum(weights[k] * R.mean_over(f(z), v) for k, f in parts.items())
    for k, f in parts.items():
        R.close(out.terms[k], R.mean_over(f(x.double()), v), R.FP32, k)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(g, R.grad(loss, x), R.FP32, "grad")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_topk_forward_kl_matches_formula(backend):
    x, y, t = R.rows_in(10, 40, seed=3)
    g0 = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(40, generator=g0)[:5] for _ in range(10)])
    lps = torch.log_softmax(t, -1).gather(1, ids)
    head = lcg.HeadLoss(lcg.TopKForwardKL(temperature=1.3), backend=backend)
    out, g = run_backward(head, x, y, teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.topk_forward_kl_rows(z, ids, lps, 1.3), v)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(g, R.grad(loss, x), R.FP32, "grad")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_distillation_only_head_without_labels_uses_loss_mask(backend):
    x, _, t = R.rows_in(10, 40, seed=12)
    mask = torch.arange(10) % 3 != 0
    head = lcg.HeadLoss(lcg.ReverseKL(), backend=backend)
    xx = x.clone().requires_grad_(True)
    out = head(xx, None, teacher_logits=t, loss_mask=mask)
    out.loss.backward()

    def loss(z):
        return R.mean_over(R.reverse_kl_rows(z, t), mask)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(xx.grad, R.grad(loss, x), R.FP32, "grad")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_at_beta_limits_is_zero(backend, beta):
    x, y, t = R.rows_in(8, 30, seed=20)
    xx = x.clone().requires_grad_(True)
    out = lcg.HeadLoss(lcg.JSD(beta=beta), backend=backend)(xx, y, teacher_logits=t)
    out.loss.backward()
    R.close(out.loss, R.mean_over(R.jsd_rows(x.double(), t, beta), R.valid_rows(y)), R.FP32, "jsd")
    assert not torch.isnan(xx.grad).any() and xx.grad.abs().max() < 1e-6
