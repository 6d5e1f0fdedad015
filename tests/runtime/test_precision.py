"""fp32 precision on par with torch's own fp32: our error against float64 is at most twice torch's
(plus a floor of a few ulps of the value), torch computing the same formula the straightforward way
(log_softmax, kl_div, tanh, ...) in fp32 on the same inputs.

Triton's interpreter sums a tile one element after another (numpy along the tile's axis), an error
that grows with the tile's length; the GPU sums a tile as a tree, like torch. The Triton backend has
the interpreter sum pairwise while its kernels run (backends/triton/dispatch.py, ``_tree_sums``), so
that what this module measures on the CPU is the kernel's arithmetic, not the interpreter's order of
additions.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg
from losscodegen import symbols as S
import reference as R
from helpers import both_backends, run_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = torch.finfo(torch.float32).eps
FLOOR = 1e-9   # an absolute floor under torch's error, for the values it gets exactly right


def _err(ours: torch.Tensor, ref64: torch.Tensor) -> float:
    return (ours.double() - ref64).abs().max().item()


def assert_on_par(what: str, ours: torch.Tensor, torch32: torch.Tensor, ref64: torch.Tensor,
                  ulps: float = 4, floor: float = FLOOR) -> None:
    """Each entry within twice torch's worst error, plus ``ulps`` fp32 ulps of its own size."""
    ours, ref64 = ours.detach().double().cpu(), ref64.detach().double().cpu()
    torch_err = _err(torch32.detach().cpu(), ref64)
    bar = 2 * torch_err + ulps * EPS32 * ref64.abs() + floor
    excess = ((ours - ref64).abs() - bar).max().item()
    assert excess <= 0, (f"{what}: error {_err(ours, ref64):.3g} against float64, torch fp32's "
                         f"{torch_err:.3g} (x2 plus {ulps} ulps allowed)")


@pytest.mark.cpu
def test_softcap_is_as_precise_as_torch():
    # issue 25's repro: the capped logit 30*tanh(x/30) ~ x, whose error must be relative to x
    torch.manual_seed(42)
    x = torch.randn(4, 8)
    y = torch.randint(0, 8, (4,))
    head = lcg.HeadLoss(lcg.CrossEntropy(), softcap=30.0)
    ours_x = x.clone().requires_grad_()
    ours = head(ours_x, y, reduction="none").loss
    ours.sum().backward()
    results = {}
    for dtype in (torch.float32, torch.float64):
        xx = x.to(dtype).clone().requires_grad_()
        loss = F.cross_entropy(30.0 * torch.tanh(xx / 30.0), y, reduction="none")
        loss.sum().backward()
        results[dtype] = (loss.detach(), xx.grad)
    (v32, g32), (v64, g64) = results[torch.float32], results[torch.float64]
    assert_on_par("softcap CE value", ours.detach(), v32, v64, ulps=0)
    assert_on_par("softcap CE gradient", ours_x.grad, g32, g64, ulps=0)


def _accumulators(head: lcg.HeadLoss) -> tuple[int, int]:
    """(accumulators kept, accumulators before combining), as ``explain()`` reports them."""
    lw = head.plan().lowered
    return len(lw.accumulators), lw.uncombined


@pytest.mark.parametrize("make, counts", [
    (lambda: lcg.HeadLoss(lcg.ForwardKL()), (3, 4)),
    (lambda: lcg.HeadLoss(lcg.ReverseKL()), (3, 4)),
    # JSD's two KL sums, and its gradient's one sum through LSE(z): -beta times the KL(p||m) sum
    (lambda: lcg.HeadLoss(lcg.JSD()), (4, 4)),
    (lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(weight=0.5),
                          metrics=(lcg.Entropy(),)), (4, 5)),
    (lambda: lcg.HeadLoss(lcg.TopKForwardKL()), (3, 4)),
])
def test_sums_that_share_a_weight_are_one_accumulator(make, counts):
    head = make()
    assert _accumulators(head) == counts
    shown = f"({counts[0]}; {counts[1]} before combining" if counts[0] < counts[1] else f"({counts[0]}):"
    assert f"accumulators {shown}" in head.explain()


