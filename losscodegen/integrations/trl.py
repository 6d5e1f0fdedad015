"""TRL: ``GRPOTrainer``, a subclass of ``trl.GRPOTrainer`` (same constructor) whose ``_compute_loss``
computes TRL's whole objective (policy term, KL penalty, entropy bonus) in one ``head.linear`` call per
micro-batch, and logs TRL's metric names (docs/integrations-trl.md). ``DPOTrainer`` and ``KTOTrainer``
do the same for TRL's preference trainers with the terms of ``losscodegen.preference``; ``SFTTrainer``
trains on a patched model's head.

TRL 1.16's ``_compute_loss`` gets per-token log-probs and entropies from its chunked fused LM head,
then builds each ``loss_type`` in torch. Here every part of that is a formula declared from TRL's
code, per token, or per completion as a segment term where TRL reads a sequence's quantity (GSPO's
ratio, VESPO's weight, the off-policy mask), with each ``loss_type``'s normalisation (and the vLLM
importance-sampling ratios, the KL's beta, the entropy bonus's coefficient) folded into per-token
weights: the head's sum is the loss. Options that one call cannot hold are refused at construction,
by name (``unfused_options``).
"""
from __future__ import annotations

import contextlib
import functools
import math
import types
from dataclasses import dataclass
from typing import Any

import sympy as sp
import torch

import losscodegen as lcg
from losscodegen import preference as P
from losscodegen import symbols as S
from losscodegen import terms as T
from losscodegen.integrations.trl_lm_head import (add_fused_lm_head, computes_trls_fused_loss,  # noqa: F401
                                                  final_logit_transform, fusing_objective, replace_fused_lm_heads,
                                                  trl_fused_head_of)

try:
    import trl
    from transformers.modeling_outputs import ModelOutput
    from trl.trainer.utils import nanmax, nanmin
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["GRPOTrainer", "SFTTrainer", "DPOTrainer", "KTOTrainer", "FUSED_LOSS_TYPES", "unfused_dpo_options",
           "FUSED_IMPORTANCE_SAMPLING_LEVELS", "unfused_options", "generalized_jsd_loss"]

FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
FUSED_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# the loss types whose clip ratios TRL logs per sequence at the token level (a min and a max over sequences)
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _refuse(options: list[str], trainer: str = "GRPOTrainer") -> None:
    if options:
        raise ValueError(f"losscodegen's {trainer} cannot fuse " + "; ".join(options)
                         + f": use trl.{trainer} for these")


def _router_loss(args: Any, model: Any) -> list[str]:
    """A mixture-of-experts model's load-balancing loss, which TRL adds to the head's (refused)."""
    text_config = model.config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(text_config, "output_router_logits") and coef != 0.0:
        return [f"router_aux_loss_coef={coef} (a mixture-of-experts load-balancing loss)"]
    return []


def unfused_options(args: Any, model: Any = None) -> list[str]:
    """The options of a ``GRPOConfig`` (and model) that ``GRPOTrainer`` cannot fuse, each with why."""
    out = []
    if args.loss_type not in FUSED_LOSS_TYPES:
        out.append(f"loss_type={args.loss_type!r} (fused: {', '.join(FUSED_LOSS_TYPES)})")
    if args.importance_sampling_level not in FUSED_IMPORTANCE_SAMPLING_LEVELS:
        out.append(f"importance_sampling_level={args.importance_sampling_level!r} "
                   f"(fused: {', '.join(FUSED_IMPORTANCE_SAMPLING_LEVELS)})")
    if args.top_entropy_quantile < 1.0:
        # (fused at the token level: the mask multiplies a token's policy loss, S.row_quantile)
        if args.importance_sampling_level == "sequence" or args.loss_type == "vespo" \
                or args.off_policy_mask_threshold is not None:
            out.append(f"top_entropy_quantile={args.top_entropy_quantile} with a sequence-level loss "
                       "(importance_sampling_level='sequence', vespo or an off-policy mask: the token mask inside a "
                       "sequence's term); fused at importance_sampling_level='token'")
        if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
            out.append(f"top_entropy_quantile={args.top_entropy_quantile} with the entropy bonus (TRL divides "
                       "the bonus by the number of masked tokens, which the head knows only after the quantile); "
                       "fused without entropy_coef")
    if args.off_policy_mask_threshold is not None and args.importance_sampling_level == "token" \
            and args.loss_type in _CLIPPED:
        out.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold} with loss_type={args.loss_type!r} at "
                   "importance_sampling_level='token' (the mask is a segment term, and TRL's per-sequence "
                   "clip_ratio/low_min and high_max need every token's row, which a head with segment terms does "
                   "not give; fused with importance_sampling_level='sequence' and with cispo, sapo and vespo)")
    return out + (_router_loss(args, model) if model is not None else [])


