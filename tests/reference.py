"""Independent float64 references: torch formulas written from CONTRACT.md and docs/api.md (their
tables and notation), not from losscodegen: nothing here imports it, so the expected values never come
from the code they check (``losscodegen.testing``'s reference prints the head's own formulas; this one
is written by hand). The ``*_rows`` functions take float64 student logits ``z`` [R, V] (already
softcapped/scaled) and return the per-row value [R], 0 log 0 = 0 where a logit is -inf;
``head_reference`` reduces them as the contract says and autograd gives the gradient."""
import math

import torch

IGNORE = -100
FP32 = 2e-5     # an fp32 head's tolerance against these float64 formulas (``close``)


def rows_in(R=16, V=64, *, seed=0, scale=2.0, ignored=(1, 6), dtype=torch.float32):
    """Logits [R, V] (in ``dtype``), labels [R] with ``ignored`` rows set to -100, teacher logits [R, V]."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, V, generator=g) * scale).to(dtype)
    y = torch.randint(0, V, (R,), generator=g)
    for i in ignored:
        if i < R:
            y[i] = IGNORE
    t = (torch.randn(R, V, generator=g) * scale).to(dtype)
    return x, y, t


def valid_rows(y, loss_mask=None, ignore_index=IGNORE):
    v = y != ignore_index
    if loss_mask is not None:
        v = v & loss_mask
    return v


def transform(z, *, softcap=None, logit_scale=1.0):
    z = z.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * logit_scale


def _xlogy_rows(a, la, lb):
    """sum_i a_i (la_i - lb_i) with the 0*log 0 = 0 convention (a_i == 0 contributes 0)."""
    d = torch.where(a > 0, a * (la - lb), torch.zeros_like(a))
    return d.sum(-1)


def ce_rows(z, y, e=0.0):
    lse = torch.logsumexp(z, -1)
    zy = z.gather(-1, y.clamp_min(0)[..., None])[..., 0]
    if e == 0:     # (no smoothing term: mean_i z_i is -inf on rows with -inf logits)
        return lse - zy
    return (1 - e) * (lse - zy) + e * (lse - z.mean(-1))


def z_loss_rows(z):
    return torch.logsumexp(z, -1) ** 2


def entropy_rows(z):
    lp = torch.log_softmax(z, -1)
    p = lp.exp()
    return -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)


def accuracy_rows(z, y):
    return (z.argmax(-1) == y).double()


def forward_kl_rows(z, t, T=1.0):
    lq = torch.log_softmax(t.double() / T, -1)
    lp = torch.log_softmax(z / T, -1)
    return _xlogy_rows(lq.exp(), lq, lp)


def reverse_kl_rows(z, t, T=1.0):
    lq = torch.log_softmax(t.double() / T, -1)
    lp = torch.log_softmax(z / T, -1)
    return _xlogy_rows(lp.exp(), lp, lq)


def jsd_rows(z, t, beta=0.5, T=1.0):
    lq = torch.log_softmax(t.double() / T, -1)
    lp = torch.log_softmax(z / T, -1)
    p, q = lp.exp(), lq.exp()
    m = beta * p + (1 - beta) * q
    lm = torch.log(m)
    return beta * _xlogy_rows(p, lp, lm) + (1 - beta) * _xlogy_rows(q, lq, lm)


def topk_forward_kl_rows(z, ids, lps, T=1.0):
    lp = torch.log_softmax(z / T, -1).gather(-1, ids)
    lps = lps.double()
    return torch.where(torch.isfinite(lps), lps.exp() * (lps - lp), torch.zeros_like(lp)).sum(-1)


def logprob_rows(z, y):
    return torch.log_softmax(z, -1).gather(-1, y.clamp_min(0)[..., None])[..., 0]


def grpo_rows(z, y, adv, old, ref, eps_low=0.2, eps_high=0.2, kl_beta=0.0):
    l = logprob_rows(z, y)
    r = torch.exp(l - old.double())
    A = adv.double()
    v = -torch.minimum(r * A, r.clamp(1 - eps_low, 1 + eps_high) * A)
    if not kl_beta:       # (no KL term: the call may give no ref_logprobs)
        return v
    d = ref.double() - l
    return v + kl_beta * (torch.exp(d) - d - 1)


def gspo_segments(z, y, adv, old, seg, valid, eps_low=3e-4, eps_high=4e-4):
    """GSPO's parts: (the sum over segments with a valid row of the segment's value, their count);
    the term is the sum over the count (0 without one), or over the call's divisor."""
    l = logprob_rows(z, y)
    total, count = z.sum() * 0, 0
    for s in torch.unique(seg[valid]).tolist():
        m = valid & (seg == s)
        R = torch.exp((l[m] - old[m].double()).mean())
        A = adv[m].double().mean()
        total = total - torch.minimum(R * A, R.clamp(1 - eps_low, 1 + eps_high) * A)
        count += 1
    return total, count


def gspo_total(z, y, adv, old, seg, valid, eps_low=3e-4, eps_high=4e-4):
    """The GSPO term: the sum over non-empty segments divided by their count."""
    total, count = gspo_segments(z, y, adv, old, seg, valid, eps_low, eps_high)
    return total / max(count, 1)


def ratio_rows(z, y, old):
    return torch.exp(logprob_rows(z, y) - old.double())


def grad(fn, x):
    """The gradient of the float64 formula ``fn`` at ``x`` (by torch.autograd)."""
    x = x.detach().double().requires_grad_(True)
    fn(x).backward()
    return x.grad


