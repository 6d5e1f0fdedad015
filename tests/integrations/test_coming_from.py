"""Every equivalence docs/coming-from.md states, checked: the peer's call written here in plain torch
from its documented formula (Liger-Kernel, flash-attn and TRL are not dependencies), against the
losscodegen call the page gives, value and gradient."""

import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg

R, V, H = 12, 96, 16


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(R, V, generator=g) * 2
    t = torch.randn(R, V, generator=g) * 2
    y = torch.randint(0, V, (R,), generator=g)
    y[[2, 7]] = -100
    return z, t, y, g


def same(ours_fn, theirs_fn, z, atol=1e-5):
    """Value and dvalue/dz of two scalar functions of the logits agree."""
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    va, vb = ours_fn(a), theirs_fn(b)
    va.backward(), vb.backward()
    torch.testing.assert_close(va.detach(), vb.detach(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=1e-4)


# ---- Liger-Kernel, re-derived from its documented formulas ----------------------------------------
def liger_jsd(log_q, log_p, labels, beta):
    """LigerJSD(beta)(log_q = student log-probs, log_p = teacher log-probs, shift_labels): beta
    weights the teacher P; beta = 0 is forward KL(P || Q), beta = 1 reverse KL(Q || P); summed over
    the vocabulary, divided by the rows whose label is not -100."""
    Q, P = log_q.exp(), log_p.exp()
    if beta == 0:
        rows = (P * (log_p - log_q)).sum(-1)
    elif beta == 1:
        rows = (Q * (log_q - log_p)).sum(-1)
    else:
        M = beta * P + (1 - beta) * Q
        rows = (beta * P * log_p + (1 - beta) * Q * log_q - M * M.log()).sum(-1)
    valid = labels != -100
    return torch.where(valid, rows, 0).sum() / valid.sum()


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_liger_jsd_beta_is_our_one_minus_beta(data, beta):
    z, t, y, _ = data
    same(lambda x: lcg.HeadLoss(lcg.JSD(beta=1 - beta))(x, y, teacher_logits=t).loss,
         lambda x: liger_jsd(torch.log_softmax(x, -1), torch.log_softmax(t, -1), y, beta), z)


def test_liger_jsd_ends_are_forward_and_reverse_kl_ours_are_zero(data):
    z, t, y, _ = data
    same(lambda x: lcg.HeadLoss(lcg.ForwardKL())(x, y, teacher_logits=t).loss,
         lambda x: liger_jsd(torch.log_softmax(x, -1), torch.log_softmax(t, -1), y, 0.0), z)
    same(lambda x: lcg.HeadLoss(lcg.ReverseKL())(x, y, teacher_logits=t).loss,
         lambda x: liger_jsd(torch.log_softmax(x, -1), torch.log_softmax(t, -1), y, 1.0), z)
    for beta in (0.0, 1.0):
        assert lcg.HeadLoss(lcg.JSD(beta=beta))(z, y, teacher_logits=t).loss.abs().item() < 1e-6


def test_liger_kl_div_batchmean_is_forward_kl_over_all_rows(data):
    # LigerKLDIVLoss(reduction="batchmean")(y_pred = log-probs, y_true = probs): sum / rows
    z, t, _, _ = data
    same(lambda x: lcg.HeadLoss(lcg.ForwardKL())(x, teacher_logits=t).loss,
         lambda x: F.kl_div(torch.log_softmax(x, -1), torch.softmax(t, -1), reduction="batchmean"), z)


def test_liger_cross_entropy_options(data):
    # LigerCrossEntropyLoss(lse_square_scale=c, label_smoothing=s, softcap=cap): the mean over
    # valid rows of CE + c * lse**2, on cap * tanh(x / cap)
    z, _, y, _ = data
    c, s, cap = 1e-3, 0.1, 20.0

    def liger(x):
        zz = cap * torch.tanh(x / cap)
        valid = y != -100
        ce = F.cross_entropy(zz, y, label_smoothing=s, reduction="none")
        return torch.where(valid, ce + c * torch.logsumexp(zz, -1) ** 2, 0).sum() / valid.sum()
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=s), lcg.ZLoss(weight=c), softcap=cap)
    same(lambda x: head(x, y).loss, liger, z)