def test_declared_sums_are_combined_only_where_read_as_one_difference():
    # written as two reductions: still one accumulator, sum q (t - z), and the value right
    q = S.teacher_prob
    gap = lcg.declare_term("gap", S.vsum(q * S.teacher_logit) - S.vsum(q * S.logit))
    head = lcg.HeadLoss(gap())
    assert _accumulators(head) == (2, 3)
    assert "* (tm - zm)" in head.explain() or "* (-tm + zm)" in head.explain()   # t - m_t - (z - m)
    lcg.testing.assert_parity(head, rows=6, vocab=100, dtypes=(torch.float32,))
    # read as a product, the two sums stay apart
    prod = lcg.declare_term("prod", S.vsum(q * S.teacher_logit) * S.vsum(q * S.logit))
    assert _accumulators(lcg.HeadLoss(prod())) == (3, 3)
    # a difference in the value but not in the gradient's coefficients: apart as well
    mixed = lcg.declare_term("mixed", S.vsum(q * S.teacher_logit) - S.vsum(q * S.logit) + S.vsum(q * S.logit) ** 2)
    assert _accumulators(lcg.HeadLoss(mixed())) == (3, 3)


@pytest.mark.cpu
def test_combined_forward_kl_cancels_less():
    # issue 25: forward KL as two sums subtracted afterwards lost 1.2e-5 per row at V=1271 (torch
    # fp32 2.5e-7); one sum of the difference keeps it within 2x torch's
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(16, 1271, generator=g) * 2, torch.randn(16, 1271, generator=g) * 2
    y = torch.randint(0, 1271, (16,), generator=g)
    ours = lcg.HeadLoss(lcg.ForwardKL())(x, y, teacher_logits=t, reduction="none").loss
    per_row = {d: F.kl_div(torch.log_softmax(x.to(d), -1), torch.log_softmax(t.to(d), -1), log_target=True,
                           reduction="none").sum(-1) for d in (torch.float32, torch.float64)}
    assert_on_par("forward KL per row", ours, per_row[torch.float32], per_row[torch.float64], ulps=0)


# ---- the sweep: every built-in term and metric, rows with large logit ranges ---------------------
def _rows(R: int, V: int, g: torch.Generator) -> torch.Tensor:
    """Logit rows of very different shapes, in a cycle of 8: N(0, s) for s from 1 to 30, a few
    outliers 40 above the rest, rows offset by +100 (a large lse), uniform rows 100 wide."""
    dev = g.device
    kind = torch.arange(R, device=dev) % 8
    x = torch.randn(R, V, generator=g, dtype=torch.float64, device=dev)
    x *= torch.tensor([1.0, 8.0, 2.0, 30.0, 3.0, 1.0, 4.0, 1.0], dtype=torch.float64, device=dev)[kind, None]
    spikes = torch.randint(0, V, (R, 3), generator=g, device=dev)
    x.scatter_add_(1, spikes, torch.where(kind == 2, 40.0, 0.0)[:, None].expand(R, 3).double())
    x += torch.where(kind == 4, 100.0, 0.0)[:, None].double()
    uniform = torch.rand(R, V, generator=g, dtype=torch.float64, device=dev) * 100 - 80
    return torch.where((kind == 5)[:, None], uniform, x).float()


