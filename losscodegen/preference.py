"""Preference losses as segment terms: TRL's DPO loss types, CPO, SimPO, ORPO and KTO.

A pair (DPO, CPO, SimPO, ORPO) is one segment: its chosen and its rejected response's rows share a
segment id, and the per-row token ``chosen`` (1 on the chosen response's rows, 0 on the rejected
one's) splits the segment's sums, so that ``segment_sum(chosen * (l - ref))`` is the chosen
response's log-ratio. Each loss is then its paper's per-pair formula in those sums; the kernel adds
every row's log-probability to its segment, the segment kernel applies the formula and its sympy
derivative, and the gradient launch reads dL/dl per row: no [rows, V] log-probabilities, no pass of
torch glue. KTO is per sequence: each sequence its own segment, ``chosen`` its desirability.

``pair_inputs`` / ``sequence_inputs`` turn TRL's batches into the keyword inputs these terms read.
Sources: TRL 1.x ``DPOTrainer._compute_loss``, ``CPOTrainer.cpo_loss``, ``ORPOTrainer.odds_ratio_loss``
and ``KTOTrainer._compute_loss``; tests/runtime/test_preference.py checks each against them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import sympy as sp
import torch

from . import symbols as S
from .terms import Term, declare_term

__all__ = ["DPO", "CPO", "SimPO", "ORPO", "KTO", "ChosenNLL", "pair_statistics", "sequence_statistics", "cpo_statistics",
           "orpo_statistics", "DPO_LOSS_TYPES", "pair_inputs", "sequence_inputs", "concatenated", "logsigmoid", "sigmoid"]

# the per-row tokens the terms read, filled by pair_inputs / sequence_inputs
CHOSEN = S.token("chosen")              # 1.0 on a chosen (KTO: desirable) response's rows, else 0.0
CHOSEN_SHARE = S.token("chosen_share")  # 1 / (the batch's valid chosen rows) on those rows, else 0
REF = S.token("ref_logprobs")           # the reference model's log-prob of each row's label

_l = S.target_logit - S.lse             # the policy's log-prob of the row's label


def logsigmoid(x: sp.Expr) -> sp.Expr:
    """``log sigmoid(x)`` written so that no exp overflows in fp32: ``min(x, 0) - log(1 + e^-|x|)``
    (its derivative, derived through torch's rules for Min and Abs, is sigmoid(-x) at 0 too)."""
    return S.Min(x, 0) - S.log(1 + S.exp(-S.Abs(x)))


def sigmoid(x: sp.Expr) -> sp.Expr:
    return S.exp(logsigmoid(x))


def _relu(x: sp.Expr) -> sp.Expr:
    # torch.relu's derivative: 0 at 0 (Max(x, 0) would split the tie)
    return S.Piecewise((x, x > 0), (0, True))


def _split(u: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """(sum over the chosen response's valid rows, sum over the rejected one's) of ``u``."""
    return S.segment_sum(CHOSEN * u), S.segment_sum((1 - CHOSEN) * u)


_beta, _eps = S.param("beta"), S.param("label_smoothing")
_chosen_lr, _rejected_lr = _split(_l - REF)          # log-ratios against the reference
_chosen_logps, _rejected_logps = _split(_l)
_n_chosen, _n_rejected = _split(sp.S.One)            # valid rows of each response


def _scores(f_divergence_type: str) -> tuple[sp.Expr, sp.Expr]:
    """TRL's chosen/rejected scores, f'(policy/reference) of the f-divergence, of the log-ratios."""
    if f_divergence_type == "reverse_kl":
        return _chosen_lr, _rejected_lr
    if f_divergence_type == "forward_kl":
        return 1 - S.exp(-_chosen_lr), 1 - S.exp(-_rejected_lr)
    if f_divergence_type == "js_divergence":
        return math.log(2) + logsigmoid(_chosen_lr), math.log(2) + logsigmoid(_rejected_lr)
    if f_divergence_type == "alpha_divergence":
        # (t^(a-1) - 1)/(a-1), TRL's exponent clamped at 80 (fp32): torch.clamp(max=80)'s derivative
        a1 = S.param("f_alpha_divergence_coef") - 1
        clamped = [S.Piecewise((x, x <= 80), (80, True)) for x in (a1 * _chosen_lr, a1 * _rejected_lr)]
        return tuple((S.exp(x) - 1) / a1 for x in clamped)
    raise ValueError(f"f_divergence_type must be one of 'reverse_kl', 'forward_kl', 'js_divergence', "
                     f"'alpha_divergence', got {f_divergence_type!r}")


def _wpo_weight() -> sp.Expr:
    """WPO's pair weight (arXiv 2406.11827, eq. 2; TRL's use_weighting): the product over the two
    responses of exp(mean over the response's rows of log p_y - log sum_i p_i^2), detached."""
    aligned = _l - S.log(S.vsum(S.softmax ** 2))
    chosen, rejected = _split(aligned)
    return S.stop_gradient(S.exp(_per_token(chosen, _n_chosen) + _per_token(rejected, _n_rejected)))


def _per_token(x: sp.Expr, n: sp.Expr) -> sp.Expr:
    return x / S.Max(n, 1)   # TRL: / completion_mask.sum(dim=1).clamp(min=1.0)


def _dpo_formula(loss_type: str, cs: sp.Expr, rs: sp.Expr) -> sp.Expr:
    """TRL's per-pair DPO loss of each loss_type, in the scores and log-ratios of the pair."""
    d = _beta * (cs - rs)
    cr, rr = _beta * _chosen_lr, _beta * _rejected_lr
    forms: dict[str, Callable[[], sp.Expr]] = {
        "sigmoid": lambda: -logsigmoid(d),
        "hinge": lambda: _relu(1 - d),
        "ipo": lambda: (_per_token(cs, _n_chosen) - _per_token(rs, _n_rejected) - 1 / (2 * _beta)) ** 2,
        "exo_pair": lambda: (sigmoid(d) * (logsigmoid(d) - S.log(1 - _eps))
                             + sigmoid(-d) * (logsigmoid(-d) - S.log(_eps))),
        "nca_pair": lambda: -logsigmoid(cr) - logsigmoid(-cr) / 2 - logsigmoid(-rr) / 2,
        "robust": lambda: (-(1 - _eps) * logsigmoid(d) + _eps * logsigmoid(-d)) / (1 - 2 * _eps),
        "bco_pair": lambda: -logsigmoid(cr) - logsigmoid(-rr),
        "sppo_hard": lambda: (_chosen_lr - 1 / (2 * _beta)) ** 2 + (_rejected_lr + 1 / (2 * _beta)) ** 2,
        "apo_zero": lambda: sigmoid(-cr) + sigmoid(rr),
        "apo_down": lambda: sigmoid(cr) + sigmoid(-(cr - rr)),
        "discopop": lambda: (-logsigmoid(d) * (1 - sigmoid(d / S.param("discopop_tau")))
                             + S.exp(-d) * sigmoid(d / S.param("discopop_tau"))),
        "sigmoid_norm": lambda: -logsigmoid(_beta * (_per_token(cs, _n_chosen) - _per_token(rs, _n_rejected))),
        # AOT (arXiv 2406.05882): the pairs' log-ratios sorted over the batch, the k-th smallest of one
        # against the k-th smallest of the other (S.segment_sorted: the segment step sorts them)
        "aot": lambda: _smoothed(S.segment_sorted((2 * CHOSEN - 1) * _l) - S.segment_sorted((2 * CHOSEN - 1) * REF)),
        "aot_unpaired": lambda: _smoothed(S.segment_sorted(CHOSEN * (_l - REF))
                                          - S.segment_sorted((1 - CHOSEN) * (_l - REF))),
    }
    return forms[loss_type]()


def _smoothed(delta: sp.Expr) -> sp.Expr:
    """TRL's label-smoothed sigmoid loss of ``beta * delta`` (aot's)."""
    return -logsigmoid(_beta * delta) * (1 - _eps) - logsigmoid(-_beta * delta) * _eps


# TRL's loss types: per-pair formulas (plus "sft", ChosenNLL), and "aot"/"aot_unpaired", formulas of
# the batch's sorted log-ratios (S.segment_sorted)
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                  "apo_zero", "apo_down", "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft")
_BATCH_SORTED = ("aot", "aot_unpaired")
# The loss types that read the scores only through their chosen-rejected difference, where the f-DPO
# reparameterization's beta*log Z(x) cancels: the others have no f-divergence form (TRL 1.16's
# DPOTrainer refuses them with an f_divergence_type other than reverse_kl, and so does DPO)
_F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def _term(name: str, formula: sp.Expr, weight: Any, values: dict[str, Any]) -> Term:
    """The term of ``formula`` with the parameters it reads taken from ``values``."""
    used = {s.name[len(S.PARAM_PREFIX):] for s in formula.free_symbols if s.name.startswith(S.PARAM_PREFIX)}
    factory = declare_term(name, formula, defaults={k: v for k, v in values.items() if k in used})
    return factory(weight=weight)


def ChosenNLL(*, weight: Any = 1.0) -> Term:
    """``chosen_nll``: the mean over the batch's valid chosen rows of ``-log p_y`` (TRL's CPO/ORPO
    ``nll_loss`` and DPO's loss_type "sft"); reads ``chosen_share`` from ``pair_inputs``."""
    return declare_term("chosen_nll", -CHOSEN_SHARE * _l)(weight=weight, normalize="sum")


def DPO(*, loss_type: str = "sigmoid", beta: Any = 0.1, label_smoothing: Any = 0.0,
        f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 1.0,
        discopop_tau: Any = 0.05, use_weighting: bool = False, weight: Any = 1.0) -> Term:
    """TRL's DPO loss of ``loss_type`` (its ``DPOConfig`` options of the same names), named
    ``dpo_<loss_type>``: per pair, averaged over the pairs. Reads ``pair_inputs``' tokens. Give
    several (with their ``loss_weights`` as ``weight=``) in one head for TRL's list of loss types.
    ``use_weighting``: WPO's detached pair weight (``_wpo_weight``). ``aot`` and ``aot_unpaired`` read
    the log-ratios sorted over the batch's pairs (as TRL's; TRL refuses ``use_weighting`` with them,
    and so do they). An ``f_divergence_type`` other than ``reverse_kl`` is refused, as TRL refuses it,
    with a loss type outside ``_F_DIVERGENCE_LOSS_TYPES``."""
    if loss_type in _BATCH_SORTED and use_weighting:
        raise ValueError(f"loss_type={loss_type!r} sorts the pairs' log-ratios, which WPO's pair weight "
                         "(use_weighting=True) does not follow: TRL refuses the two together too")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if f_divergence_type != "reverse_kl" and loss_type not in _F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} with loss_type={loss_type!r}: an f-divergence is only "
            f"defined for the loss types {_F_DIVERGENCE_LOSS_TYPES}, which read the chosen-rejected score "
            "difference (where the f-DPO reparameterization's beta*log Z(x) cancels); "
            f"{loss_type!r} reads the log-ratios themselves. Use f_divergence_type='reverse_kl' with it "
            "(TRL's DPOTrainer refuses the combination too)")
    if loss_type == "sft":
        return ChosenNLL(weight=weight)
    if loss_type == "exo_pair" and not 0 < float(label_smoothing) < 1:
        raise ValueError(f"loss_type='exo_pair' takes log(label_smoothing) and log(1 - label_smoothing): "
                         f"label_smoothing must be in (0, 1), got {label_smoothing}")
    if loss_type == "robust" and float(label_smoothing) == 0.5:
        raise ValueError("loss_type='robust' divides by 1 - 2*label_smoothing: label_smoothing=0.5 is refused")
    if f_divergence_type == "alpha_divergence" and abs(f_alpha_divergence_coef - 1.0) < 1e-6:
        f_divergence_type = "reverse_kl"   # TRL's limit case
    cs, rs = _scores(f_divergence_type)
    formula = _dpo_formula(loss_type, cs, rs) * (_wpo_weight() if use_weighting else 1)
    return _term(f"dpo_{loss_type}", formula, weight,
                 dict(beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                      f_alpha_divergence_coef=f_alpha_divergence_coef))


