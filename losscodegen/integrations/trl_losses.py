"""Every loss and metric losscodegen's TRL trainers compute, declared in one place: GRPO's objective
(``grpo_head``, terms.py's policy-gradient formulas put at TRL's token or sequence level), the metrics
the DPO and KTO trainers log of the responses' tokens, ORPO's sums over the completion rows, the fields of
TRL's fused LM head, and TRL's generalized JSD (GKD). The trainers (``trl_grpo``, ``trl_sft``, ``trl_dpo``,
``trl_kto``, ``trl_cpo``, ``trl_orpo``, ``trl_gkd``) feed these their inputs and log what TRL logs."""
from __future__ import annotations

import functools
import math
from typing import Any

import sympy as sp
import torch

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen import terms as T

# terms.py's policy-gradient formulas read the log-probability of the label, the ratio exp(logprob -
# old_logprobs) and the advantage; here RATIO stands as a placeholder while a formula is put at the token or
# sequence level
segment_mean = S.segment_mean
LOGPROB = S.target_logit - S.lse
OLD_LOGPROBS, ADVANTAGES = S.token("old_logprobs"), S.token("advantages")
TOKEN_RATIO = S.exp(LOGPROB - OLD_LOGPROBS)
RATIO = sp.Dummy("r")
# GSPO's: the ratio of the mean over the sequence's tokens
SEQUENCE_RATIO = S.exp(segment_mean(LOGPROB - OLD_LOGPROBS))
POLICY_TERMS = {"cispo": T.CISPO, "sapo": T.SAPO}   # TRL's loss_type -> terms.py's term (else GRPO)
# exp above this overflows fp32: TRL's phi_seq is then inf, which its nan_to_num makes 0
LOG_FLOAT32_MAX = math.log(torch.finfo(torch.float32).max)


def of_ratio(factory: Any, **numbers: float) -> sp.Expr:
    """The formula of a term of terms.py with ``numbers`` for the parameters named (structural switches:
    GRPO's ``kl_beta`` 0 leaves its KL out, ``kl_bias_correction`` 0 or 1) and the placeholder for r."""
    formula = factory.formula.xreplace({S.param(k): v for k, v in numbers.items()}).xreplace({TOKEN_RATIO: RATIO})
    if formula.has(OLD_LOGPROBS):
        raise RuntimeError(f"{factory.name}: terms.py's formula no longer reads the ratio as exp(logp - old_logprobs)")
    return formula


def at_level(formula: sp.Expr, sequence: bool) -> sp.Expr:
    """A formula of the placeholder at the token level (r = exp(l - old)), or at the sequence level
    (GSPO: the sequence's ratio, and its advantage, the mean of its tokens')."""
    if sequence:
        return formula.xreplace({RATIO: SEQUENCE_RATIO, ADVANTAGES: segment_mean(ADVANTAGES)})
    return formula.xreplace({RATIO: TOKEN_RATIO})


def summed(formula: sp.Expr, weight: Any, *, sequence: bool, segments: bool) -> sp.Expr:
    """TRL's sum of ``weight * formula`` over a sequence's tokens: per token (the head's rows), or a segment
    term (a weight of a segment term carries the sequence's token count ``n_s``, so that
    ``segment_mean(w * x)`` is the weighted sum over its tokens). At the sequence level the factors that read
    the ratio are the sequence's, the others (CISPO's ``A * l``) stay per token inside the sum."""
    if sequence:
        per_token, factor = formula.as_independent(RATIO, as_Add=False)
        return at_level(factor, True) * segment_mean(weight * per_token)
    x = weight * at_level(formula, False)
    return segment_mean(x) if segments else x


def log_gamma(log_w: Any, k: Any, lam: Any, exp: Any) -> Any:
    """VESPO's gamma weight in log space, ``lambda + k log w - lambda w`` (TRL's ``get_gamma_weights``),
    for sympy (the kernel) and torch (sequences with no completion token) alike."""
    return lam + k * log_w - lam * exp(log_w)