def sweep_inputs(V: int, R: int = 8, seed: int = 0, device: str = "cpu"):
    """Logits, labels (every 8th row ignored) and every input a built-in term reads."""
    g = torch.Generator(device=device).manual_seed(seed)
    x, t = _rows(R, V, g), _rows(R, V, g)
    y = torch.randint(0, V, (R,), generator=g, device=device)
    y[7::8] = -100
    with torch.no_grad():
        l = torch.log_softmax(x.double(), -1).gather(-1, y.clamp_min(0)[:, None])[:, 0]
    K = 8
    noise = lambda: torch.randn(R, generator=g, dtype=torch.float64, device=device)
    start = torch.randint(0, V, (R, 1), generator=g, device=device)
    inputs = dict(
        teacher_logits=t, advantages=noise().float(),
        old_logprobs=(l + 0.3 * noise()).float(), ref_logprobs=(l + 0.1 * noise()).float(),
        teacher_topk_ids=(start + 7 * torch.arange(K, device=device)) % V,   # distinct for V > 7K
        teacher_topk_logprobs=torch.log_softmax(3 * torch.randn(R, K, generator=g, dtype=torch.float64,
                                                                device=device), -1).float(),
        segment_ids=torch.arange(R, device=device) // 3)
    return x, y, inputs


def _lsm(z, T=1.0):
    return torch.log_softmax(z / T, -1)


def _at(v, idx):
    return v.gather(-1, idx.clamp_min(0)[:, None])[:, 0]


def _jsd(z, t, beta):
    logp, logq = _lsm(z), _lsm(t)
    logm = torch.logsumexp(torch.stack([logp + math.log(beta), logq + math.log(1 - beta)]), 0)
    return beta * (logp.exp() * (logp - logm)).sum(-1) + (1 - beta) * (logq.exp() * (logq - logm)).sum(-1)


def _logratio(z, y, I):
    return _at(_lsm(z), y) - I["old_logprobs"].to(z.dtype)


def _grpo(z, y, I, kl_beta):
    l = _at(_lsm(z), y)
    r, A, d = torch.exp(l - I["old_logprobs"].to(z.dtype)), I["advantages"].to(z.dtype), I["ref_logprobs"].to(z.dtype) - l
    return -torch.min(r * A, r.clamp(0.8, 1.2) * A) + kl_beta * (torch.exp(d) - d - 1)


def _ref_kl(z, y, I):
    d = I["ref_logprobs"].to(z.dtype) - _at(_lsm(z), y)
    return torch.exp(d) - d - 1


def _sapo(z, y, I):
    A = I["advantages"].to(z.dtype)
    tau = torch.where(A > 0, 1.0, 1.05).to(z.dtype)
    return -torch.sigmoid(tau * (_logratio(z, y, I).exp() - 1)) * 4 / tau * A


def _topk(z, I):
    l = I["teacher_topk_logprobs"].to(z.dtype)
    return (l.exp() * (l - _lsm(z).gather(-1, I["teacher_topk_ids"]))).sum(-1)


def _gspo(z, y, I):
    """Summed over non-empty segments and divided by their number (a scalar, not per row)."""
    valid = y != -100
    u, seg = torch.where(valid, _logratio(z, y, I), 0), I["segment_ids"]
    n = torch.zeros(int(seg.max()) + 1, dtype=z.dtype, device=z.device).index_add_(0, seg, valid.to(z.dtype))
    mean = lambda v: torch.zeros_like(n).index_add_(0, seg, torch.where(valid, v, 0)) / n.clamp_min(1)
    R, A = torch.exp(mean(u)), mean(I["advantages"].to(z.dtype))
    value = -torch.min(R * A, R.clamp(1 - 3e-4, 1 + 4e-4) * A)
    return torch.where(n > 0, value, 0).sum() / (n > 0).sum()


# name -> (term, its per-row value computed by torch the straightforward way)
TERMS = {
    "cross_entropy": (lcg.CrossEntropy(), lambda z, y, I: F.cross_entropy(z, y.clamp_min(0), reduction="none")),
    "cross_entropy_ls": (lcg.CrossEntropy(label_smoothing=0.1), lambda z, y, I: F.cross_entropy(
        z, y.clamp_min(0), reduction="none", label_smoothing=0.1)),
    "z_loss": (lcg.ZLoss(), lambda z, y, I: torch.logsumexp(z, -1) ** 2),
    "entropy": (lcg.Entropy(), lambda z, y, I: -(_lsm(z).exp() * _lsm(z)).sum(-1)),
    "forward_kl": (lcg.ForwardKL(), lambda z, y, I: F.kl_div(_lsm(z), _lsm(I["t"]), log_target=True,
                                                              reduction="none").sum(-1)),
    "forward_kl_T2": (lcg.ForwardKL(temperature=2.0), lambda z, y, I: F.kl_div(
        _lsm(z, 2.0), _lsm(I["t"], 2.0), log_target=True, reduction="none").sum(-1)),
    "reverse_kl": (lcg.ReverseKL(), lambda z, y, I: F.kl_div(_lsm(I["t"]), _lsm(z), log_target=True,
                                                              reduction="none").sum(-1)),
    "jsd": (lcg.JSD(), lambda z, y, I: _jsd(z, I["t"], 0.5)),
    "jsd_beta_0.1": (lcg.JSD(beta=0.1), lambda z, y, I: _jsd(z, I["t"], 0.1)),
    "topk_forward_kl": (lcg.TopKForwardKL(), lambda z, y, I: _topk(z, I)),
    "grpo": (lcg.GRPO(kl_beta=0.04), lambda z, y, I: _grpo(z, y, I, 0.04)),
    "ref_kl": (lcg.RefKL(), lambda z, y, I: _ref_kl(z, y, I)),
    "cispo": (lcg.CISPO(), lambda z, y, I: -torch.clamp(_logratio(z, y, I).exp(), max=5.0).detach()
              * I["advantages"].to(z.dtype) * _at(_lsm(z), y)),
    "sapo": (lcg.SAPO(), lambda z, y, I: _sapo(z, y, I)),
    "logprob": (lcg.LogProb(), lambda z, y, I: _at(_lsm(z), y)),
    "gspo": (lcg.GSPO(), _gspo),
}
METRICS = {
    "token_accuracy": (lcg.TokenAccuracy(), lambda z, y, I: (z.argmax(-1) == y).to(z.dtype)),
    "ratio_mean": (lcg.RatioMean(), lambda z, y, I: _logratio(z, y, I).exp()),
    "kl_new_old": (lcg.KLNewOld(), lambda z, y, I: _logratio(z, y, I).exp() - _logratio(z, y, I) - 1),
    "clip_fraction": (lcg.ClipFraction(), lambda z, y, I: (
        (_logratio(z, y, I).exp() < 0.8) | (_logratio(z, y, I).exp() > 1.2)).to(z.dtype)),
    "clip_ratio_low": (lcg.ClipRatioLow(), lambda z, y, I: _clipped(z, y, I)[0].to(z.dtype)),
    "clip_ratio_high": (lcg.ClipRatioHigh(), lambda z, y, I: _clipped(z, y, I)[1].to(z.dtype)),
    "clip_ratio_region": (lcg.ClipRatioRegion(), lambda z, y, I: (
        _clipped(z, y, I)[0] | _clipped(z, y, I)[1]).to(z.dtype)),
    "cispo_clip_ratio": (lcg.CISPOClipRatio(), lambda z, y, I: (
        (_logratio(z, y, I).exp() > 5.0) & (I["advantages"] > 0)).to(z.dtype)),
}


def _clipped(z, y, I):
    """TRL's sign-aware clip sides: (low with A < 0, high with A > 0), eps 0.2."""
    r, A = _logratio(z, y, I).exp(), I["advantages"]
    return (r < 0.8) & (A < 0), (r > 1.2) & (A > 0)


def test_the_sweep_covers_every_builtin():
    names = {t.name for t, _ in TERMS.values()} | {t.name for t, _ in METRICS.values()}
    assert names == {factory().name for factory in lcg.terms.BUILTINS}


def torch_side(fn, x, y, I, dtype, grad_dtype=None):
    """(value, d value.sum() / d x) by torch in ``dtype``, on valid rows; the gradient rounded to
    ``grad_dtype`` (the logits' dtype) as a kernel storing it would."""
    xx = x.detach().to(dtype).clone().requires_grad_()
    J = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in I.items()}
    J["t"] = J["teacher_logits"]
    value = fn(xx, y, J)
    if value.dim():
        value = torch.where(y != -100, value, 0)
    if not value.requires_grad:   # a count (accuracy, clip fraction)
        return value, None
    value.sum().backward()
    grad = xx.grad if grad_dtype is None else xx.grad.to(grad_dtype).to(dtype)
    return value.detach(), grad


