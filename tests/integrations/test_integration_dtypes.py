"""head.linear under autocast and with mixed dtypes, as a model in a trainer calls it: under
autocast it computes in autocast's dtype as F.linear does (CPU autocast is bf16); outside autocast,
bf16 hidden states with an fp32 weight compute in fp32 (torch's type promotion; F.linear raises
there). Each input's gradient comes back in its own dtype. Checked against a float64 autograd
reference on the inputs rounded to the dtype computed in."""
import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg

R, H, V, Z = 11, 16, 96, 1e-2


def _reference(h, w, b, labels, th=None, tw=None):
    """CE + Z * z-loss (+ 0.5 * forward KL to the teacher) in float64: the loss."""
    z = h @ w.t() + b
    lse = torch.logsumexp(z, -1)
    valid = labels != -100
    rows = lse - z.gather(-1, labels.clamp_min(0)[:, None])[:, 0] + Z * lse ** 2
    if th is not None:
        logq = torch.log_softmax(th @ tw.t(), -1)
        rows = rows + 0.5 * (logq.exp() * (logq - torch.log_softmax(z, -1))).sum(-1)
    return (rows * valid).sum() / valid.sum()


@pytest.mark.parametrize("case", ["autocast_fp32_inputs", "autocast_bf16_hidden", "bf16_hidden_fp32_weight",
                                  "teacher_mixed"])
def test_linear_casts_as_f_linear_and_grads_keep_each_dtype(case):
    g = torch.Generator().manual_seed(0)
    h32, w32, b32 = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.3, torch.randn(V, generator=g)
    labels = torch.randint(0, V, (R,), generator=g)
    labels[[0, 4]] = -100
    autocast = case.startswith("autocast")
    hidden = h32.bfloat16() if case != "autocast_fp32_inputs" else h32
    compute = torch.bfloat16 if autocast else torch.float32
    terms, inputs, th, tw = (lcg.CrossEntropy(), lcg.ZLoss(weight=Z)), {}, None, None
    if case == "teacher_mixed":
        terms += (lcg.ForwardKL(weight=0.5),)
        th, tw = torch.randn(R, 8, generator=g).bfloat16(), torch.randn(V, 8, generator=g)
        inputs = dict(teacher_hidden=th, teacher_weight=tw)
    head = lcg.HeadLoss(*terms, metrics=(lcg.Entropy(),))

    h, w, b = hidden.clone().requires_grad_(), w32.clone().requires_grad_(), b32.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = head.linear(h, w, labels, bias=b, **inputs)
        if autocast:   # what F.linear does there: logits in autocast's dtype, and the same loss
            unfused = head(F.linear(h.detach(), w.detach(), b.detach()), labels)
            assert F.linear(h, w, b).dtype == torch.bfloat16
    if autocast:
        torch.testing.assert_close(out.loss, unfused.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (hidden.dtype, torch.float32, torch.float32)

    # the reference: every input rounded to the dtype computed in, then float64
    def rounded(t):
        return t.detach().to(compute).double().requires_grad_()
    hr, wr, br = rounded(h), rounded(w), rounded(b)
    ref = _reference(hr, wr, br, labels, *(rounded(t).detach() for t in (th, tw)) if th is not None else ())
    ref.backward()
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss.double(), ref.detach(), **tol)
    scale = max(hr.grad.abs().max().item(), wr.grad.abs().max().item())
    for got, want, name in ((h.grad, hr.grad, "hidden"), (w.grad, wr.grad, "weight"), (b.grad, br.grad, "bias")):
        err = (got.double() - want).abs().max().item()
        # (computed in bf16, or stored in bf16: bf16's rounding; fp32 throughout: fp32's)
        rel = 2e-2 if autocast or got.dtype == torch.bfloat16 else 1e-4
        assert err <= rel * scale, f"{name}: gradient error {err:.3g}, scale {scale:.3g}"


def test_a_weight_on_another_device_or_of_ints_is_still_refused():
    head = lcg.HeadLoss(lcg.CrossEntropy())
    with pytest.raises(TypeError, match="weight"):
        head.linear(torch.randn(4, 8), torch.randint(0, 3, (10, 8)), torch.zeros(4, dtype=torch.long))