def grpo_head(*, loss_type: str, sequence: bool, old_given: bool, off_policy: bool, sampling_given: bool,
          beta: bool, bias_corrected: bool, entropy: bool, params: dict[str, float],
          softcap: float | None, logit_scale: float, top_entropy_quantile: float = 1.0) -> lcg.HeadLoss:
    """TRL's per-token objective from terms.py's declarations of its losses (``GRPO``, ``CISPO``, ``SAPO``,
    ``RefKL``, the clip ratios, ``Entropy``), put at TRL's level and weighted by per-token inputs. The term
    ``trl_policy`` is the policy loss plus the KL penalty, ``trl_entropy_bonus`` the entropy bonus (weights:
    the loss_type's normalisation, beta, vLLM's ratios, the entropy coefficient); the metrics are TRL's,
    as means over the completion tokens. Without old log-probs TRL's are the current pass's, detached.

    Token level: every part is a per-token formula (the head's rows). Sequence level (GSPO's
    ``importance_sampling_level="sequence"``) and VESPO (declared here from TRL's code: terms.py has no
    VESPO): the ratio is a sequence's, so ``trl_policy`` is a segment term (one segment per completion);
    TRL's per-sequence metrics are segment terms of weight 0 (counts over sequences). The off-policy
    sequence mask (``off_policy``) is a segment quantity too: with it, the policy term is a segment term
    at the token level as well."""
    segments = sequence or loss_type == "vespo" or off_policy
    w_pol, w_kl = S.token("w_pol"), S.token("w_kl")
    metrics: list = [lcg.Entropy()]
    counts: list = []                                  # (segment terms of weight 0)

    def declare(name: str, formula: sp.Expr, **options: Any) -> Any:
        if not old_given:   # TRL: old_per_token_logps = per_token_logps.detach()
            formula = formula.xreplace({OLD_LOGPROBS: S.stop_gradient(LOGPROB)})
        reads = {s.name[len(S.PARAM_PREFIX):] for s in formula.free_symbols if s.name.startswith(S.PARAM_PREFIX)}
        return lcg.declare_term(name, formula, defaults={k: v for k, v in params.items() if k in reads}, **options)

    def indicator(name: str, factory: Any) -> None:
        """TRL's clip ratio of terms.py's ``factory``: a metric per token, a count of sequences per sequence."""
        if sequence:
            counts.append(declare(name, at_level(of_ratio(factory), True))(weight=0.0))
        else:
            metrics.append(declare(name, at_level(of_ratio(factory), False), metric_only=True)())

    if loss_type == "vespo":
        # TRL's get_gamma_weights: log w = clamp(sum_t clamp(log_ratio, -20, 20) + sum_t log(IS ratio),
        # log 1e-8, 20), phi = exp(log_gamma) (0 where it overflows), detached; loss -phi * A * logp
        n, A_s = S.token("seq_len"), segment_mean(ADVANTAGES)
        log_w = S.clamp(segment_mean(n * S.clamp(LOGPROB - OLD_LOGPROBS, -20, 20)) + segment_mean(S.token("log_is")),
                        sp.Float(math.log(1e-8)), 20)
        k = S.Piecewise((S.param("k_pos"), A_s >= 0), (S.param("k_neg"), True))
        lam = S.Piecewise((S.param("lambda_pos"), A_s >= 0), (S.param("lambda_neg"), True))
        log_phi = log_gamma(log_w, k, lam, S.exp)
        phi = S.Piecewise((0, log_phi > LOG_FLOAT32_MAX), (S.exp(log_phi), True))
        policy = -S.stop_gradient(phi) * segment_mean(w_pol * ADVANTAGES * LOGPROB)
        counts.append(declare("vespo_phi", phi)(weight=0.0))
    else:
        factory = POLICY_TERMS.get(loss_type, T.GRPO)
        policy = summed(of_ratio(factory, kl_beta=0), w_pol, sequence=sequence, segments=segments)
        if loss_type == "cispo":
            indicator("cispo_clip", T.CISPOClipRatio)
        elif loss_type != "sapo":   # TRL's clip ratios, on coef_1 after delta's clamp
            indicator("clip_low", T.ClipRatioLow)
            indicator("clip_high", T.ClipRatioHigh)
            if not sequence:
                indicator("clip_region", T.ClipRatioRegion)
    if off_policy:
        # TRL's get_off_policy_mask: keep a sequence if A >= 0 or the mean over its tokens of
        # sampling - logp.detach() (NaN made 0: sampling_known) is at most the threshold; the sampling
        # log-probs are vLLM's, else the old ones, else the current pass's (the mean is then 0)
        if sampling_given:
            drift = S.token("sampling_known") * (S.token("sampling_logprobs") - S.stop_gradient(LOGPROB))
            close = segment_mean(drift) <= S.param("off_policy_threshold")
        else:
            close = sp.true if params["off_policy_threshold"] >= 0 else sp.false
        keep = sp.Or(segment_mean(ADVANTAGES) >= 0, close)
        policy = policy if keep == sp.true else S.Piecewise((1, keep), (0, True)) * policy
    if top_entropy_quantile < 1.0:
        # TRL's get_high_entropy_mask: the policy loss only where a token's entropy is at or above the
        # (1 - top_entropy_quantile) quantile of the micro-batch's completion tokens' (detached)
        H = T.Entropy.formula
        policy = S.Piecewise((1, H >= S.row_quantile(H, 1.0 - top_entropy_quantile)), (0, True)) * policy
    if beta:   # TRL's per_token_kl, times coef_1 (the sequence's under GSPO) with use_bias_correction_kl
        kl = of_ratio(T.RefKL, kl_bias_correction=int(bias_corrected))
        policy += summed(kl, w_kl, sequence=sequence, segments=segments)
        if bias_corrected and sequence:   # a sequence's coef_1 times its tokens' KL summed
            counts.append(declare("kl", summed(kl, S.token("seq_len"), sequence=True, segments=True))(weight=0.0))
        else:
            metrics.append(declare("kl", at_level(kl, False), metric_only=True)())
    terms = [declare("trl_policy", policy)()]
    if entropy:
        terms.append(declare("trl_entropy_bonus", S.token("w_ent") * T.Entropy.formula)())
    return lcg.HeadLoss(*terms, *counts, metrics=tuple(metrics), softcap=softcap, logit_scale=logit_scale)