def pair_statistics() -> tuple[Term, ...]:
    """What TRL's DPOTrainer logs of each pair, as segment terms of weight 0 (values, no gradient), each
    averaged over the pairs like the pair losses: ``logps_chosen`` / ``logps_rejected`` (a response's
    log-probability), ``logratio_chosen`` / ``logratio_rejected`` (against the reference: the rewards
    divided by beta) and ``reward_accuracy`` (1 where the chosen log-ratio is above the rejected one)."""
    values = dict(logps_chosen=_chosen_logps, logps_rejected=_rejected_logps, logratio_chosen=_chosen_lr,
                  logratio_rejected=_rejected_lr,
                  reward_accuracy=S.Piecewise((1, _chosen_lr > _rejected_lr), (0, True)))
    return tuple(declare_term(name, formula)(weight=0.0) for name, formula in values.items())


_CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def _cpo_rewards(loss_type: str, alpha: float) -> tuple[sp.Expr, sp.Expr, sp.Expr, sp.Expr]:
    """TRL's CPO per pair: (chosen, rejected) log-probabilities (averages for ``ipo`` and ``simpo``, else
    sums), and the rewards over beta they give (AlphaPO's ``(1 - p^-alpha)/alpha`` where alpha != 0)."""
    chosen, rejected = _chosen_logps, _rejected_logps
    if loss_type in ("ipo", "simpo"):   # TRL: average_log_prob (sum / count, no clamp)
        chosen, rejected = chosen / _n_chosen, rejected / _n_rejected
    if alpha == 0:
        return chosen, rejected, chosen, rejected
    a = S.param("alpha")
    return chosen, rejected, (1 - S.exp(-a * chosen)) / a, (1 - S.exp(-a * rejected)) / a


