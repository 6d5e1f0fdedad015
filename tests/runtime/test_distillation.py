"""Distillation terms (teacher logits, temperatures, top-k teacher) against float64 references."""
import pytest
import torch

import losscodegen as lcg
from helpers import check_head, make_inputs

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