# What TRL's DPO and KTO trainers log of the responses' tokens: each response's mean logit over the
# vocabulary, and the chosen responses' top-1 accuracy (means over the valid rows, times their number: sums)
CHOSEN = S.token("chosen")
MEAN_LOGIT = S.vsum(S.logit) / S.vocab_size
RESPONSE_TOKEN_METRICS = (
    lcg.declare_term("mean_logits_chosen", CHOSEN * MEAN_LOGIT, metric_only=True),
    lcg.declare_term("mean_logits_rejected", (1 - CHOSEN) * MEAN_LOGIT, metric_only=True),
    lcg.declare_term("token_accuracy_chosen", CHOSEN * S.Piecewise((1, sp.Eq(S.argmax, S.label)), (0, True)),
                     metric_only=True),
)



# TRL's fields without a gradient (TRL marks them non-differentiable): metrics of the head. log_probs
# and entropy have one (GRPO's entropy bonus differentiates the entropy): terms of the head.
LogSumSqProbs = lcg.declare_term("log_sum_sq_probs", S.log(S.vsum(S.softmax ** 2)), metric_only=True)
MeanLogits = lcg.declare_term("mean_logits", S.vsum(S.logit) / S.vocab_size, metric_only=True)


# ORPO's pair terms read over the completion rows only
COMPLETION = S.token("completion")   # 1 on a response's rows, 0 on its prompt's


def on_completions(term: lcg.Term) -> lcg.Term:
    """``term``, a pair term of ``preference`` in segment sums, with the sums over the completion rows."""
    if not term.formula.has(S.segment_mean):
        raise ValueError(f"{term.name}: not a term of segment sums")
    formula = term.formula.replace(S.segment_mean, lambda x: S.segment_mean(COMPLETION * x))
    return lcg.declare_term(term.name, formula, defaults=dict(term.params))(weight=term.weight)


_JSD_REDUCTIONS = ("batchmean", "sum", "mean")


@functools.lru_cache(maxsize=64)
def jsd_head(beta: float, temperature: float, softcap: float | None = None, logit_scale: float = 1.0) -> lcg.HeadLoss:
    """The head of TRL's ``generalized_jsd_loss(..., beta, temperature)``: ``JSD.trl``, on logits with the
    final-logit transform ``(softcap, logit_scale)`` (both sides')."""
    return lcg.HeadLoss(lcg.JSD.trl(beta=beta, temperature=temperature), softcap=softcap, logit_scale=logit_scale)


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         labels: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                         reduction: str = "batchmean", num_items_in_batch: Any = None) -> torch.Tensor:
    """TRL's ``GKDTrainer.generalized_jsd_loss`` (same arguments, same meaning and value), from one fused
    pass over the vocabulary: ``beta`` weighs the teacher in the mixture ``m = (1 - beta) p_student + beta
    p_teacher``, the loss is ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` per token, ``beta=0``
    is the forward KL ``KL(teacher || student)`` and ``beta=1`` the reverse KL, both logits divided by
    ``temperature``; positions whose label is -100 are left out. The sum over the tokens is divided by
    ``num_items_in_batch`` when given, else by the reduction's count: ``"batchmean"`` the tokens kept (the
    batch size without labels), ``"mean"`` the tokens kept times the vocabulary, ``"sum"`` none.
    (TRL's other reductions return a ``[tokens, vocab]`` tensor, which a fused pass does not build.)
    The gradient reaches the student's logits (the teacher's is not computed)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    if reduction not in _JSD_REDUCTIONS and num_items_in_batch is None:
        raise ValueError(f"reduction={reduction!r}: losscodegen's generalized_jsd_loss computes {_JSD_REDUCTIONS} "
                         "(TRL's other reductions return the [tokens, vocab] divergences, which a fused pass does not "
                         "build)")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                         f"{tuple(teacher_logits.shape)} must have one shape")
    head = jsd_head(float(beta), float(temperature))
    vocab = student_logits.shape[-1]
    if num_items_in_batch is not None:
        divisor = num_items_in_batch
    elif reduction == "sum":
        divisor = 1.0
    elif labels is None:
        divisor = student_logits.shape[0] if reduction == "batchmean" else student_logits.numel()
    else:
        kept = (labels != -100).sum()
        divisor = kept.clamp(min=1) if reduction == "batchmean" else kept * vocab
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(student_logits.device)
    return head(student_logits, labels, teacher_logits=teacher_logits, divisor=divisor).loss