def CPO(*, loss_type: str = "sigmoid", beta: Any = 0.1, label_smoothing: Any = 0.0,
        simpo_gamma: Any = 0.5, alpha: float = 0.0, weight: Any = 1.0) -> Term:
    """TRL's ``CPOTrainer.cpo_loss`` (reference-free) of ``loss_type``, named ``cpo_<loss_type>``
    (``simpo`` for SimPO): per pair, averaged over the pairs. ``ipo`` and ``simpo`` read the average
    log-probability of each response, the others its sum. ``alpha`` != 0 is AlphaPO's reward
    ``(1 - p^-alpha)/alpha``. Add ``ChosenNLL(weight=cpo_alpha)`` for TRL's NLL term."""
    if loss_type not in _CPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {_CPO_LOSS_TYPES}, got {loss_type!r}")
    _, _, chosen, rejected = _cpo_rewards(loss_type, alpha)
    x = chosen - rejected
    if loss_type == "simpo":
        x = x - S.param("simpo_gamma") / _beta
    forms = {
        "sigmoid": lambda: -logsigmoid(_beta * x) * (1 - _eps) - logsigmoid(-_beta * x) * _eps,
        "hinge": lambda: _relu(1 - _beta * x),
        "ipo": lambda: (x - 1 / (2 * _beta)) ** 2,
    }
    formula = forms["sigmoid" if loss_type == "simpo" else loss_type]()
    name = "simpo" if loss_type == "simpo" else f"cpo_{loss_type}"
    return _term(name, formula, weight, dict(beta=beta, label_smoothing=label_smoothing,
                                             simpo_gamma=simpo_gamma, alpha=alpha))