def test_liger_fused_linear_cross_entropy_class_takes_the_weight_first(data):
    """LigerFusedLinearCrossEntropyLoss(lse_square_scale=c, label_smoothing=s, softcap=cap)(w, h, y, bias=b):
    Liger's class takes the weight first; ours is head.linear(h, w, y, bias=b). Liger's order passed to
    head.linear is refused saying that hidden and weight look swapped (as [V, H] x [rows, H], and with
    [B, T, H] hidden states)."""
    _, _, y, g = data
    c, s, cap = 1e-3, 0.1, 20.0
    h, w, b = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g)

    def liger_class(lin_weight, _input, target, bias=None):   # (its forward's argument names)
        zz = cap * torch.tanh(F.linear(_input, lin_weight, bias) / cap)
        valid = target != -100
        ce = F.cross_entropy(zz, target, label_smoothing=s, reduction="none")
        return torch.where(valid, ce + c * torch.logsumexp(zz, -1) ** 2, 0).sum() / valid.sum()
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=s), lcg.ZLoss(weight=c), softcap=cap)
    same(lambda hh: head.linear(hh, w, y, bias=b).loss, lambda hh: liger_class(w, hh, y, bias=b), h)
    with pytest.raises(ValueError, match=r"hidden \(96, 16\) and weight \(12, 16\) look swapped.*"
                                         r"LigerFusedLinearCrossEntropyLoss.*weight first"):
        head.linear(w, h, y, bias=b)
    with pytest.raises(ValueError, match=r"hidden \(96, 16\) and weight \(3, 4, 16\) look swapped"):
        head.linear(w, h.view(3, 4, H), y.view(3, 4))


def test_liger_fused_linear_jsd_distillation(data):
    # LigerFusedLinearJSDLoss(weight_hard_loss=a, weight_soft_loss=b, beta, temperature=T): a * CE
    # (at T = 1) + b * Liger's JSD(beta) of logits / T, both over the valid rows
    _, _, y, g = data
    a, b, beta, T = 0.3, 0.7, 0.2, 2.0
    h, th = torch.randn(R, H, generator=g), torch.randn(R, H, generator=g)
    w, tw = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.5

    def liger(hh):
        zs, zt = hh @ w.T, th @ tw.T
        ce = F.cross_entropy(zs, y, ignore_index=-100)
        return a * ce + b * liger_jsd(torch.log_softmax(zs / T, -1), torch.log_softmax(zt / T, -1), y, beta)
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=a), lcg.JSD(beta=1 - beta, temperature=T, weight=b))
    same(lambda hh: head.linear(hh, w, y, teacher_hidden=th, teacher_weight=tw).loss, liger, h)


# ---- torch ----------------------------------------------------------------------------------------
def test_torch_cross_entropy_and_kl_div(data):
    z, t, y, _ = data
    same(lambda x: lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1))(x, y).loss,
         lambda x: F.cross_entropy(x, y, label_smoothing=0.1), z)
    # a knowledge-distillation recipe's T**2 goes in the weight; temperature divides both sides
    T = 2.0
    same(lambda x: lcg.HeadLoss(lcg.ForwardKL(temperature=T, weight=T * T))(x, teacher_logits=t).loss,
         lambda x: F.kl_div(torch.log_softmax(x / T, -1), torch.log_softmax(t / T, -1), log_target=True,
                            reduction="batchmean") * T * T, z)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_cross_entropy_class_weights(data, reduction):
    # F.cross_entropy(z, y, weight=w): each row times w[y]; the mean divides by the valid rows' sum of w[y]
    z, _, y, g = data
    w = torch.rand(V, generator=g) * 2
    up = torch.linspace(0.5, 1.5, R)    # per-row upstream gradients under "none"
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w))
    same(lambda x: (head(x, y, reduction=reduction).loss * (up if reduction == "none" else 1)).sum(),
         lambda x: (F.cross_entropy(x, y, weight=w, reduction=reduction) * (up if reduction == "none" else 1)).sum(), z)


# ---- flash-attn -------------------------------------------------------------------------------------
def test_flash_attn_cross_entropy_per_row(data):
    # flash_attn cross_entropy_loss(logits, labels, label_smoothing=s, logit_scale=k,
    # lse_square_scale=c) -> per-row losses, z-loss included, 0 on ignored rows
    z, _, y, _ = data
    s, k, c = 0.1, 0.5, 1e-3

    def flash(x):
        zz = x * k
        lse = torch.logsumexp(zz, -1)
        zy = zz.gather(-1, y.clamp_min(0)[:, None])[:, 0]
        rows = (1 - s) * (lse - zy) + s * (lse - zz.mean(-1)) + c * lse ** 2
        return torch.where(y != -100, rows, 0)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=s), lcg.ZLoss(weight=c), logit_scale=k)
    weights = torch.linspace(0.5, 1.5, R)   # per-row upstream gradients: the rows match one by one
    same(lambda x: (head(x, y, reduction="none").loss * weights).sum(), lambda x: (flash(x) * weights).sum(), z)