_SEQ = S.segment_mean
# exp above this overflows fp32: TRL's phi_seq is then inf, which its nan_to_num makes 0
_LOG_FLT_MAX = math.log(torch.finfo(torch.float32).max)
# terms.py's policy-gradient formulas read l = log p_y, the ratio r = exp(l - old_logprobs) and the
# advantage A; here r stands as a placeholder while a formula is put at the token or sequence level
_L = S.target_logit - S.lse
_OLD, _A = S.token("old_logprobs"), S.token("advantages")
_RATIO = S.exp(_L - _OLD)
_R = sp.Dummy("r")
_SEQ_RATIO = S.exp(_SEQ(_L - _OLD))    # GSPO's: the ratio of the mean over the sequence's tokens
_POLICY = {"cispo": T.CISPO, "sapo": T.SAPO}   # TRL's loss_type -> terms.py's term (else GRPO)


def _of_ratio(factory: Any, **numbers: float) -> sp.Expr:
    """The formula of a term of terms.py with ``numbers`` for the parameters named (structural switches:
    GRPO's ``kl_beta`` 0 leaves its KL out, ``kl_bias_correction`` 0 or 1) and the placeholder for r."""
    formula = factory.formula.xreplace({S.param(k): v for k, v in numbers.items()}).xreplace({_RATIO: _R})
    if formula.has(_OLD):
        raise RuntimeError(f"{factory.name}: terms.py's formula no longer reads the ratio as exp(logp - old_logprobs)")
    return formula


def _at(formula: sp.Expr, sequence: bool) -> sp.Expr:
    """A formula of the placeholder at the token level (r = exp(l - old)), or at the sequence level
    (GSPO: the sequence's ratio, and its advantage, the mean of its tokens')."""
    return formula.xreplace({_R: _SEQ_RATIO, _A: _SEQ(_A)} if sequence else {_R: _RATIO})


def _summed(formula: sp.Expr, weight: Any, *, sequence: bool, segments: bool) -> sp.Expr:
    """TRL's sum of ``weight * formula`` over a sequence's tokens: per token (the head's rows), or a segment
    term (a weight of a segment term carries the sequence's token count ``n_s``, so that
    ``segment_mean(w * x)`` is the weighted sum over its tokens). At the sequence level the factors that read
    the ratio are the sequence's, the others (CISPO's ``A * l``) stay per token inside the sum."""
    if sequence:
        per_token, factor = formula.as_independent(_R, as_Add=False)
        return _at(factor, True) * _SEQ(weight * per_token)
    x = weight * _at(formula, False)
    return _SEQ(x) if segments else x


def _log_gamma(log_w: Any, k: Any, lam: Any, exp: Any) -> Any:
    """VESPO's gamma weight in log space, ``lambda + k log w - lambda w`` (TRL's ``get_gamma_weights``),
    for sympy (the kernel) and torch (sequences with no completion token) alike."""
    return lam + k * log_w - lam * exp(log_w)


