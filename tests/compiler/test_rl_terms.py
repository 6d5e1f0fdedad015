"""The formula language for trainers' RL objectives: ``stop_gradient``, gradients at kinks, and the
RL built-ins. Each is checked against float64 torch written by hand from the paper's formula or
re-typed from the trainer's code (TRL 1.16 ``GRPOTrainer._compute_loss``), value and gradient."""
import math

import pytest
import sympy as sp
import torch

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen.lower import IS_Y
from losscodegen.testing import compare
from helpers import DEVICE, make_inputs, policy_inputs

# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto")
pytestmark = pytest.mark.usefixtures("backend")

_l = S.target_logit - S.lse                      # log p_y
_r = S.exp(_l - S.token("old_logprobs"))         # the importance ratio
_A = S.token("advantages")


def _logp(z, labels):
    return torch.log_softmax(z, -1).gather(-1, labels.clamp_min(0)[:, None])[:, 0]


def _compare(head, reference, logits, labels, *, dtype=torch.float32, **inputs):
    """``reference(z [R, V] float64, on the CPU) -> loss``; the head's loss and dL/dlogits (on the
    GPU when there is one) must match it."""
    x = logits.to(DEVICE, dtype).requires_grad_()
    out = head(x, labels.to(DEVICE), **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
                                        for k, v in inputs.items()})
    out.loss.backward()
    z = x.detach().cpu().double().requires_grad_()
    want = reference(z)
    want.backward()
    compare("loss", out.loss, want.detach(), dtype)
    compare("gradient", x.grad.cpu(), z.grad, dtype)
    return out


def _masked_mean(per_row, valid):
    return torch.where(valid, per_row, 0.0).sum() / valid.sum()


# ---- stop_gradient --------------------------------------------------------------------------------
def _cispo_formula(eps_high=S.param("eps_high")):
    # MiniMax-M1 (arXiv 2506.13585), eq. 4: the clipped IS weight is detached
    return -S.stop_gradient(S.Min(_r, 1 + eps_high)) * _A * _l


def test_cispo_is_one_pass_and_matches_minimax_m1():
    logits, labels, g = make_inputs(R=24, V=300)
    inputs = policy_inputs(logits, labels, g)
    inputs.pop("ref_logprobs")
    CISPO = lcg.declare_term("my_cispo", _cispo_formula(), defaults={"eps_high": 0.2})
    head = lcg.HeadLoss(CISPO())
    assert head.plan().reads == 1
    text = head.explain()
    assert "stop_gradient(Min(" in text and "stop_gradient(" in head.source().text.split("\n\n")[0]
    valid = labels != -100

    def reference(z):
        logp = _logp(z, labels)
        r = torch.exp(logp - inputs["old_logprobs"].double())
        weight = torch.clamp(r, max=1.2).detach()
        return _masked_mean(-weight * inputs["advantages"].double() * logp, valid)
    assert (torch.exp(_logp(logits.double(), labels) - inputs["old_logprobs"].double())[valid] > 1.2).any()
    _compare(head, reference, logits, labels, **inputs)


def test_stop_gradient_at_every_level():
    """Around row quantities (lse, z_y), inside vsum, inside and around segment_mean."""
    logits, labels, g = make_inputs(R=18, V=200)
    seg = torch.arange(18) // 5
    row = lcg.declare_term("row", S.stop_gradient(S.lse) * S.target_logit
                           + S.stop_gradient(S.target_logit - S.lse) * S.lse ** 2)
    inside = lcg.declare_term("inside", S.vsum(S.stop_gradient(S.softmax) * S.logit ** 2)
                              + S.stop_gradient(S.vsum(S.softmax ** 2)) * S.lse)
    seg_term = lcg.declare_term("seg", S.segment_mean(S.stop_gradient(_l) * _l ** 2)
                                + S.stop_gradient(S.segment_mean(_l)) * S.segment_mean(_l))
    head = lcg.HeadLoss(row(), inside(weight=0.5), seg_term(weight=0.3))
    valid = labels != -100

    def reference(z):
        lse = torch.logsumexp(z, -1)
        zy = z.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
        p = torch.softmax(z, -1)
        l = zy - lse
        f_row = lse.detach() * zy + (zy - lse).detach() * lse ** 2
        f_inside = (p.detach() * z ** 2).sum(-1) + (p ** 2).sum(-1).detach() * lse
        segs = [(seg == s) & valid for s in seg.unique() if ((seg == s) & valid).any()]
        f_seg = sum((l[m].detach() * l[m] ** 2).mean() + l[m].mean().detach() * l[m].mean() for m in segs)
        return _masked_mean(f_row + 0.5 * f_inside, valid) + 0.3 * f_seg / len(segs)
    _compare(head, reference, logits, labels, segment_ids=seg, num_segments=4)
    lcg.testing.assert_parity(head, rows=12, vocab=64, dtypes=(torch.float32,))