# ---- TRL / Liger GRPO -----------------------------------------------------------------------------
def _policy(z, y, g):
    with torch.no_grad():
        l = torch.log_softmax(z, -1).gather(-1, y.clamp_min(0)[:, None])[:, 0]
    return dict(advantages=torch.randn(R, generator=g), old_logprobs=l + 0.3 * torch.randn(R, generator=g),
                ref_logprobs=l + 0.1 * torch.randn(R, generator=g))


def test_trl_grpo_token_level_with_temperature(data):
    # TRL / Liger GRPO, loss_type "dapo"/"bnpo": -min(r A, clip(r) A) + beta * k3 summed over the
    # completion tokens / their count; log-probs of logits / temperature
    z, _, y, g = data
    inp = _policy(z, y, g)
    T, eps_lo, eps_hi, beta = 0.7, 0.2, 0.28, 0.04

    def trl(x):
        l = torch.log_softmax(x / T, -1).gather(-1, y.clamp_min(0)[:, None])[:, 0]
        r, A = torch.exp(l - inp["old_logprobs"]), inp["advantages"]
        d = inp["ref_logprobs"] - l
        rows = -torch.min(r * A, r.clamp(1 - eps_lo, 1 + eps_hi) * A) + beta * (d.exp() - d - 1)
        valid = y != -100
        return torch.where(valid, rows, 0).sum() / valid.sum()
    head = lcg.HeadLoss(lcg.GRPO(eps_low=eps_lo, eps_high=eps_hi, kl_beta=beta), logit_scale=1 / T)
    same(lambda x: head(x, y, **inp).loss, trl, z)


def test_clip_fraction_counts_both_sides_trl_counts_the_side_of_the_advantage(data):
    z, _, y, g = data
    inp = _policy(z, y, g)
    r = torch.exp(torch.log_softmax(z, -1).gather(-1, y.clamp_min(0)[:, None])[:, 0] - inp["old_logprobs"])
    A, valid = inp["advantages"], y != -100
    ours = ((r < 0.8) | (r > 1.2))[valid].float().mean()
    trl = (((r < 0.8) & (A < 0)) | ((r > 1.2) & (A > 0)))[valid].float().mean()
    head = lcg.HeadLoss(metrics=(lcg.ClipFraction(),))
    torch.testing.assert_close(head(z, y, **inp).metrics["clip_fraction"], ours)
    assert ours > trl   # these inputs clip on the side that does not matter too
    # TRL's clip_ratio/region_mean
    out = lcg.HeadLoss(metrics=(lcg.ClipRatioRegion(),))(z, y, **inp)
    torch.testing.assert_close(out.metrics["clip_ratio_region"], trl)