def cpo_statistics(*, loss_type: str = "sigmoid", alpha: float = 0.0) -> tuple[Term, ...]:
    """What TRL's CPOTrainer logs of each pair, as segment terms of weight 0 averaged over the pairs:
    ``logps_chosen`` / ``logps_rejected`` (the log-probabilities ``CPO(loss_type=...)`` reads: averages
    for ipo and simpo), ``reward_chosen`` / ``reward_rejected`` (the rewards over beta) and
    ``reward_accuracy`` (1 where the chosen reward is above the rejected one)."""
    chosen, rejected, reward_c, reward_r = _cpo_rewards(loss_type, alpha)
    values = dict(logps_chosen=chosen, logps_rejected=rejected, reward_chosen=reward_c, reward_rejected=reward_r,
                  reward_accuracy=S.Piecewise((1, reward_c > reward_r), (0, True)))
    return tuple(_term(name, formula, 0.0, dict(alpha=alpha)) for name, formula in values.items())


def SimPO(*, beta: Any = 2.0, gamma: Any = 0.5, label_smoothing: Any = 0.0, weight: Any = 1.0) -> Term:
    """SimPO (arXiv 2405.14734): ``-log sigmoid(beta*(avg logp_chosen - avg logp_rejected) - gamma)``,
    TRL's CPO with loss_type="simpo" (``gamma`` its simpo_gamma), named ``simpo``."""
    return CPO(loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=label_smoothing, weight=weight)