def _head(*, loss_type: str, sequence: bool, old_given: bool, off_policy: bool, sampling_given: bool,
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
            formula = formula.xreplace({_OLD: S.stop_gradient(_L)})
        reads = {s.name[len(S.PARAM_PREFIX):] for s in formula.free_symbols if s.name.startswith(S.PARAM_PREFIX)}
        return lcg.declare_term(name, formula, defaults={k: v for k, v in params.items() if k in reads}, **options)

    def indicator(name: str, factory: Any) -> None:
        """TRL's clip ratio of terms.py's ``factory``: a metric per token, a count of sequences per sequence."""
        if sequence:
            counts.append(declare(name, _at(_of_ratio(factory), True))(weight=0.0))
        else:
            metrics.append(declare(name, _at(_of_ratio(factory), False), metric_only=True)())

    if loss_type == "vespo":
        # TRL's get_gamma_weights: log w = clamp(sum_t clamp(log_ratio, -20, 20) + sum_t log(IS ratio),
        # log 1e-8, 20), phi = exp(log_gamma) (0 where it overflows), detached; loss -phi * A * logp
        n, A_s = S.token("seq_len"), _SEQ(_A)
        log_w = S.clamp(_SEQ(n * S.clamp(_L - _OLD, -20, 20)) + _SEQ(S.token("log_is")), sp.Float(math.log(1e-8)), 20)
        k = S.Piecewise((S.param("k_pos"), A_s >= 0), (S.param("k_neg"), True))
        lam = S.Piecewise((S.param("lambda_pos"), A_s >= 0), (S.param("lambda_neg"), True))
        log_phi = _log_gamma(log_w, k, lam, S.exp)
        phi = S.Piecewise((0, log_phi > _LOG_FLT_MAX), (S.exp(log_phi), True))
        policy = -S.stop_gradient(phi) * _SEQ(w_pol * _A * _L)
        counts.append(declare("vespo_phi", phi)(weight=0.0))
    else:
        factory = _POLICY.get(loss_type, T.GRPO)
        policy = _summed(_of_ratio(factory, kl_beta=0), w_pol, sequence=sequence, segments=segments)
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
            drift = S.token("sampling_known") * (S.token("sampling_logprobs") - S.stop_gradient(_L))
            close = _SEQ(drift) <= S.param("off_policy_threshold")
        else:
            close = sp.true if params["off_policy_threshold"] >= 0 else sp.false
        keep = sp.Or(_SEQ(_A) >= 0, close)
        policy = policy if keep == sp.true else S.Piecewise((1, keep), (0, True)) * policy
    if top_entropy_quantile < 1.0:
        # TRL's get_high_entropy_mask: the policy loss only where a token's entropy is at or above the
        # (1 - top_entropy_quantile) quantile of the micro-batch's completion tokens' (detached)
        H = T.Entropy.formula
        policy = S.Piecewise((1, H >= S.row_quantile(H, 1.0 - top_entropy_quantile)), (0, True)) * policy
    if beta:   # TRL's per_token_kl, times coef_1 (the sequence's under GSPO) with use_bias_correction_kl
        kl = _of_ratio(T.RefKL, kl_bias_correction=int(bias_corrected))
        policy += _summed(kl, w_kl, sequence=sequence, segments=segments)
        if bias_corrected and sequence:   # a sequence's coef_1 times its tokens' KL summed
            counts.append(declare("kl", _summed(kl, S.token("seq_len"), sequence=True, segments=True))(weight=0.0))
        else:
            metrics.append(declare("kl", _at(kl, False), metric_only=True)())
    terms = [declare("trl_policy", policy)()]
    if entropy:
        terms.append(declare("trl_entropy_bonus", S.token("w_ent") * T.Entropy.formula)())
    return lcg.HeadLoss(*terms, *counts, metrics=tuple(metrics), softcap=softcap, logit_scale=logit_scale)


@dataclass
class FusedObjectiveOutput(ModelOutput):
    """What the patched forward returns for ``losscodegen=(head, labels, inputs, n)``: the head's
    ``HeadOutput`` fields."""

    loss: torch.Tensor | None = None
    terms: dict | None = None
    metrics: dict | None = None
    rows: dict | None = None


def add_fused_objective(model: Any, cast_lm_head_to_fp32: bool) -> None:
    """Patch ``model`` (the instance TRL gave its fused LM head) so that ``model(..., losscodegen=(head,
    labels, inputs, n))`` runs the backbone and ``head.linear(..., **inputs)`` on the hidden states that
    predict the last ``n`` tokens; any other call goes to the forward it had."""
    inner = model.forward

    def forward(self, *args: Any, losscodegen: tuple | None = None, **kwargs: Any) -> Any:
        if losscodegen is None:
            return inner(*args, **kwargs)
        head, labels, inputs, n = losscodegen
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, -n - 1:-1]   # (TRL: [:, :-1], last n)
        lm_head = self.get_output_embeddings()
        hidden = hidden.to(lm_head.weight.device)
        autocast = contextlib.nullcontext()
        if cast_lm_head_to_fp32:   # TRL: the projection in fp32, outside autocast
            hidden = hidden.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        with autocast:
            out = head.linear(hidden, lm_head.weight, labels.to(hidden.device), bias=lm_head.bias, **inputs)
        return FusedObjectiveOutput(loss=out.loss, terms=out.terms, metrics=out.metrics, rows=out.rows)

    model.forward = types.MethodType(functools.wraps(type(model).forward)(forward), model)


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


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with the same constructor; ``_compute_loss`` is one ``head.linear`` call per
    micro-batch. Options it cannot fuse raise ``ValueError`` here, naming them."""

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:     # (refused before the model and datasets are built)
            _refuse(unfused_options(config))
        super().__init__(*args, **kwargs)
        _refuse(unfused_options(self.args, self.model))
        if self.top_entropy_quantile < 1.0 and self.accelerator.num_processes > 1:
            # (TRL's quantile is over every process's tokens; the head's over its call's rows)
            _refuse([f"top_entropy_quantile={self.top_entropy_quantile} on {self.accelerator.num_processes} "
                     "processes (TRL gathers every process's entropies for the quantile); fused on one"])
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_objective(target, self.args.cast_lm_head_to_fp32)
        self._lcg_heads: dict[tuple[bool, bool], tuple[lcg.HeadLoss, frozenset[str]]] = {}
        self._lcg_final_logits = final_logit_transform(self.model, self.temperature)
        # the ratio is a sequence's (GSPO), the loss weighs sequences (VESPO) or masks them (the off-policy
        # mask): one segment per completion
        self._lcg_segments = self.importance_sampling_level == "sequence" or self.loss_type == "vespo" \
            or self.off_policy_mask_threshold is not None

    def _lcg_params(self) -> dict[str, float]:
        """The head's parameters, from the config (each a kernel argument: no new kernel per value)."""
        a = self.args
        if self.loss_type == "cispo":   # (TRL's epsilon_high is CISPO's bound, terms.CISPO's 1 + eps_high)
            params = dict(eps_high=self.epsilon_high - 1.0)
        elif self.loss_type == "sapo":
            params = dict(temperature_pos=a.sapo_temperature_pos, temperature_neg=a.sapo_temperature_neg)
        elif self.loss_type == "vespo":   # (TRL clamps lambda at 1e-4)
            params = dict(k_pos=a.vespo_k_pos, lambda_pos=max(a.vespo_lambda_pos, 1e-4), k_neg=a.vespo_k_neg,
                          lambda_neg=max(a.vespo_lambda_neg, 1e-4))
        else:   # (delta: INTELLECT-2's bound on the ratio; none is an infinite one)
            params = dict(eps_low=self.epsilon_low, eps_high=self.epsilon_high,
                          delta=math.inf if a.delta is None else float(a.delta))
        if self.off_policy_mask_threshold is not None:
            params["off_policy_threshold"] = float(self.off_policy_mask_threshold)
        return params

    def _lcg_head(self, old_given: bool, sampling_given: bool) -> tuple[lcg.HeadLoss, frozenset[str]]:
        """The head for batches with (or without) old log-probs and sampling log-probs for the off-policy
        mask, and the per-token inputs it reads (a formula may drop one: without old log-probs the ratios
        are 1, and the clip ratios 0)."""
        entry = self._lcg_heads.get((old_given, sampling_given))
        if entry is None:
            softcap, scale = self._lcg_final_logits
            head = _head(loss_type=self.loss_type, sequence=self.importance_sampling_level == "sequence",
                         old_given=old_given, off_policy=self.off_policy_mask_threshold is not None,
                         sampling_given=sampling_given, beta=self.beta != 0.0,
                         bias_corrected=bool(self.args.use_bias_correction_kl), entropy=self._entropy_bonus_enabled,
                         params=self._lcg_params(), softcap=softcap, logit_scale=scale,
                         top_entropy_quantile=self.top_entropy_quantile)
            # (advantages and old/ref log-probs: any head takes them; other tokens: those its kernel reads)
            reads = frozenset(("advantages", "old_logprobs", "ref_logprobs", *head.kernel.SPEC.tokens))
            entry = self._lcg_heads[(old_given, sampling_given)] = (head, reads)
        return entry

    # ---- the loss ---------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        C = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        maskf = mask.float()
        B = completion_ids.size(0)
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        segments, sequence = self._lcg_segments, self.importance_sampling_level == "sequence"

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        if segments and advantages.size(1) != 1:
            raise ValueError(f"advantages of shape {tuple(inputs['advantages'].shape)} (one per token): losscodegen's "
                             "GRPOTrainer fuses them only with importance_sampling_level='token' and a loss_type other "
                             "than 'vespo' (here one advantage per sequence, shape [batch])")
        A = advantages.float().expand(B, C)
        # the per-token weight of the policy term: each loss_type's normalisation (TRL's, to the letter)
        if self.loss_type in ("grpo", "sapo"):
            w = maskf / mask.sum(-1, keepdim=True).clamp(min=1.0) / B / accumulation
        elif self.loss_type == "bnpo":
            w = maskf / mask.sum().clamp(min=1.0) / accumulation
        elif self.loss_type == "dr_grpo":
            w = maskf / (B * self.max_completion_length) / accumulation
        elif self.loss_type in ("dapo", "cispo", "vespo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            w = maskf / normalizer
        else:  # luspo
            w = maskf / B / accumulation
        n = mask.sum().float()
        n_seq = mask.sum(-1, keepdim=True).float()          # each completion's token count
        ratio = inputs.get("importance_sampling_ratio")     # vLLM's; VESPO reads it in its gamma weights
        w_pol = w * ratio if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo" \
            else w
        w_kl = self.beta * w
        if segments:   # a segment term's weights carry n_s: segment_mean(w * x) is the sum over the sequence
            w_pol, w_kl = w_pol * n_seq, w_kl * n_seq
        tokens = dict(advantages=A, w_pol=w_pol.expand(B, C), seq_len=n_seq.expand(B, C))
        old = inputs.get("old_per_token_logps")
        if old is not None:
            tokens["old_logprobs"] = old.float()
        if self.beta != 0.0:
            tokens.update(ref_logprobs=inputs["ref_per_token_logps"].float(), w_kl=w_kl.expand(B, C))
        if self.loss_type == "vespo":   # TRL: the clamped log-ratios of every position, summed per sequence
            log_is = torch.zeros_like(n_seq) if ratio is None else \
                torch.log(ratio.float()).clamp(math.log(1e-8), 20.0).sum(-1, keepdim=True)
            tokens["log_is"] = log_is.expand(B, C)
        # the off-policy mask's sampling log-probs: vLLM's, else the old ones (TRL's order)
        sampling = inputs.get("sampling_per_token_logps", old)
        if self.off_policy_mask_threshold is not None and sampling is not None:
            tokens.update(sampling_logprobs=torch.nan_to_num(sampling.float(), nan=0.0),
                          sampling_known=(~torch.isnan(sampling)).float())
        if self._entropy_bonus_enabled:
            if self.use_adaptive_entropy:
                coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            else:
                coef = self.entropy_coef
            tokens["w_ent"] = -coef * maskf / n.clamp(min=1.0) / accumulation
        head, reads = self._lcg_head(old is not None, "sampling_logprobs" in tokens)
        call = {k: v for k, v in tokens.items() if k in reads}
        if segments:   # the terms summed (segment terms over the completions), so that the weights are the loss
            call.update(reduction="sum", segment_ids=torch.arange(B, device=mask.device)[:, None].expand(B, C),
                        num_segments=B)
        else:          # every token's values: TRL's per-sequence clip ratios come from their rows
            call.update(reduction="none")
        labels = completion_ids.masked_fill(mask == 0, -100)
        with self.accelerator.autocast():   # (as TRL calls the model; head.linear follows autocast as F.linear)
            out = model(input_ids=input_ids, attention_mask=attention_mask, losscodegen=(head, labels, call, C))
        # (reduction="none": the per-token losses, and the terms' means over the completion tokens)
        loss = out.loss if segments else out.loss.sum()
        policy_total = out.terms["trl_policy"] if segments else out.terms["trl_policy"] * n

        # metrics, as TRL logs them: means over the completion tokens (or over the sequences) of every process

        def global_ratio(total, count):
            totals = self.accelerator.reduce(torch.stack([total, count]).float(), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self._entropy_bonus_enabled:
            # the policy loss without the bonus: TRL logs it before its division by the accumulation steps
            policy_loss = policy_total * (1.0 if self.loss_type in ("dapo", "cispo", "vespo") else accumulation)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                stats = torch.stack([out.metrics["entropy"] * n, n]).detach()
                self._entropy_window_stats = stats if self._entropy_window_stats is None \
                    else self._entropy_window_stats + stats
                if self.accelerator.sync_gradients:
                    window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                    world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                    step = self.args.entropy_coef_delta
                    if world_entropy <= self.args.entropy_target:
                        self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                    else:
                        self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                    self._last_world_entropy = world_entropy
                    self._entropy_window_stats = None
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        metrics = self._metrics[mode]
        if self.beta != 0.0:   # (a sum over the completions where the bias-corrected KL reads a sequence's ratio)
            kl = out.terms["kl"] if "kl" in out.terms else out.metrics["kl"] * n
            metrics["kl"].append(global_ratio(kl, n))
        metrics["entropy"].append(global_ratio(out.metrics["entropy"] * n, n))
        sequences = torch.tensor(float(B), device=n.device)
        if self.loss_type == "cispo":
            clipped = out.terms["cispo_clip"] if sequence else out.metrics["cispo_clip"] * n
            metrics["cispo_clip_ratio"].append(global_ratio(clipped, sequences if sequence else n))
        elif self.loss_type == "vespo":
            # phi's sum over the completions, those without a token too (TRL's log w is then their log IS sum)
            nonneg = A[:, 0] >= 0
            k = torch.where(nonneg, self.args.vespo_k_pos, self.args.vespo_k_neg)
            lam = torch.where(nonneg, self.args.vespo_lambda_pos, self.args.vespo_lambda_neg).clamp(min=1e-4)
            log_w = log_is[:, 0].clamp(math.log(1e-8), 20.0)
            phi_empty = torch.exp(_log_gamma(log_w, k, lam, torch.exp)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            phi = out.terms["vespo_phi"] + (phi_empty * (n_seq[:, 0] == 0)).sum()
            metrics["vespo/phi_seq_mean"].append(global_ratio(phi, sequences))
        elif self.loss_type != "sapo" and sequence:
            # each sequence is clipped or not: TRL's min and max over the sequences are 1 if all are / any is
            low, high, count = self.accelerator.reduce(
                torch.stack([out.terms["clip_low"], out.terms["clip_high"], sequences]), reduction="sum").tolist()
            metrics["clip_ratio/low_mean"].append(low / count)
            metrics["clip_ratio/high_mean"].append(high / count)
            metrics["clip_ratio/region_mean"].append((low + high) / count)
            metrics["clip_ratio/low_min"].append(float(low == count))
            metrics["clip_ratio/high_max"].append(float(high > 0))
        elif self.loss_type != "sapo":
            metrics["clip_ratio/low_mean"].append(global_ratio(out.metrics["clip_low"] * n, n))
            metrics["clip_ratio/high_mean"].append(global_ratio(out.metrics["clip_high"] * n, n))
            metrics["clip_ratio/region_mean"].append(global_ratio(out.metrics["clip_region"] * n, n))
            # per completion: the mean of its tokens' rows (NaN without tokens), then min / max over all
            per_seq = torch.stack([out.rows["clip_low"], out.rows["clip_high"]], -1).sum(1) / n_seq
            per_seq = self.accelerator.gather(per_seq)
            metrics["clip_ratio/low_min"].append(nanmin(per_seq[:, 0]).item())
            metrics["clip_ratio/high_max"].append(nanmax(per_seq[:, 1]).item())
        return loss


class SFTTrainer(trl.SFTTrainer):
    """``trl.SFTTrainer`` with the same constructor, on losscodegen's fused LM head. A model patched by
    ``apply_losscodegen`` trains on its head's objective (CE + z-loss, ...: TRL's own trainer refuses such
    a model, whose head its loss would drop); any other model on TRL's loss, cross-entropy. SFT's loss
    is ``-sum(log_probs) / num_items_in_batch`` over the fused outputs: the fused head gives each token's
    objective as ``-log_probs``, and TRL's ``compute_loss`` (its metrics, the router loss of a
    mixture-of-experts model, its scaling across processes) runs unchanged. With an objective other than
    cross-entropy, options whose loss does not come from the fused outputs are refused at construction.

    On a patched model the head's terms and metrics are logged (``log_history`` and every ``report_to``)
    as ``LosscodegenCallback`` logs them: per-token means over the tokens since the last log (with
    ``logging_steps=1`` the accumulated batch), and over the evaluation set for ``evaluate()``; a name TRL
    logs too (``entropy``) takes the head's per-token mean."""

    def __init__(self, *args: Any, **kwargs: Any):
        with fusing_objective():
            super().__init__(*args, **kwargs)
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        state = self._lcg_state = vars(target).get("losscodegen")
        objective = None if state is None else state.head
        if objective is not None and not computes_trls_fused_loss(objective):
            refused = [f"loss_type={self.args.loss_type!r} (only 'nll' is -sum(log_probs))"] \
                if self.args.loss_type != "nll" else []
            if self.args.label_smoothing_factor:
                refused.append(f"label_smoothing_factor={self.args.label_smoothing_factor} (a loss from the full "
                               "logits: use CrossEntropy(label_smoothing=...) in the head)")
            if self.compute_loss_func is not None:
                refused.append("compute_loss_func (a loss from the full logits)")
            if refused:
                raise ValueError("losscodegen's SFTTrainer cannot train on the model's head "
                                 f"({', '.join(t.name for t in objective.loss_terms)}) with " + "; ".join(refused))
        found = trl_fused_head_of(target)
        if found is None:
            raise ValueError(f"{type(target).__name__} has no TRL fused LM head after trl.SFTTrainer's constructor: "
                             "this TRL is not one losscodegen was checked against")
        target.forward = found.pop("original_forward")     # TRL's patch undone, then ours
        add_fused_lm_head(target, **found, objective=objective)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._lcg_state is not None:
            values = self._lcg_state.take_for(logs)
            mode = "train" if self.model.training else "eval"
            # TRL's metric of a name the head logs (a mean of its micro-batches' means) gives way
            prefix = "" if mode == "train" else "eval_"
            for name in [k for k in self._metrics[mode] if prefix + k in values]:
                del self._metrics[mode][name]
            logs.update(values)
        super().log(logs, start_time)


# What TRL's DPO and KTO trainers log of the responses' tokens: each response's mean logit over the
# vocabulary, and the chosen responses' top-1 accuracy (means over the valid rows, times their number: sums)
_CHOSEN = S.token("chosen")
_MEAN_LOGIT = S.vsum(S.logit) / S.vocab_size
_RESPONSE_TOKEN_METRICS = (
    lcg.declare_term("mean_logits_chosen", _CHOSEN * _MEAN_LOGIT, metric_only=True),
    lcg.declare_term("mean_logits_rejected", (1 - _CHOSEN) * _MEAN_LOGIT, metric_only=True),
    lcg.declare_term("token_accuracy_chosen", _CHOSEN * S.Piecewise((1, sp.Eq(S.argmax, S.label)), (0, True)),
                     metric_only=True),
)


def _global_mean(gather: Any, total: torch.Tensor, count: torch.Tensor) -> float | None:
    """``total / count`` summed over the processes (``gather``: the accelerator's), None where the count is 0."""
    totals = gather(torch.stack([total, count]).float()[None]).reshape(-1, 2).sum(0)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else None


def _empty_sequences(trainer: str, what: str) -> ValueError:
    return ValueError(f"losscodegen's {trainer}: {what} has no completion token (truncated by max_length?): TRL "
                      "counts it as a constant in its mean, the fused segment terms cannot; raise max_length or drop "
                      "such examples")


def unfused_dpo_options(args: Any, model: Any = None) -> list[str]:
    """The options of a ``DPOConfig`` (and model) that ``DPOTrainer`` cannot fuse, each with why."""
    loss_types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
    out = [f"loss_type={t!r} (fused: {', '.join(P.DPO_LOSS_TYPES)})" for t in loss_types if t not in P.DPO_LOSS_TYPES]
    if args.ld_alpha is not None:
        out.append(f"ld_alpha={args.ld_alpha} (LD-DPO weighs the tokens past the shorter response's length)")
    return out + (_router_loss(args, model) if model is not None else [])


class DPOTrainer(trl.DPOTrainer):
    """``trl.DPOTrainer`` with the same constructor; the loss is one ``head.linear`` call on the policy's
    hidden states and output layer (no ``[2B, T, V]`` logits), whose terms are ``preference.DPO`` of each
    of TRL's ``loss_type`` (its ``loss_weights`` their weights) and whose segment terms of weight 0 and
    metrics are what TRL logs. The reference log-probs are TRL's (precomputed, or its reference model's
    or the PEFT model's without its adapter through TRL's fused head, without a gradient). Options it
    cannot fuse (``unfused_dpo_options``, a vision dataset) raise ``ValueError`` here, naming them."""

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:     # (refused before the model and datasets are built)
            _refuse(unfused_dpo_options(config), "DPOTrainer")
        super().__init__(*args, **kwargs)
        refused = unfused_dpo_options(self.args, self.model)
        if self._is_vision_dataset:
            refused.append("a vision dataset (the images' inputs are not checked through the fused forward)")
        _refuse(refused, "DPOTrainer")
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        softcap, scale = final_logit_transform(target)
        losses = [P.DPO(loss_type=t, beta=self.beta, label_smoothing=self.label_smoothing,
                        f_divergence_type=self.f_divergence_type, f_alpha_divergence_coef=self.f_alpha_divergence_coef,
                        discopop_tau=self.args.discopop_tau, use_weighting=self.use_weighting, weight=float(w))
                  for t, w in zip(self.loss_types, self.loss_weights, strict=True)]
        self._lcg_head = lcg.HeadLoss(*losses, *P.pair_statistics(),
                                      metrics=(lcg.Entropy(), *(m() for m in _RESPONSE_TOKEN_METRICS)),
                                      softcap=softcap, logit_scale=scale)
        add_fused_objective(target, cast_lm_head_to_fp32=False)

    def _compute_loss(self, model, inputs, return_outputs):
        if return_outputs:   # (the caller wants logits: TRL's own, which recomputes them)
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)[:, 1:]
        valid = labels != -100
        B = labels.shape[0] // 2
        tokens = valid.sum(1)
        # TRL averages over every pair, one whose responses have no completion token too (a constant of
        # the loss); the head's pair terms average over the pairs with a token: refused rather than off
        if bool(((tokens[:B] + tokens[B:]) == 0).any()):
            raise _empty_sequences("DPOTrainer", "a pair (both its responses)")
        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:   # TRL's reference forward (its fused head, no gradient; a PEFT model without its adapter)
            ref_chosen, ref_rejected = self.compute_ref_log_probs(
                self.ref_model if self.ref_model is not None else self.model, inputs)
        head = self._lcg_head
        call = P.pair_inputs(head, labels, ref_chosen_logps=ref_chosen.float(), ref_rejected_logps=ref_rejected.float())
        model_kwargs = {k: v for k, v in inputs.items()
                        if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")}
        out = model(**model_kwargs, losscodegen=(head, labels, call, labels.shape[1]))

        # the metrics TRL logs, in its order: token means over every process's tokens, pair means over its pairs
        metrics, acc = self._metrics[mode], self.accelerator

        def ratio(gather, total, count):
            mean = _global_mean(gather, total, count)
            return 0.0 if mean is None else mean

        n, n_chosen, n_rejected = valid.sum(), valid[:B].sum(), valid[B:].sum()
        metrics["entropy"].append(ratio(acc.gather_for_metrics, out.metrics["entropy"] * n, n))
        if mode == "train":
            num_tokens_in_batch = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens_in_batch // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["logits/chosen"].append(ratio(acc.gather_for_metrics, out.metrics["mean_logits_chosen"] * n, n_chosen))
        metrics["logits/rejected"].append(
            ratio(acc.gather_for_metrics, out.metrics["mean_logits_rejected"] * n, n_rejected))
        metrics["mean_token_accuracy"].append(
            ratio(acc.gather_for_metrics, out.metrics["token_accuracy_chosen"] * n, n_chosen))
        pairs = torch.tensor(float(B), device=n.device)   # (the pair terms are means over the B pairs)
        chosen, rejected = self.beta * out.terms["logratio_chosen"], self.beta * out.terms["logratio_rejected"]
        for name, value in (("rewards/chosen", chosen), ("rewards/rejected", rejected),
                            ("rewards/accuracies", out.terms["reward_accuracy"]),
                            ("rewards/margins", chosen - rejected),
                            ("logps/chosen", out.terms["logps_chosen"]),
                            ("logps/rejected", out.terms["logps_rejected"])):
            metrics[name].append(ratio(acc.gather, value * pairs, pairs))
        return out.loss


# TRL's KTOTrainer batch keys that are not the model's
_KTO_NOT_MODEL_KEYS = ("completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask",
                       "KL_token_type_ids", "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps")


class KTOTrainer(trl.KTOTrainer):
    """``trl.KTOTrainer`` with the same constructor; the loss is one ``head.linear`` call on the policy's
    hidden states and output layer, ``preference.KTO`` (each sequence a segment) with TRL's batch KL estimate
    as its ``kl`` (a 0-dim tensor filled at each call), and ``sequence_statistics`` and token metrics for what
    TRL logs. The KL estimate's forwards (the mismatched completions, without a gradient) and the reference
    log-probs are TRL's own. Refused at construction: a mixture-of-experts load-balancing loss, a vision
    dataset."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        refused = _router_loss(self.args, self.model)
        if self._is_vision_dataset:
            refused.append("a vision dataset (the images' inputs are not checked through the fused forward)")
        _refuse(refused, "KTOTrainer")
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        softcap, scale = final_logit_transform(target)
        self._lcg_kl = torch.zeros((), device=self.accelerator.device)
        loss = P.KTO(loss_type=self.loss_type, beta=self.beta, kl=self._lcg_kl, desirable_weight=self.desirable_weight,
                     undesirable_weight=self.undesirable_weight)
        self._lcg_head = lcg.HeadLoss(loss, *P.sequence_statistics(),
                                      metrics=(lcg.Entropy(), *(m() for m in _RESPONSE_TOKEN_METRICS[:2])),
                                      softcap=softcap, logit_scale=scale)
        add_fused_objective(target, cast_lm_head_to_fp32=False)

    def _compute_loss(self, model, inputs, return_outputs):
        if return_outputs:   # (the caller wants logits: TRL's own, which recomputes them)
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        acc = self.accelerator
        batch = {k: (v.to(acc.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[:, 1:]
        valid = labels != -100
        if bool((valid.sum(1) == 0).any()):
            raise _empty_sequences("KTOTrainer", "a completion")
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=labels.device)
        KL_logps = self._compute_kl_logps(model, batch)
        if self.precompute_ref_logps:
            ref_logps, ref_KL_logps = batch["ref_logps"], batch.get("ref_KL_logps")
        else:   # TRL's reference forwards (its fused head, no gradient; a PEFT model without its adapter)
            ref_logps, ref_KL_logps = self.compute_ref_log_probs(
                self.ref_model if self.ref_model is not None else self.model, batch)
        if self.calculate_KL:   # TRL's estimate: the batch mean over the processes, detached, at least 0
            kl = acc.gather_for_metrics((KL_logps - ref_KL_logps).mean().detach()).mean().clamp(min=0)
        else:
            kl = torch.zeros((), device=labels.device)
        self._lcg_kl.copy_(kl.reshape(()))
        head = self._lcg_head
        call = P.sequence_inputs(head, labels, desirable=desirable, ref_logps=ref_logps.float())
        model_kwargs = {k: v for k, v in batch.items() if k not in _KTO_NOT_MODEL_KEYS}
        out = model(**model_kwargs, losscodegen=(head, labels, call, labels.shape[1]))

        # the metrics TRL logs, in its order
        metrics = self._metrics[mode]
        metrics["kl"].append(kl.item())
        n = valid.sum()
        entropy = _global_mean(acc.gather_for_metrics, out.metrics["entropy"] * n, n)
        metrics["entropy"].append(0.0 if entropy is None else entropy)
        if mode == "train":
            num_tokens_in_batch = acc.gather_for_metrics(batch["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens_in_batch // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            mean = _global_mean(acc.gather_for_metrics, out.metrics[f"mean_logits_{side}"] * n, valid[rows].sum())
            if mean is not None:
                metrics[f"logits/{side}"].append(mean)
        sequences = torch.tensor(float(labels.shape[0]), device=n.device)   # (the terms are means over them)
        rewards = {}
        for side, name, rows in (("chosen", "desirable", desirable), ("rejected", "undesirable", ~desirable)):
            count = rows.sum()
            mean = _global_mean(acc.gather_for_metrics, self.beta * out.terms[f"logratio_{name}"] * sequences, count)
            if mean is not None:   # (some process has such sequences)
                rewards[side] = mean
                metrics[f"rewards/{side}"].append(mean)
                metrics[f"logps/{side}"].append(
                    _global_mean(acc.gather_for_metrics, out.terms[f"logps_{name}"] * sequences, count))
        if len(rewards) == 2:
            metrics["rewards/margins"].append(rewards["chosen"] - rewards["rejected"])
        return out.loss