def test_gspo_divides_by_non_empty_sequences_liger_by_the_batch(data):
    # importance_sampling_level="sequence", loss_type="grpo" in Liger/TRL: the sum over sequences
    # divided by the batch size, empty sequences included; ours by the non-empty segments
    z, _, y, g = data
    inp = _policy(z, y, g)
    seg = torch.arange(R) // 3                   # 4 sequences of 3 tokens
    y = y.clone()
    y[3:6] = -100                                # sequence 1 is empty
    A = inp["advantages"].view(4, 3).mean(-1, keepdim=True).expand(4, 3).reshape(R)  # per sequence

    def liger(x):
        l = torch.log_softmax(x, -1).gather(-1, y.clamp_min(0)[:, None])[:, 0]
        mask = (y != -100).view(4, 3).float()
        lr = ((l - inp["old_logprobs"]).view(4, 3) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        coef, a = lr.exp(), A.view(4, 3)[:, 0]
        per_seq = -torch.min(coef * a, coef.clamp(1 - 3e-4, 1 + 4e-4) * a)
        per_token = per_seq[:, None].expand(4, 3)
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / 4
    head = lcg.HeadLoss(lcg.GSPO())
    n_nonempty = 3
    same(lambda x: head(x, y, segment_ids=seg, advantages=A, old_logprobs=inp["old_logprobs"]).loss,
         lambda x: liger(x) * 4 / n_nonempty, z)
    same(lambda x: head(x, y, segment_ids=seg, advantages=A, old_logprobs=inp["old_logprobs"],
                        divisor=4.0).loss, liger, z)


def test_assert_parity_one_liner():
    lcg.testing.assert_parity(lcg.HeadLoss(lcg.JSD(beta=0.3)), rows=6, vocab=64, dtypes=(torch.float32,))


def test_trl_cispo_and_sapo(data):
    # TRL loss_type="cispo": -clamp(coef_1, max=epsilon_high).detach() * A * logp (+ beta * k3);
    # loss_type="sapo": -sigmoid(tau * (coef_1 - 1)) * 4 / tau * A, tau by the advantage's sign
    z, _, y, g = data
    inp = _policy(z, y, g)
    E, beta, tau_pos, tau_neg = 1.1, 0.04, 1.0, 1.05
    valid = y != -100

    def parts(x):
        l = torch.log_softmax(x, -1).gather(-1, y.clamp_min(0)[:, None])[:, 0]
        r, A, d = torch.exp(l - inp["old_logprobs"]), inp["advantages"], inp["ref_logprobs"] - l
        return l, r, A, d.exp() - d - 1

    def cispo(x):
        l, r, A, kl = parts(x)
        rows = -torch.clamp(r, max=E).detach() * A * l + beta * kl
        return torch.where(valid, rows, 0).sum() / valid.sum()

    def sapo(x):
        l, r, A, kl = parts(x)
        tau = torch.where(A > 0, tau_pos, tau_neg)
        rows = -torch.sigmoid(tau * (r - 1)) * 4 / tau * A
        return torch.where(valid, rows, 0).sum() / valid.sum()
    head = lcg.HeadLoss(lcg.CISPO(eps_high=E - 1), lcg.RefKL(weight=beta))
    same(lambda x: head(x, y, **inp).loss, cispo, z)
    head = lcg.HeadLoss(lcg.SAPO(temperature_pos=tau_pos, temperature_neg=tau_neg))
    same(lambda x: head(x, y, **inp).loss, sapo, z)


def test_mixed_dtype_fused_linear_computes_in_the_wider_dtype(data):
    """Liger's fused linear cross-entropy on bf16 hidden states and an fp32 weight: ours computes in
    fp32, as F.linear on the upcast hidden states; each gradient comes back in its input's dtype."""
    _, _, y, g = data
    h = torch.randn(R, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    head = lcg.HeadLoss(lcg.CrossEntropy())
    out = head.linear(h, w, y)
    out.loss.backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = F.cross_entropy(F.linear(h64, w64), y, ignore_index=-100)
    want.backward()
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-5, atol=1e-6)
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-2, atol=1e-3)   # (rounded to bf16)


def test_the_docs_pass_term_options_by_keyword():
    """Term options are keyword-only: every term call the docs write names its arguments."""
    import re
    from pathlib import Path
    names = [n for n in lcg.__all__ if n[0].isupper() and n not in ("HeadLoss", "HeadOutput")]
    call = re.compile(r"\b(?:lcg\.)?(%s)\(([^()]*)\)" % "|".join(names))
    root = Path(__file__).resolve().parents[2]
    positional = []
    for path in sorted((root / "docs").glob("*.md")) + [root / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "TypeError" in line:   # (a line showing the refusal itself)
                continue
            for m in call.finditer(line):
                first = m.group(2).split(",")[0].strip()
                if first and "=" not in first and not first.startswith("*") and first != "...":
                    positional.append(f"{path.name}:{number}: {m.group(0)}")
    assert not positional, positional


# ---- the remaining rows of the tables, one test each ------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_torch_cross_entropy_reductions(data, reduction):
    z, _, y, _ = data
    up = torch.linspace(0.5, 1.5, R)   # per-row upstream gradients under "none": the rows match one by one
    head = lcg.HeadLoss(lcg.CrossEntropy())
    same(lambda x: (head(x, y, reduction=reduction).loss * (up if reduction == "none" else 1)).sum(),
         lambda x: (F.cross_entropy(x, y, reduction=reduction) * (up if reduction == "none" else 1)).sum(), z)
    assert (head(z, y, reduction="none").loss[y == -100] == 0).all()


def test_torch_kl_div_with_the_student_as_target_is_reverse_kl(data):
    z, t, _, _ = data
    same(lambda x: lcg.HeadLoss(lcg.ReverseKL())(x, teacher_logits=t).loss,
         lambda x: F.kl_div(torch.log_softmax(t, -1), torch.log_softmax(x, -1), log_target=True,
                            reduction="batchmean"), z)


def test_liger_z_loss_and_token_accuracy_outputs(data):
    # Liger's return_z_loss: lse_square_scale * the mean over valid rows of lse**2; return_token_accuracy:
    # the fraction of valid rows whose argmax is the label
    z, _, y, _ = data
    z = z.clone()
    z[0, y[0]] += 20.0                                 # (one row surely right)
    c, valid = 1e-3, y != -100
    out = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=c), metrics=(lcg.TokenAccuracy(),))(z, y)
    liger_z_loss = c * (torch.logsumexp(z, -1) ** 2)[valid].mean()
    torch.testing.assert_close(c * out.terms["z_loss"], liger_z_loss)
    torch.testing.assert_close(out.metrics["token_accuracy"], (z.argmax(-1) == y)[valid].float().mean())