def _log1mexp(x: sp.Expr) -> sp.Expr:
    return S.log(1 - S.exp(x))


def _orpo_pair() -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """ORPO's (chosen, rejected) average log-probabilities of a pair and its log odds ratio."""
    chosen, rejected = _chosen_logps / _n_chosen, _rejected_logps / _n_rejected
    return chosen, rejected, (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))


def ORPO(*, beta: Any = 0.1, weight: Any = 1.0) -> Term:
    """ORPO's odds-ratio term (arXiv 2403.07691), TRL's ``-beta * logsigmoid(log_odds)`` over the
    responses' average log-probabilities, named ``orpo``; ORPO's loss is this plus ``ChosenNLL()``."""
    return _term("orpo", -_beta * logsigmoid(_orpo_pair()[2]), weight, dict(beta=beta))


def orpo_statistics() -> tuple[Term, ...]:
    """What TRL's ORPOTrainer logs of each pair, as segment terms of weight 0 averaged over the pairs:
    ``logps_chosen`` / ``logps_rejected`` (each response's average log-probability, as ``ORPO`` reads
    it), ``log_odds`` (the pair's log odds ratio, TRL's ``log_odds_chosen``) and ``reward_accuracy`` (1
    where the chosen average is above the rejected one)."""
    chosen, rejected, log_odds = _orpo_pair()
    values = dict(logps_chosen=chosen, logps_rejected=rejected, log_odds=log_odds,
                  reward_accuracy=S.Piecewise((1, chosen > rejected), (0, True)))
    return tuple(declare_term(name, formula)(weight=0.0) for name, formula in values.items())


_KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def KTO(*, loss_type: str = "kto", beta: Any = 0.1, kl: Any = 0.0, desirable_weight: Any = 1.0,
        undesirable_weight: Any = 1.0, weight: Any = 1.0) -> Term:
    """TRL's KTO loss per sequence (each sequence its own segment, ``chosen`` 1 where desirable),
    averaged over the sequences, named ``kto`` (``kto_apo_zero_unpaired``). ``kl``: TRL's detached
    reference KL estimate of the batch (``(KL_logps - ref_KL_logps).mean().clamp(min=0)``), a number
    or a 0-dim tensor read at each call."""
    if loss_type not in _KTO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {_KTO_LOSS_TYPES}, got {loss_type!r}")
    desirable = S.segment_mean(CHOSEN)                 # 1 or 0: the sequence's label
    lr = S.segment_sum(_l - REF)
    z = S.param("kl") if loss_type == "kto" else 0
    formula = (desirable * S.param("desirable_weight") * sigmoid(-_beta * (lr - z))
               + (1 - desirable) * S.param("undesirable_weight") * sigmoid(_beta * (lr - z)))
    name = "kto" if loss_type == "kto" else f"kto_{loss_type}"
    return _term(name, formula, weight, dict(beta=beta, kl=kl, desirable_weight=desirable_weight,
                                             undesirable_weight=undesirable_weight))


