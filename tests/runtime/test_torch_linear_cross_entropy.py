"""A user of torch's own fused linear cross-entropy (``F.linear_cross_entropy``,
``nn.LinearCrossEntropyLoss``, torch 2.13+) swaps in ``head.linear``: torch's function is called on
the same inputs (its reference path, ``options=None``, and its chunked path), and the values and the
gradients of hidden, weight and bias agree, fp32 and bf16, with ignored rows, for each reduction
(docs/coming-from.md, "From torch's linear_cross_entropy")."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import losscodegen as lcg

pytestmark = pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"),
                                reason="the installed torch has no F.linear_cross_entropy (torch >= 2.13)")

R, H, V = 13, 16, 72
# bf16: torch's own path rounds its logits (and its loss) to bf16, ours reads them in fp32, so the two
# differ by some bf16 ulps of the logits: the bound test_linear.py allows each against float64
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 3e-2)}      # (values, gradients)


def _inputs(dtype, ignore_index=-100):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(R, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (R,), generator=g)
    labels[[1, 7, 8]] = ignore_index
    # (multiples of 1/4: the same in bf16, the dtype torch wants them in, and in fp32, ours)
    class_weight = torch.randint(2, 8, (V,), generator=g) / 4
    return hidden, weight, bias, labels, class_weight


# each case: torch's keyword options, and the head (and head.linear's keywords) that compute the same
CASES = {
    # a bias, the default ignore_index (-100)
    "bias": lambda b, cw: (dict(linear_bias=b), lcg.HeadLoss(lcg.CrossEntropy()), dict(bias=b)),
    # class weights (torch's weight=), another ignore_index
    "class_weight": lambda b, cw: (dict(weight=cw.to(b.dtype), ignore_index=-1),
                                   lcg.HeadLoss(lcg.CrossEntropy(class_weight=cw), ignore_index=-1), {}),
    # label smoothing (torch's chunked path does not take it: its reference path is compared alone)
    "label_smoothing": lambda b, cw: (dict(linear_bias=b, label_smoothing=0.1),
                                      lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1)), dict(bias=b)),
}


def _grads(run, hidden, weight, bias, upstream):
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss = run(h, w, b)
    (loss.float() * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad, b.grad


def _close(got, want, tol, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} against torch's {tuple(want.shape)}"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = tol * max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} against torch's, bound {bound:.3g}"


@pytest.mark.usefixtures("backend")        # (the cases take turns on the Triton and torch backends)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_linear_matches_torchs_linear_cross_entropy(case, reduction, dtype):
    ignore = -1 if case == "class_weight" else -100
    hidden, weight, bias, labels, cw = _inputs(dtype, ignore)
    theirs, head, ours = CASES[case](bias, cw)
    # an upstream gradient that differs by row under reduction="none" (a per-row weighting)
    upstream = torch.linspace(0.5, 2.0, R) if reduction == "none" else torch.tensor(1.0)
    got = _grads(lambda h, w, b: head.linear(h, w, labels, reduction=reduction, chunk_rows=5,
                                             **{k: (b if k == "bias" else v) for k, v in ours.items()}).loss,
                 hidden, weight, bias, upstream)
    paths = {"reference": None}
    if case != "label_smoothing":
        paths["chunked"] = nn.LinearCrossEntropyOptions(batch_chunk_size=4, chunking_method=None)
    value_tol, grad_tol = TOL[dtype]
    for path, options in paths.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # (torch warns where it leaves its chunked path)
            want = _grads(lambda h, w, b: F.linear_cross_entropy(
                h, w, labels, reduction=reduction, options=options,
                **{k: (b if k == "linear_bias" else v) for k, v in theirs.items()}), hidden, weight, bias, upstream)
        _close(got[0], want[0], value_tol, f"{path} loss")
        for name, g, w in zip(("hidden", "weight", "bias"), got[1:], want[1:]):
            if w is None:       # (no bias given to torch: ours has none either)
                assert g is None, name
                continue
            assert g.dtype == dtype, f"grad of {name}: {g.dtype}"
            _close(g, w, grad_tol, f"{path} grad of {name}")


def test_a_linear_cross_entropy_loss_module_is_its_linear_and_a_head():
    """``nn.LinearCrossEntropyLoss`` holds its own Linear: its weight and bias go to head.linear."""
    hidden, _, _, labels, _ = _inputs(torch.float32)
    torch.manual_seed(0)
    module = nn.LinearCrossEntropyLoss(H, V, bias=True, label_smoothing=0.05)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.05))
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    want = module(h1, labels)
    want.backward()
    ref = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    got = head.linear(h2, module.linear.weight, labels, bias=module.linear.bias).loss
    got.backward()
    _close(got, want, 2e-5, "loss")
    _close(h2.grad, h1.grad, 1e-4, "grad of hidden")
    for name, p in module.named_parameters():
        _close(p.grad, ref[name], 1e-4, f"grad of {name}")