def test_liger_fused_linear_cross_entropy_with_a_bias(data):
    _, _, y, g = data
    h, w, b = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g)
    head = lcg.HeadLoss(lcg.CrossEntropy())
    same(lambda hh: head.linear(hh, w, y, bias=b).loss, lambda hh: F.cross_entropy(F.linear(hh, w, b), y), h)


def test_flash_attn_mean_inplace_backward_and_z_loss(data):
    # CrossEntropyLoss(reduction="mean", label_smoothing=s, lse_square_scale=c, inplace_backward=True):
    # the mean over valid rows of the per-row losses, z-loss included; return_z_loss: c * lse**2's mean
    z, _, y, _ = data
    s, c, valid = 0.1, 1e-3, y != -100

    def flash(x):
        lse = torch.logsumexp(x, -1)
        rows = (1 - s) * (lse - x.gather(-1, y.clamp_min(0)[:, None])[:, 0]) + s * (lse - x.mean(-1)) + c * lse ** 2
        return rows[valid].mean()
    terms = (lcg.CrossEntropy(label_smoothing=s), lcg.ZLoss(weight=c))
    same(lambda x: lcg.HeadLoss(*terms, inplace_backward=True)(x.clone(), y).loss, flash, z)
    out = lcg.HeadLoss(*terms)(z, y)
    torch.testing.assert_close(c * out.terms["z_loss"], c * (torch.logsumexp(z, -1) ** 2)[valid].mean())


def test_trl_grpo_loss_type_divisors_delta_bias_corrected_kl_and_entropy(data):
    # TRL: coef_1 = exp(l - old) clamped at delta (two-sided clipping), coef_2 = clamp(exp(l - old), 1 - eps,
    # 1 + eps_high); per_token_kl times the unclamped coef_1 under use_bias_correction_kl; the token sum divided
    # by num_items_in_batch (dapo) or B * max_completion_length (dr_grpo)
    z, _, y, g = data
    inp = _policy(z, y, g)
    eps_lo, eps_hi, beta, delta, valid = 0.2, 0.28, 0.04, 1.3, y != -100
    num_items_in_batch, B, max_completion_length = 17.0, 3, 5

    def token_sum(x):
        l = torch.log_softmax(x, -1).gather(-1, y.clamp_min(0)[:, None])[:, 0]
        r, A, d = torch.exp(l - inp["old_logprobs"]), inp["advantages"], inp["ref_logprobs"] - l
        rows = -torch.min(r.clamp(max=delta) * A, r.clamp(1 - eps_lo, 1 + eps_hi) * A) + beta * (d.exp() - d - 1) * r
        return torch.where(valid, rows, 0).sum()
    head = lcg.HeadLoss(lcg.GRPO(eps_low=eps_lo, eps_high=eps_hi, kl_beta=beta, delta=delta, kl_bias_correction=True),
                        metrics=(lcg.Entropy(),))
    same(lambda x: head(x, y, **inp, divisor=num_items_in_batch).loss, lambda x: token_sum(x) / num_items_in_batch, z)
    same(lambda x: head(x, y, **inp, divisor=B * max_completion_length).loss,
         lambda x: token_sum(x) / (B * max_completion_length), z)
    same(lambda x: head(x, y, **inp).loss, lambda x: token_sum(x) / valid.sum(), z)     # bnpo: the default divisor
    logp = torch.log_softmax(z, -1)
    torch.testing.assert_close(head(z, y, **inp).metrics["entropy"], (-(logp.exp() * logp).sum(-1))[valid].mean())
