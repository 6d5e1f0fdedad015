"""Float64 torch formulas written from CONTRACT.md alone (its tables and notation), for the
contract conformance suites (tests/*/test_contract_*.py). Nothing here imports losscodegen: the
expected values must not come from the code they check."""
import math

import torch

IGNORE = -100


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
    d = ref.double() - l
    return v + kl_beta * (torch.exp(d) - d - 1)


def gspo_total(z, y, adv, old, seg, valid, eps_low=3e-4, eps_high=4e-4):
    """The GSPO term: the sum over non-empty segments divided by their count."""
    l = logprob_rows(z, y)
    vals = []
    for s in torch.unique(seg[valid]).tolist():
        m = valid & (seg == s)
        R = torch.exp((l[m] - old[m].double()).mean())
        A = adv[m].double().mean()
        vals.append(-torch.minimum(R * A, R.clamp(1 - eps_low, 1 + eps_high) * A))
    if not vals:
        return z.sum() * 0
    return torch.stack(vals).sum() / len(vals)


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
