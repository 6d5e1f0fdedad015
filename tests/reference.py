"""Independent float64 references, written from the formulas of docs/api.md (not from losscodegen).

Each function takes float64 student logits ``z`` [R, V] (already softcapped/scaled) and returns the
per-row value [R]; ``head_reference`` reduces them as the contract says and autograd gives the
gradient.
"""
from __future__ import annotations

import torch


def transform(x, logit_scale=1.0, softcap=None):
    x = x.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x * logit_scale


def _target(z, y):
    return z.gather(-1, y.clamp_min(0)[:, None])[:, 0]


def cross_entropy(z, y, label_smoothing=0.0, **_):
    lse = torch.logsumexp(z, -1)
    e = label_smoothing
    return (1 - e) * (lse - _target(z, y)) + e * (lse - z.mean(-1))


def z_loss(z, **_):
    return torch.logsumexp(z, -1) ** 2


def entropy(z, **_):
    logp = torch.log_softmax(z, -1)
    return -(logp.exp() * logp).sum(-1)


def token_accuracy(z, y, **_):
    return (z.argmax(-1) == y).double()


def _student_teacher(z, teacher, T):
    return torch.log_softmax(z / T, -1), torch.log_softmax(teacher.double() / T, -1)


def forward_kl(z, teacher, temperature=1.0, **_):
    logp, logq = _student_teacher(z, teacher, temperature)
    return (logq.exp() * (logq - logp)).sum(-1)


def reverse_kl(z, teacher, temperature=1.0, **_):
    logp, logq = _student_teacher(z, teacher, temperature)
    return (logp.exp() * (logp - logq)).sum(-1)


def jsd(z, teacher, beta=0.5, temperature=1.0, **_):
    logp, logq = _student_teacher(z, teacher, temperature)
    p, q = logp.exp(), logq.exp()
    logm = torch.log(beta * p + (1 - beta) * q)
    return beta * (p * (logp - logm)).sum(-1) + (1 - beta) * (q * (logq - logm)).sum(-1)


def topk_forward_kl(z, topk_ids, topk_logprobs, temperature=1.0, **_):
    logp = torch.log_softmax(z / temperature, -1).gather(-1, topk_ids)
    l = topk_logprobs.double()
    return (l.exp() * (l - logp)).sum(-1)


def _policy(z, y, old_logprobs):
    l = _target(torch.log_softmax(z, -1), y)
    return l, torch.exp(l - old_logprobs.double())


def grpo(z, y, advantages, old_logprobs, ref_logprobs=None, eps_low=0.2, eps_high=0.2,
         kl_beta=0.0, **_):
    l, r = _policy(z, y, old_logprobs)
    A = advantages.double()
    value = -torch.min(r * A, torch.clamp(r, 1 - eps_low, 1 + eps_high) * A)
    if kl_beta:
        d = ref_logprobs.double() - l
        value = value + kl_beta * (torch.exp(d) - d - 1)
    return value


def ratio_mean(z, y, old_logprobs, **_):
    return _policy(z, y, old_logprobs)[1]


def clip_fraction(z, y, old_logprobs, eps_low=0.2, eps_high=0.2, **_):
    r = _policy(z, y, old_logprobs)[1]
    return ((r < 1 - eps_low) | (r > 1 + eps_high)).double()


def kl_new_old(z, y, old_logprobs, **_):
    r = _policy(z, y, old_logprobs)[1]
    return r - torch.log(r) - 1


def logprob(z, y, old_logprobs=None, **_):
    return _target(torch.log_softmax(z, -1), y)


def gspo_total(z, y, valid, advantages, old_logprobs, segment_ids, eps_low=3e-4, eps_high=4e-4):
    """(sum over non-empty segments of the segment value, number of non-empty segments)."""
    l = _target(torch.log_softmax(z, -1), y)
    total, count = z.new_zeros(()), 0
    for s in sorted(set(segment_ids.tolist())):
        rows = (segment_ids == s) & valid
        if not rows.any():
            continue
        R = torch.exp((l[rows] - old_logprobs.double()[rows]).mean())
        A = advantages.double()[rows].mean()
        total = total - torch.min(R * A, torch.clamp(R, 1 - eps_low, 1 + eps_high) * A)
        count += 1
    return total, count


PER_ROW = dict(cross_entropy=cross_entropy, z_loss=z_loss, entropy=entropy,
               token_accuracy=token_accuracy, forward_kl=forward_kl, reverse_kl=reverse_kl, jsd=jsd,
               topk_forward_kl=topk_forward_kl, grpo=grpo, ratio_mean=ratio_mean,
               clip_fraction=clip_fraction, kl_new_old=kl_new_old, logprob=logprob)


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
    z = transform(x, logit_scale, softcap)
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
            total, count = gspo_total(z, y, valid, flat["advantages"], flat["old_logprobs"],
                                      flat["segment_ids"], **params)
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
