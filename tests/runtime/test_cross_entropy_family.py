"""Parity of the cross-entropy family against float64 references (every term, every pair, all)."""
import itertools

import pytest
import torch

import losscodegen as lcg
from helpers import both_backends, check_head, make_inputs, run_backward
import reference as R

# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto")
pytestmark = pytest.mark.usefixtures("backend")

DTYPES = [torch.float32, torch.bfloat16]
SINGLE = {
    "ce": lambda: (lcg.CrossEntropy(),),
    "ce_smooth": lambda: (lcg.CrossEntropy(label_smoothing=0.1),),
    "z": lambda: (lcg.ZLoss(weight=1e-2),),
    "entropy": lambda: (lcg.Entropy(weight=0.3),),
}


@pytest.mark.parametrize("V", [256, 500, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SINGLE))
def test_single_term(name, V, dtype):
    logits, labels, _ = make_inputs(R=16, V=V, dtype=dtype)
    check_head(lcg.HeadLoss(*SINGLE[name]()), logits, labels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_metric_alone(dtype):
    logits, labels, _ = make_inputs(R=32, V=500, dtype=dtype)
    labels[::3] = logits.float().argmax(-1)[::3]  # some hits
    out = check_head(lcg.HeadLoss(metrics=(lcg.TokenAccuracy(),)), logits, labels)
    assert 0 < out.metrics["token_accuracy"] < 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", [p for p in itertools.combinations(sorted(SINGLE) + ["acc"], 2)
                                  if p != ("ce", "ce_smooth")])  # one name, one term per head
def test_pairs(pair, dtype):
    terms, metrics = [], []
    for name in pair:
        if name == "acc":
            metrics.append(lcg.TokenAccuracy())
        else:
            terms += SINGLE[name]()
    logits, labels, _ = make_inputs(R=16, V=500, dtype=dtype)
    check_head(lcg.HeadLoss(*terms, metrics=tuple(metrics)), logits, labels)


@pytest.mark.parametrize("V", [256, 500, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_combination(V, dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.05), lcg.ZLoss(weight=1e-3),
                        lcg.Entropy(weight=0.1), metrics=(lcg.TokenAccuracy(),))
    logits, labels, _ = make_inputs(R=20, V=V, dtype=dtype)
    check_head(head, logits, labels)


@pytest.mark.cpu
def test_entropy_as_metric_has_no_gradient():
    logits, labels, _ = make_inputs(R=16, V=256)
    out = check_head(lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),)), logits, labels)
    assert out.metrics["entropy"] > 0
    grads = []
    for head in (lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),)), lcg.HeadLoss(lcg.CrossEntropy())):
        x = logits.clone().requires_grad_()
        head(x, labels).loss.backward()
        grads.append(x.grad)
    # the metric adds nothing (an entropy gradient would be ~1e-2 here; the kernels differ by rounding)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("logit_scale,softcap", [(0.5, None), (1.0, 5.0), (2.0, 3.0)])
def test_logit_scale_and_softcap(logit_scale, softcap, dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2), metrics=(lcg.Entropy(),),
                        logit_scale=logit_scale, softcap=softcap)
    logits, labels, _ = make_inputs(R=16, V=500, dtype=dtype, scale=4.0)
    check_head(head, logits, labels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_mask_divisor_and_3d(dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2), metrics=(lcg.TokenAccuracy(),))
    logits, labels, g = make_inputs(R=24, V=500, dtype=dtype, shape=(4, 6))
    mask = torch.rand(4, 6, generator=g) > 0.3
    check_head(head, logits, labels, loss_mask=mask)
    check_head(head, logits, labels, loss_mask=mask, divisor=37.0)
    check_head(head, logits, labels, divisor=torch.tensor(11.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduction_none(dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=0.7), lcg.ZLoss(weight=1e-2), metrics=(lcg.Entropy(),))
    logits, labels, _ = make_inputs(R=12, V=256, dtype=dtype, shape=(3, 4))
    out = check_head(head, logits, labels, reduction="none")
    assert out.loss.shape == (3, 4)
    assert out.loss.reshape(-1)[1] == 0  # ignored row


def test_non_contiguous_rows():
    big, labels, _ = make_inputs(R=16, V=600)
    logits = big[:, 50:550]  # row stride 600, unit column stride: used as a view
    labels = labels.clamp(max=499)
    labels[1] = -100
    check_head(lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),)), logits, labels)
    check_head(lcg.HeadLoss(lcg.CrossEntropy()), big.t().contiguous().t()[:, :500], labels)