def test_stop_gradient_of_a_constant_is_the_constant():
    assert S.stop_gradient(sp.Integer(2)) == 2
    assert lcg.declare_term("c", S.stop_gradient(S.lse) * 0 + S.lse).formula == S.lse


def _vespo_formula(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """VESPO's loss, -phi(w_s) * A * log p_y summed over a sequence's tokens, as a segment term; the
    per-row token ``seq_len`` (the sequence's count of valid tokens) turns a segment mean into
    TRL's sum (``get_gamma_weights``: w_s = exp(clamp(sum_t clamp(l_t - old_t, -20, 20), log 1e-8, 20)),
    phi(w) = exp(lambda + k log w - lambda w), k and lambda chosen by the advantage's sign)."""
    n = S.token("seq_len")
    log_w = S.clamp(S.segment_mean(n * S.clamp(_l - S.token("old_logprobs"), -20, 20)),
                    sp.Float(math.log(1e-8)), 20)
    A_s = S.segment_mean(_A)
    k = S.Piecewise((k_pos, A_s >= 0), (k_neg, True))
    lam = S.Piecewise((lambda_pos, A_s >= 0), (lambda_neg, True))
    phi = S.exp(lam + k * log_w - lam * S.exp(log_w))
    return -S.stop_gradient(phi) * S.segment_mean(n * _A * _l)


def _trl_vespo(per_token_logps, old, advantages, mask, num_items, k_pos=2.0, lambda_pos=3.0,
               k_neg=3.0, lambda_neg=2.0):
    """TRL 1.16 GRPOTrainer.get_gamma_weights and the "vespo" branch of _compute_loss, re-typed
    ([B, T] tensors, importance_sampling_ratio None)."""
    log_ratio = per_token_logps - old
    lower_clamp = math.log(1e-8)
    with torch.no_grad():
        log_ratio_clamped = torch.clamp(log_ratio, -20.0, 20.0)
        seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
        lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    per_token_loss = -phi_seq * advantages * per_token_logps
    return (per_token_loss * mask).sum() / num_items


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vespo_is_one_call_and_matches_trl(dtype):
    B, T, V = 4, 6, 256
    logits, labels, g = make_inputs(R=B * T, V=V, ignored=())
    mask = torch.ones(B, T)
    mask[0, 4:] = 0                                   # a short completion
    mask[2, 1] = 0                                    # a masked token inside one
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None].expand(B, T)
    with torch.no_grad():
        logp = _logp(logits.to(dtype).double(), labels)
    old = (logp + 0.05 * torch.randn(B * T, generator=g, dtype=torch.float64)).float()
    Vespo = lcg.declare_term("vespo_decl", _vespo_formula())
    head = lcg.HeadLoss(Vespo())
    assert head.plan().reads == 1                     # phi needs no pass of its own
    inputs = dict(loss_mask=mask.reshape(-1).bool(), advantages=adv.reshape(-1), old_logprobs=old,
                  seq_len=mask.sum(-1, keepdim=True).expand(B, T).reshape(-1),
                  segment_ids=torch.arange(B)[:, None].expand(B, T).reshape(-1), num_segments=B,
                  divisor=float(mask.sum()))

    def reference(z):
        per_token_logps = _logp(z, labels).reshape(B, T)
        return _trl_vespo(per_token_logps, old.double().reshape(B, T), adv.double(), mask.double(),
                          mask.sum().double())
    _compare(head, reference, logits, labels, dtype=dtype, **inputs)