def sequence_statistics() -> tuple[Term, ...]:
    """What TRL's KTOTrainer logs of each sequence, as segment terms of weight 0 averaged over the
    sequences like ``KTO``: ``logps_desirable`` / ``logps_undesirable`` (a sequence's log-probability
    where it is desirable / undesirable, else 0) and ``logratio_desirable`` / ``logratio_undesirable``
    (against the reference: the rewards divided by beta)."""
    desirable = S.segment_mean(CHOSEN)
    logps, logratio = S.segment_sum(_l), S.segment_sum(_l - REF)
    values = dict(logps_desirable=desirable * logps, logps_undesirable=(1 - desirable) * logps,
                  logratio_desirable=desirable * logratio, logratio_undesirable=(1 - desirable) * logratio)
    return tuple(declare_term(name, formula)(weight=0.0) for name, formula in values.items())


# ----- inputs -------------------------------------------------------------------------------------
def concatenated(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """TRL's concatenated layout of a chosen and a rejected batch (logits, labels, hidden states,
    reference log-probs...): the chosen rows first, then the rejected ones."""
    if chosen.shape[1:] != rejected.shape[1:] or chosen.shape[0] != rejected.shape[0]:
        raise ValueError(f"chosen and rejected must have the same shape (pad them to one length), got "
                         f"{tuple(chosen.shape)} and {tuple(rejected.shape)}")
    return torch.cat([chosen, rejected])


def _valid(head: Any, labels: torch.Tensor, ignore_index: int | None, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """The rows ``head`` reads as valid: its own ``ignore_index`` (the only one it ignores, so the one
    the reference sums are spread over and ``chosen_share`` counts), and ``loss_mask``."""
    if ignore_index is not None and ignore_index != head.ignore_index:
        raise ValueError(f"ignore_index={ignore_index!r} is not the head's ignore_index={head.ignore_index!r}: the "
                         "head reads the rows labelled with its own as ignored, so these inputs must too. "
                         "Leave ignore_index out (it defaults to the head's)")
    valid = labels != head.ignore_index
    return valid if loss_mask is None else valid & loss_mask


def _ref_rows(labels, valid, ref_logprobs, per_sequence, name_rows, name_seq) -> torch.Tensor:
    """Per-row reference log-probs: given per token, or a per-sequence sum spread evenly over the
    sequence's valid rows (so that its segment sum is the given sum)."""
    if (ref_logprobs is None) == (per_sequence is None):
        raise ValueError(f"pass one of {name_rows} (per token, shaped like labels) or {name_seq} "
                         "(per sequence)")
    if ref_logprobs is not None:
        if ref_logprobs.shape != labels.shape:
            raise ValueError(f"{name_rows} must be shaped like labels {tuple(labels.shape)}, got "
                             f"{tuple(ref_logprobs.shape)}")
        return torch.where(valid, ref_logprobs.float(), 0.0)
    rows = valid.reshape(valid.shape[0], -1)
    if per_sequence.shape != (valid.shape[0],):
        raise ValueError(f"{name_seq} must have shape ({valid.shape[0]},), got {tuple(per_sequence.shape)}")
    share = per_sequence.float()[:, None] / rows.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(rows, share, 0.0).reshape(labels.shape)


def _check_labels(labels: torch.Tensor) -> None:
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.dtype != torch.int64:
        raise ValueError("labels must be an int64 tensor [sequences, tokens...] (one sequence a row "
                         f"of its first dimension), got {getattr(labels, 'shape', labels)!r}")


def _for(head: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs ``head`` reads (a head refuses keywords it does not read), each one it reads there."""
    if head.terms_reading("ref_logprobs") and "ref_logprobs" not in inputs:
        raise ValueError(f"{head.terms_reading('ref_logprobs')} read(s) the reference log-probs: pass "
                         "ref_logprobs (per token) or the per-sequence reference sums")
    return {k: v for k, v in inputs.items()
            if k in ("segment_ids", "num_segments") or head.terms_reading(k)}


def pair_inputs(head: Any, labels: torch.Tensor, *, ref_logprobs: torch.Tensor | None = None,
                ref_chosen_logps: torch.Tensor | None = None, ref_rejected_logps: torch.Tensor | None = None,
                ignore_index: int | None = None, loss_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """The keyword inputs ``head`` reads of DPO, CPO, SimPO, ORPO and ChosenNLL, for TRL's concatenated layout:
    ``labels`` [2B, T] (the chosen responses' rows first, then the rejected ones'; prompt and padding
    rows the head's ``ignore_index``: an ``ignore_index=`` given must be the head's). Reference
    log-probs per token (``ref_logprobs`` [2B, T]) or per response (``ref_chosen_logps``,
    ``ref_rejected_logps`` [B], TRL's precomputed ones); none for the
    reference-free losses. Returns ``segment_ids`` (pair b of rows b and B + b), ``num_segments``,
    ``chosen``, ``chosen_share`` and ``ref_logprobs``, those the head reads: pass them to it with
    ``**``. No wait for the device."""
    _check_labels(labels)
    if labels.shape[0] % 2:
        raise ValueError(f"labels must hold the chosen then the rejected responses (an even number of "
                         f"rows), got {labels.shape[0]}")
    B = labels.shape[0] // 2
    valid = _valid(head, labels, ignore_index, loss_mask)
    seq = torch.arange(2 * B, device=labels.device)
    expand = [2 * B] + [1] * (labels.dim() - 1)
    out: dict[str, Any] = {
        "segment_ids": (seq % max(B, 1)).reshape(expand).expand(labels.shape).contiguous(),
        "num_segments": B,
        "chosen": (seq < B).float().reshape(expand).expand(labels.shape).contiguous(),
    }
    chosen_rows = valid & (out["chosen"] > 0)
    out["chosen_share"] = chosen_rows.float() / chosen_rows.sum().clamp_min(1)
    per_seq = None
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("pass both ref_chosen_logps and ref_rejected_logps, or neither")
    if ref_chosen_logps is not None:
        per_seq = torch.cat([ref_chosen_logps.reshape(-1), ref_rejected_logps.reshape(-1)])
    if ref_logprobs is not None or per_seq is not None:
        out["ref_logprobs"] = _ref_rows(labels, valid, ref_logprobs, per_seq, "ref_logprobs",
                                        "ref_chosen_logps/ref_rejected_logps")
    return _for(head, out)


def sequence_inputs(head: Any, labels: torch.Tensor, *, desirable: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                    ref_logps: torch.Tensor | None = None, ignore_index: int | None = None,
                    loss_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """KTO's keyword inputs: ``labels`` [B, T], ``desirable`` [B] (TRL's ``label``: True where the
    completion is desirable), reference log-probs per token or per sequence (``ref_logps`` [B]).
    Each sequence is its own segment; ignored rows as in ``pair_inputs`` (the head's ``ignore_index``)."""
    _check_labels(labels)
    B = labels.shape[0]
    if desirable.shape != (B,):
        raise ValueError(f"desirable must have shape ({B},), got {tuple(desirable.shape)}")
    valid = _valid(head, labels, ignore_index, loss_mask)
    expand = [B] + [1] * (labels.dim() - 1)
    out: dict[str, Any] = {
        "segment_ids": torch.arange(B, device=labels.device).reshape(expand).expand(labels.shape).contiguous(),
        "num_segments": B,
        "chosen": desirable.float().reshape(expand).expand(labels.shape).contiguous(),
    }
    # (as pair_inputs: none for a head that reads no reference; _for names the terms that do)
    if ref_logprobs is not None or ref_logps is not None:
        out["ref_logprobs"] = _ref_rows(labels, valid, ref_logprobs, ref_logps, "ref_logprobs", "ref_logps")
    return _for(head, out)