def check_term(name: str, V: int, device: str = "cpu", dtype=torch.float32, rows: int = 8) -> None:
    term, fn = TERMS[name]
    x, y, I = sweep_inputs(V, rows, device=device)
    x, I["teacher_logits"] = x.to(dtype), I["teacher_logits"].to(dtype)
    head = lcg.HeadLoss(term)
    xx = x.clone().requires_grad_()
    # a segment term is one value (the mean over segments), the others per row
    out = head(xx, y, reduction="mean" if name == "gspo" else "none", **I)
    out.loss.sum().backward()
    v32, g32 = torch_side(fn, x, y, I, torch.float32, dtype)
    v64, g64 = torch_side(fn, x, y, I, torch.float64)
    assert_on_par(f"{name} value (V={V})", out.loss, v32, v64)
    assert_on_par(f"{name} gradient (V={V})", xx.grad, g32, g64)


@pytest.mark.parametrize("V", [200, 3001])
@pytest.mark.parametrize("name", list(TERMS))
def test_precision_on_par_with_torch(name, V):
    check_term(name, V)


@pytest.mark.cpu
def test_log_of_a_mixture_where_both_underflow():
    # A declared skewed KL, KL(p || a p + (1 - a) q): where p and q both underflow at finite logits
    # (entries 150 below the rows' maxima), the mixture is 0 in fp32 and p (log p - log M) was
    # 0 * inf, NaN, in the value and in the gradient's p / M. The compiler takes the log and the
    # reciprocal of a sum of exponentials of M + TINY, for any formula: torch's logsumexp form of
    # the same mixture is the fp32 error to match.
    a = 0.3
    p, logp, logq = S.softmax, S.logsoftmax, S.teacher_logprob
    skew = lcg.declare_term("skew_kl", S.vsum(p * (logp - S.log(a * p + (1 - a) * S.teacher_prob))))
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(6, 300, generator=g) * 2, torch.randn(6, 300, generator=g) * 2
    deep = torch.rand(6, 300, generator=g) < 0.3
    x, t = x.masked_fill(deep, -150.0), t.masked_fill(deep, -150.0)
    y = torch.randint(0, 300, (6,), generator=g)
    xx = x.clone().requires_grad_()
    out = lcg.HeadLoss(skew())(xx, y, teacher_logits=t, reduction="none")
    out.loss.sum().backward()

    def by_torch(dtype):
        z = x.to(dtype).clone().requires_grad_()
        lp, lq = torch.log_softmax(z, -1), torch.log_softmax(t.to(dtype), -1)
        logm = torch.logsumexp(torch.stack([lp + math.log(a), lq + math.log(1 - a)]), 0)
        value = (lp.exp() * (lp - logm)).sum(-1)
        value.sum().backward()
        return value.detach(), z.grad
    (v32, g32), (v64, g64) = by_torch(torch.float32), by_torch(torch.float64)
    assert torch.isfinite(out.loss).all() and torch.isfinite(xx.grad).all()
    assert_on_par("skewed KL value", out.loss, v32, v64)
    assert_on_par("skewed KL gradient", xx.grad, g32, g64)