# ---- kinks follow torch ---------------------------------------------------------------------------
def test_kinks_match_torch_autograd_at_exact_ties():
    """Abs at 0, Max/Min ties of two and three arguments, clamp at both ends of its interval,
    Piecewise on its boundary, sign: at row level (z_y) and inside vsum (logits exactly 0)."""
    R, V = 8, 64
    logits, labels, g = make_inputs(R=R, V=V, ignored=(5,))
    logits[:, :8] = 0.0                                            # ties inside vsum
    at = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.5, 2.0])
    logits[torch.arange(R), labels.clamp_min(0)] = at              # ties of z_y
    b = torch.tensor([0.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.5, 0.0])
    c = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    zy, tb, tc = S.target_logit, S.token("b"), S.token("c")
    Kinks = lcg.declare_term("kinks", S.Abs(zy) + 2 * S.Max(zy, 0) + 3 * S.Min(zy, tb) + 5 * S.clamp(zy, 0, 1)
                             + 7 * S.Max(zy, tb, tc) + 11 * S.Min(zy, tb, tc)
                             + S.Piecewise((3 * zy, zy >= 0), (-zy, True)) + sp.sign(zy) * S.lse
                             + S.vsum(S.Abs(S.logit) + 2 * S.Max(S.logit, 0) + 3 * S.clamp(S.logit, 0, 1)) / 4)
    head = lcg.HeadLoss(Kinks())
    valid = labels != -100

    def reference(z):
        y = z.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
        bd, cd, zero = b.double(), c.double(), torch.zeros(R, dtype=torch.float64)
        f = (torch.abs(y) + 2 * torch.maximum(y, zero) + 3 * torch.minimum(y, bd) + 5 * torch.clamp(y, 0, 1)
             + 7 * torch.stack([y, bd, cd]).amax(0) + 11 * torch.stack([y, bd, cd]).amin(0)
             + torch.where(y >= 0, 3 * y, -y) + torch.sign(y) * torch.logsumexp(z, -1)
             + (torch.abs(z) + 2 * torch.maximum(z, torch.zeros_like(z)) + 3 * torch.clamp(z, 0, 1)).sum(-1) / 4)
        return _masked_mean(f, valid)
    _compare(head, reference, logits, labels, b=b, c=c)
    lcg.testing.assert_parity(head, rows=R, vocab=V, dtypes=(torch.float32,), labels=labels,
                              b=b, c=c, loss_mask=torch.ones(R, dtype=torch.bool))


def _trl_grpo(per_token_logps, old, ref, advantages, *, epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
              delta=None, use_bias_correction_kl=False):
    """TRL 1.16 GRPOTrainer._compute_loss, token-level importance sampling: the per-token loss."""
    log_ratio = per_token_logps - old
    coef_1 = torch.exp(log_ratio)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    return per_token_loss


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("advantage", [0.7, -0.7])
def test_grpo_derivative_at_the_clip_edges_is_torchs(eps, advantage):
    """The derived dL/dlog p_y of the built-in GRPO at r = 1 - eps_low, 1, 1 + eps_high (exact ties
    in sympy's exact arithmetic; a kernel computes r in fp32, where an exact tie cannot be set up)
    against autograd through TRL's code in float64."""
    head = lcg.HeadLoss(lcg.GRPO(eps_low=eps, eps_high=eps))
    lowered = head.lowered()
    # dL/dz_i = g0 * p_i + g1 * [i == y]: g1 is dL/dz_y at a fixed lse, that is dL/dlog p_y; the
    # runtime parameters (eps) take their values as the kernel's scalars give them
    g1 = dict(lowered.grad_coefs)[lowered.grad_vocab.coeff(IS_Y)]
    g1 = g1.subs({s: sp.nsimplify(head.scalars[s.name], rational=True) for s in g1.free_symbols
                  if s.name in head.scalars})
    for r in (1 - eps, 1.0, 1 + eps):
        old = -math.log(r) if r != 1 else 0.0                    # l = 0, so r = exp(-old)
        # l = z_y - lse = 0: lse, its max and log-sum, and z_y (or z_y - max) all 0
        at = {sp.Symbol("N0", real=True): 0, S.target_logit: 0, sp.Symbol("w_grpo", real=True): 1,
              sp.Symbol("m", real=True): 0, sp.Symbol("zym", real=True): 0, sp.Symbol("acc0", real=True): 1,
              S.token("old_logprobs"): sp.log(sp.nsimplify(1 / r, rational=True)),
              S.token("advantages"): sp.nsimplify(advantage, rational=True)}
        got = float(g1.subs(at))
        l = torch.zeros((), dtype=torch.float64, requires_grad=True)
        old_t = -torch.log(torch.tensor(r, dtype=torch.float64))
        _trl_grpo(l, old_t, None, torch.tensor(advantage, dtype=torch.float64),
                  epsilon_low=eps, epsilon_high=eps).backward()
        assert got == pytest.approx(float(l.grad), abs=1e-12), (r, got, float(l.grad))