@pytest.mark.cpu
def test_zero_valid_rows_gives_zero_and_no_nan():
    logits, labels, _ = make_inputs(R=8, V=256)
    labels[:] = -100
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    x = logits.requires_grad_()
    out = head(x, labels)
    out.loss.backward()
    assert out.loss.item() == 0 and all(v.item() == 0 for v in {**out.terms, **out.metrics}.values())
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits_stay_finite(dtype):
    logits, labels, _ = make_inputs(R=8, V=500, dtype=dtype, scale=1e4)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-8), metrics=(lcg.Entropy(),))
    x = logits.requires_grad_()
    out = head(x, labels)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
    check_head(lcg.HeadLoss(lcg.CrossEntropy()), logits, labels, value_tol=(1e-5, 1e-2))


@pytest.mark.cpu
def test_bf16_confident_target_gradient():
    logits, labels, _ = make_inputs(R=16, V=4099, dtype=torch.float32, ignored=())
    rows = torch.arange(16)
    logits[rows, labels] = logits.max(-1).values + 10
    logits = logits.to(torch.bfloat16)
    x = logits.clone().requires_grad_()
    lcg.HeadLoss(lcg.CrossEntropy())(x, labels).loss.backward()
    ref = logits.double().softmax(-1)
    ref[rows, labels] -= 1
    ref /= 16
    got, want = x.grad.double()[rows, labels], ref[rows, labels]
    assert ((got - want).abs() / want.abs()).max() < 0.03


@pytest.mark.cpu
def test_backward_scales_by_upstream_gradient():
    logits, labels, _ = make_inputs(R=8, V=256)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1))
    x = logits.clone().requires_grad_()
    (3.0 * head(x, labels).loss).backward()
    y = logits.clone().requires_grad_()
    head(y, labels).loss.backward()
    torch.testing.assert_close(x.grad, 3.0 * y.grad)
    x2 = logits.reshape(2, 4, 256).clone().requires_grad_()
    w = torch.rand(2, 4)
    (head(x2, labels.reshape(2, 4), reduction="none").loss * w).sum().backward()
    n_valid = int((labels != -100).sum())
    torch.testing.assert_close(x2.grad.reshape(8, 256), y.grad * n_valid * w.reshape(8, 1),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.cpu
def test_no_grad_call_computes_values():
    logits, labels, _ = make_inputs(R=8, V=256)
    with torch.no_grad():
        out = lcg.HeadLoss(lcg.CrossEntropy())(logits.requires_grad_(), labels)
    assert out.loss.grad_fn is None
    valid = labels != -100
    want = torch.nn.functional.cross_entropy(logits.double()[valid], labels[valid])
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-5, atol=1e-6)


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_ce_family_with_metrics_matches_formulas(backend):
    x, y, _ = R.rows_in(16, 64, seed=1)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                        metrics=(lcg.Entropy(), lcg.TokenAccuracy()), backend=backend)
    out, g = run_backward(head, x, y)
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.ce_rows(z, y, 0.1), v) + 1e-2 * R.mean_over(R.z_loss_rows(z), v)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(out.terms["cross_entropy"], R.mean_over(R.ce_rows(x.double(), y, 0.1), v), R.FP32, "cross_entropy")
    R.close(out.terms["z_loss"], R.mean_over(R.z_loss_rows(x.double()), v), R.FP32, "z_loss (unweighted)")
    R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), R.FP32, "entropy")
    R.close(out.metrics["token_accuracy"], R.mean_over(R.accuracy_rows(x.double(), y), v), 1e-6, "token_accuracy")
    R.close(g, R.grad(loss, x), R.FP32, "grad")
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert not out.terms["z_loss"].requires_grad and not out.metrics["entropy"].requires_grad