@pytest.mark.cpu
@pytest.mark.parametrize("V", [200, 3001])
def test_metrics_on_par_with_torch(V):
    x, y, I = sweep_inputs(V)
    out = lcg.HeadLoss(metrics=tuple(t for t, _ in METRICS.values()))(x, y, **I)
    valid = (y != -100).sum()
    for name, (_, fn) in METRICS.items():
        v32, v64 = (torch_side(fn, x, y, I, d)[0].sum() / valid for d in (torch.float32, torch.float64))
        # a mean of rows whose log-probs reach -90 (an ulp of 7.6e-6): a floor of 1e-7
        assert_on_par(f"{name} (V={V})", out.metrics[name], v32, v64, floor=1e-7)


GPU_ROWS, GPU_VOCAB = 4096, 128256


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TERMS))
def test_precision_on_par_with_torch_at_scale(name, dtype):
    # bf16 logits: both sides read the same bf16 values and compute in fp32; torch's gradient is
    # rounded to bf16 as ours is stored
    check_term(name, GPU_VOCAB, device="cuda", dtype=dtype, rows=GPU_ROWS)
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_metrics_on_par_with_torch_at_scale():
    x, y, I = sweep_inputs(GPU_VOCAB, GPU_ROWS, device="cuda")
    out = lcg.HeadLoss(metrics=tuple(t for t, _ in METRICS.values()))(x, y, **I)
    valid = (y != -100).sum()
    for name, (_, fn) in METRICS.items():
        v32, v64 = (torch_side(fn, x, y, I, d)[0].sum() / valid for d in (torch.float32, torch.float64))
        assert_on_par(f"{name} (4096 x 128256)", out.metrics[name], v32, v64, floor=1e-7)