# ---- built-ins against TRL 1.16's code --------------------------------------------------------------
def _policy_case(R=32, V=300, dtype=torch.float32, spread=0.4):
    logits, labels, g = make_inputs(R=R, V=V, dtype=dtype, ignored=(1, 5, 17))
    inputs = policy_inputs(logits.float(), labels, g, spread=spread)
    inputs["loss_mask"] = torch.rand(R, generator=g) > 0.1
    valid = (labels != -100) & inputs["loss_mask"]
    return logits, labels, inputs, valid


def _trl_clip_ratios(coef_1, advantages, epsilon_low, epsilon_high, delta, valid):
    """TRL's clip_ratio/{low,high,region}_mean: global_masked_mean of the sign-aware clip masks,
    on coef_1 after delta's clamp."""
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    return {name: _masked_mean(m.double(), valid) for name, m in (
        ("clip_ratio_low", is_low_clipped), ("clip_ratio_high", is_high_clipped),
        ("clip_ratio_region", is_region_clipped))}


@pytest.mark.parametrize("eps_low,eps_high,beta,delta,bias_correction,dtype", [
    (0.2, 0.2, 0.0, None, False, torch.float32),
    (0.2, 0.28, 0.04, None, True, torch.float32),        # TRL's defaults for the KL: bias-corrected
    (0.2, 0.28, 0.04, None, True, torch.bfloat16),
    (0.1, 0.3, 0.04, 1.6, False, torch.float32),         # two-sided clipping
    (0.2, 0.2, 0.1, 1.4, True, torch.bfloat16),
])
def test_grpo_matches_trl(eps_low, eps_high, beta, delta, bias_correction, dtype):
    logits, labels, inputs, valid = _policy_case(dtype=dtype)
    kw = {} if delta is None else {"delta": delta}
    head = lcg.HeadLoss(lcg.GRPO(eps_low=eps_low, eps_high=eps_high, kl_beta=beta,
                                 kl_bias_correction=float(bias_correction), **kw),
                        metrics=(lcg.ClipRatioLow(), lcg.ClipRatioHigh(), lcg.ClipRatioRegion()))
    A, old, ref = (inputs[k].double() for k in ("advantages", "old_logprobs", "ref_logprobs"))

    def reference(z):
        per_token = _trl_grpo(_logp(z, labels), old, ref, A, epsilon_low=eps_low, epsilon_high=eps_high,
                              beta=beta, delta=delta, use_bias_correction_kl=bias_correction)
        return _masked_mean(per_token, valid)
    out = _compare(head, reference, logits, labels, dtype=dtype, **inputs)
    coef_1 = torch.exp(_logp(logits.double(), labels) - old)
    if delta is not None:
        assert (coef_1[valid] > delta).any()                     # delta's clamp is exercised
    want = _trl_clip_ratios(coef_1, A, eps_low, eps_high, delta, valid)
    for name, value in want.items():
        assert 0 < value < 1
        torch.testing.assert_close(out.metrics[name].double().cpu(), value, rtol=0, atol=1e-6, msg=name)