def mean_over(rows, valid, divisor=None):
    """sum over valid rows / divisor (default: the valid-row count; 0 valid rows give 0)."""
    s = torch.where(valid, rows, torch.zeros_like(rows)).sum()
    if divisor is None:
        divisor = int(valid.sum())
    return s / divisor if divisor else s * 0


def close(got, want, tol, what=""):
    got = got.detach().double()
    want = want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 1.0)
    assert err <= tol * scale and not math.isnan(err), f"{what}: worst error {err:.3g} > {tol}*{scale:.3g}"


# the built-ins by name, called as head_reference calls them (tests/compiler/test_derivation.py too):
# (z, y=labels, **the call's inputs (teacher, topk_ids, topk_logprobs, advantages, ...), **the term's params)
PER_ROW = dict(
    cross_entropy=lambda z, y, label_smoothing=0.0, **_: ce_rows(z, y, label_smoothing),
    z_loss=lambda z, **_: z_loss_rows(z),
    entropy=lambda z, **_: entropy_rows(z),
    token_accuracy=lambda z, y, **_: accuracy_rows(z, y),
    forward_kl=lambda z, teacher, temperature=1.0, **_: forward_kl_rows(z, teacher, temperature),
    reverse_kl=lambda z, teacher, temperature=1.0, **_: reverse_kl_rows(z, teacher, temperature),
    jsd=lambda z, teacher, beta=0.5, temperature=1.0, **_: jsd_rows(z, teacher, beta, temperature),
    topk_forward_kl=lambda z, topk_ids, topk_logprobs, temperature=1.0, **_:
        topk_forward_kl_rows(z, topk_ids, topk_logprobs, temperature),
    grpo=lambda z, y, advantages, old_logprobs, ref_logprobs=None, eps_low=0.2, eps_high=0.2, kl_beta=0.0, **_:
        grpo_rows(z, y, advantages, old_logprobs, ref_logprobs, eps_low, eps_high, kl_beta),
    ratio_mean=lambda z, y, old_logprobs, **_: ratio_rows(z, y, old_logprobs),
    clip_fraction=lambda z, y, old_logprobs, eps_low=0.2, eps_high=0.2, **_:
        ((ratio_rows(z, y, old_logprobs) < 1 - eps_low) | (ratio_rows(z, y, old_logprobs) > 1 + eps_high)).double(),
    kl_new_old=lambda z, y, old_logprobs, **_:
        ratio_rows(z, y, old_logprobs) - torch.log(ratio_rows(z, y, old_logprobs)) - 1,
    logprob=lambda z, y, **_: logprob_rows(z, y),
)


def head_reference(terms, metrics, logits, labels=None, *, ignore_index=-100, logit_scale=1.0,
                   softcap=None, loss_mask=None, divisor=None, reduction="mean", **inputs):
    """``terms``/``metrics``: lists of (name, params, weight). Returns (loss, {name: value}, grad)."""
    V = logits.shape[-1]
    rows_shape = logits.shape[:-1]
    # logits that are part of a graph (a float64 linear layer) keep it: the backward below then
    # also fills the gradients of what produced them
    if logits.requires_grad:
        x = logits.double().reshape(-1, V)
        x.retain_grad()
    else:
        x = logits.detach().double().reshape(-1, V).requires_grad_()
    z = transform(x, softcap=softcap, logit_scale=logit_scale)
    R = z.shape[0]
    y = labels.reshape(-1) if labels is not None else torch.zeros(R, dtype=torch.long, device=z.device)
    valid = torch.ones(R, dtype=torch.bool, device=z.device)
    if labels is not None:
        valid &= y != ignore_index
    if loss_mask is not None:
        valid &= loss_mask.reshape(-1)
    flat = {k: (v.reshape(R, *v.shape[len(rows_shape):]) if isinstance(v, torch.Tensor) else v)
            for k, v in inputs.items()}
    if "teacher_logits" in flat:
        flat["teacher"] = flat.pop("teacher_logits")
    if "teacher_topk_ids" in flat:
        flat["topk_ids"] = flat.pop("teacher_topk_ids")
        flat["topk_logprobs"] = flat.pop("teacher_topk_logprobs")
    n_valid = max(int(valid.sum()), 1)
    div = float(divisor) if divisor is not None else 1.0 if reduction == "sum" else n_valid
    values, per_row_loss, loss = {}, z.new_zeros(R), z.new_zeros(())
    for name, params, weight in list(terms) + list(metrics):
        is_loss = (name, params, weight) in terms
        if name == "gspo":
            total, count = gspo_segments(z, y, flat["advantages"], flat["old_logprobs"], flat["segment_ids"],
                                         valid, **params)
            seg_div = 1.0 if reduction == "sum" else max(count, 1)
            value = total / (float(divisor) if divisor is not None else seg_div)
        else:
            per_row = PER_ROW[name](z, y=y, **flat, **params)
            per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
            value = per_row.sum() / (div if is_loss else n_valid)  # metrics: means over the valid rows
            if is_loss:
                per_row_loss = per_row_loss + weight * per_row
        values[name] = value.detach()
        if is_loss:
            loss = loss + weight * value
    out = per_row_loss.reshape(rows_shape) if reduction == "none" else loss
    if out.requires_grad:
        (out.sum() if reduction == "none" else out).backward()
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return out.detach(), values, grad.reshape(logits.shape)