@pytest.mark.cpu
def test_kl_penalty_for_small_log_ratios_is_precise_to_a_few_ulps():
    """GRPO's KL penalty e^d - d - 1 (d = ref_logprobs - log p_y) for |d| from 1e-5 to 1, and its
    gradient (e^d - 1) (p - onehot(y)): within a few ulps of their values beyond what the rounding
    of d itself (a few ulps of its parts) moves them, whatever libm's exp rounds: lowering writes
    them as expm1mx(d) and expm1(d), where e^d - d - 1 would cancel (its error was measured against
    torch's own fp32 error, which depends on the machine's libm)."""
    g = torch.Generator().manual_seed(0)
    R, V = 12, 64
    x = (torch.randn(R, V, generator=g) * 2).double()
    y = torch.randint(0, V, (R,), generator=g)
    d = torch.logspace(-5, 0, R, dtype=torch.float64) * torch.tensor([1.0, -1.0]).repeat(R // 2)
    logp = torch.log_softmax(x, -1)
    ref = (logp.gather(1, y[:, None])[:, 0] + d).float()
    xx = x.float().clone().requires_grad_()
    out = lcg.HeadLoss(lcg.RefKL())(xx, y, ref_logprobs=ref, reduction="none")
    out.loss.sum().backward()
    dd = ref.double() - logp.gather(1, y[:, None])[:, 0]
    m = x.max(-1).values
    # d's own rounding in fp32: a few ulps of its parts (ref, z_y - m, log of the normaliser's sum)
    d_err = 4 * EPS32 * (ref.double().abs() + (x.gather(1, y[:, None])[:, 0] - m).abs()
                         + (torch.logsumexp(x, -1) - m))
    want = torch.expm1(dd) - dd
    bar = 8 * EPS32 * want.abs() + torch.expm1(dd).abs() * d_err
    assert ((out.loss.double() - want).abs() <= bar).all(), (out.loss.double() - want).abs() / bar
    p, onehot = logp.exp(), torch.nn.functional.one_hot(y, V).double()
    want_grad = -torch.expm1(dd)[:, None] * (onehot - p)
    bar = (8 * EPS32 * torch.expm1(dd).abs() + dd.exp() * d_err)[:, None] * ((onehot - p).abs() + p)
    assert ((xx.grad.double() - want_grad).abs() <= bar).all(), ((xx.grad.double() - want_grad).abs() / bar).max()


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
@pytest.mark.parametrize("transform", [{"softcap": 5.0}, {"logit_scale": 0.5}])
def test_softcap_and_logit_scale_apply_to_student_only(backend, transform):
    x, y, t = R.rows_in(10, 40, seed=13, scale=4.0)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), backend=backend, **transform)
    out, g = run_backward(head, x, y, teacher_logits=t)
    v = R.valid_rows(y)

    def loss(z):
        z = R.transform(z, **transform)
        return R.mean_over(R.ce_rows(z, y), v) + 0.5 * R.mean_over(R.forward_kl_rows(z, t), v)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(g, R.grad(loss, x), R.FP32, "grad")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_bf16_logits_computed_in_fp32(backend):
    x, y, t = R.rows_in(12, 64, seed=14, dtype=torch.bfloat16)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ReverseKL(weight=0.5), metrics=(lcg.Entropy(),), backend=backend)
    out, g = run_backward(head, x, y, teacher_logits=t)
    assert out.loss.dtype == torch.float32 and g.dtype == torch.bfloat16
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.ce_rows(z, y), v) + 0.5 * R.mean_over(R.reverse_kl_rows(z, t), v)
    R.close(out.loss, loss(x.double()), 1e-4, "loss")
    R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), 1e-4, "entropy")
    want = R.grad(loss, x)
    R.close(g, want, 1e-2 * max(1.0, 1 / float(want.abs().max())), "grad")