def test_clip_ratios_are_sign_aware_unlike_clip_fraction():
    logits, labels, inputs, valid = _policy_case()
    head = lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.ClipFraction(), lcg.ClipRatioRegion()))
    out = _compare(head, lambda z: _masked_mean(_trl_grpo(_logp(z, labels), inputs["old_logprobs"].double(), None,
                                                          inputs["advantages"].double()), valid),
                   logits, labels, **inputs)
    assert out.metrics["clip_ratio_region"] < out.metrics["clip_fraction"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cispo_and_ref_kl_match_trl(dtype):
    """TRL's loss_type="cispo" with beta = 0.05 and the bias-corrected KL, normalised by the
    token count (num_items_in_batch of one micro-batch on one process); its cispo_clip_ratio."""
    logits, labels, inputs, valid = _policy_case(dtype=dtype)
    epsilon_high, beta = 1.3, 0.05                            # TRL's bound: 1 + eps_high here
    head = lcg.HeadLoss(lcg.CISPO(eps_high=epsilon_high - 1), lcg.RefKL(weight=beta, kl_bias_correction=1.0),
                        metrics=(lcg.CISPOClipRatio(),))
    A, old, ref = (inputs[k].double() for k in ("advantages", "old_logprobs", "ref_logprobs"))

    def reference(z):
        per_token_logps = _logp(z, labels)
        coef_1 = torch.exp(per_token_logps - old)
        per_token_kl = (torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1) * coef_1
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * A * per_token_logps + beta * per_token_kl
        return _masked_mean(per_token_loss, valid)
    out = _compare(head, reference, logits, labels, dtype=dtype, **inputs)
    coef_1 = torch.exp(_logp(logits.double(), labels) - old)
    want = _masked_mean(((coef_1 > epsilon_high) & (A > 0)).double(), valid)
    assert 0 < want < 1
    torch.testing.assert_close(out.metrics["cispo_clip_ratio"].double().cpu(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sapo_matches_trl(dtype):
    """TRL's loss_type="sapo" per-token loss (its per-sequence mean is the head's
    normalisation, not the formula's: here the token mean)."""
    logits, labels, inputs, valid = _policy_case(dtype=dtype)
    tau_pos, tau_neg = 1.0, 1.05
    head = lcg.HeadLoss(lcg.SAPO(temperature_pos=tau_pos, temperature_neg=tau_neg))
    A, old = inputs["advantages"].double(), inputs["old_logprobs"].double()

    def reference(z):
        coef_1 = torch.exp(_logp(z, labels) - old)
        temperatures = torch.where(A > 0, tau_pos, tau_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        return _masked_mean(-soft_coef_1 * A, valid)
    _compare(head, reference, logits, labels, dtype=dtype, **inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_is_a_term(dtype):
    logits, labels, inputs, valid = _policy_case(dtype=dtype)
    head = lcg.HeadLoss(lcg.LogProb(weight=-1.0), metrics=(lcg.Entropy(),))
    out = _compare(head, lambda z: -_masked_mean(_logp(z, labels), valid), logits, labels,
                   dtype=dtype, loss_mask=inputs["loss_mask"])
    assert set(out.terms) == {"logprob"}


def test_rl_builtins_pass_the_parity_tool():
    """lcg.testing.assert_parity on every new built-in at once (its reference prints clamp,
    stop_gradient and the clip conditions as torch ops)."""
    head = lcg.HeadLoss(lcg.GRPO(delta=1.5, kl_beta=0.04, kl_bias_correction=1.0), lcg.SAPO(weight=0.5),
                        lcg.CISPO(eps_high=0.1), lcg.RefKL(weight=0.1, kl_bias_correction=1.0),
                        metrics=(lcg.ClipRatioLow(), lcg.ClipRatioHigh(), lcg.ClipRatioRegion(),
                                 lcg.CISPOClipRatio(), lcg.LogProb()))
    lcg.testing.assert_parity(head, rows=16, vocab=128)


@pytest.mark.cpu
def test_a_segment_term_may_be_named_like_the_parameter_prefix():
    """A segment term named "p" (its segment means were p_U0, read as runtime parameters "p_...")."""
    logits, labels, g = make_inputs(R=12, V=64)
    seg = torch.arange(12) // 4
    head = lcg.HeadLoss(lcg.declare_term("p", -S.segment_mean(_l))())
    valid = labels != -100

    def reference(z):
        l = _logp(z, labels)
        segs = [(seg == s) & valid for s in seg.unique() if ((seg == s) & valid).any()]
        return -sum(l[m].mean() for m in segs) / len(segs)
    _compare(head, reference, logits, labels, segment_ids=seg, num_segments=3)
