"""TRL: ``GRPOTrainer``, a subclass of ``trl.GRPOTrainer`` (same constructor) whose ``_compute_loss``
computes TRL's whole objective (policy term, KL penalty, entropy bonus) in one ``head.linear`` call per
micro-batch, and logs TRL's metric names (docs/integrations-trl.md).

TRL 1.16's ``_compute_loss`` gets per-token log-probs and entropies from its chunked fused LM head,
then builds each ``loss_type`` in torch. Here every part of that is one per-token formula, declared
from TRL's code, with each ``loss_type``'s normalisation (and the vLLM importance-sampling ratios, the
KL's beta, the entropy bonus's coefficient) folded into per-token weights: the head's mean over the
completion tokens, times their count, is the loss. Options whose terms depend on the current pass in
ways one per-token formula cannot hold are refused at construction, by name (``unfused_options``).
"""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch

import losscodegen as lcg
from losscodegen import symbols as S

try:
    import trl
    from transformers.modeling_outputs import ModelOutput
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["GRPOTrainer", "FUSED_LOSS_TYPES", "unfused_options"]

FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")


def _refuse(options: list[str]) -> None:
    if options:
        raise ValueError("losscodegen's GRPOTrainer cannot fuse " + "; ".join(options)
                         + ": use trl.GRPOTrainer for these")


def unfused_options(args: Any, model: Any = None) -> list[str]:
    """The options of a ``GRPOConfig`` (and model) that ``GRPOTrainer`` cannot fuse, each with why."""
    out = []
    if args.loss_type not in FUSED_LOSS_TYPES:
        out.append(f"loss_type={args.loss_type!r} (fused: {', '.join(FUSED_LOSS_TYPES)})")
    if args.importance_sampling_level != "token":
        out.append(f"importance_sampling_level={args.importance_sampling_level!r} (fused: 'token')")
    if args.top_entropy_quantile < 1.0:
        out.append(f"top_entropy_quantile={args.top_entropy_quantile} (a quantile of the current pass's "
                   "entropies masks the loss)")
    if args.off_policy_mask_threshold is not None:
        out.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold} (a sequence mask from the "
                   "current pass's log-probs)")
    if model is not None:
        text_config = model.config.get_text_config()
        coef = args.router_aux_loss_coef
        coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
        if hasattr(text_config, "output_router_logits") and coef != 0.0:
            out.append(f"router_aux_loss_coef={coef} (a mixture-of-experts load-balancing loss)")
    return out


def _final_logits(model: Any, temperature: float) -> tuple[float | None, float]:
    """(softcap, logit_scale) of the head for TRL's transform ``softcap(logits * scale) / T``, read from the
    config as ``trl.trainer.utils.add_fused_lm_head`` reads it; ours is ``scale' * c' tanh(x / c')``."""
    text_config = model.config.get_text_config()
    cap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    scale = 1.0 if scale is None else float(scale)
    # c * tanh(s x / c) / T  =  (s / T) * (c / s) * tanh(x / (c / s))
    return (None if cap is None else float(cap) / scale), scale / temperature


def _head(*, loss_type: str, old_given: bool, delta: float | None, beta: bool, bias_corrected: bool,
          entropy: bool, eps_low: float, eps_high: float, softcap: float | None, logit_scale: float) -> lcg.HeadLoss:
    """TRL's per-token objective, declared from its ``_compute_loss``: the term ``trl_policy`` is
    ``w_pol * policy + w_kl * kl`` and ``trl_entropy_bonus`` is ``w_ent * entropy``, their weights
    per-token inputs (the loss_type's normalisation, beta, vLLM's ratios, the entropy coefficient);
    the metrics are TRL's, as means over the completion tokens."""
    l = S.target_logit - S.lse                         # per_token_logps (at the head's temperature)
    old = S.token("old_logprobs") if old_given else S.stop_gradient(l)   # TRL: per_token_logps.detach()
    r = S.exp(l - old)                                 # coef_1
    A = S.token("advantages")
    lo, hi = 1 - S.param("eps_low"), 1 + S.param("eps_high")
    params = dict(eps_low=eps_low, eps_high=eps_high)
    metrics = [lcg.Entropy()]
    if loss_type == "cispo":
        # -clamp(coef_1, max=epsilon_high).detach() * A * logp; epsilon_high is the bound itself
        policy = -S.stop_gradient(S.Min(r, S.param("eps_high"))) * A * l
        clipped = S.Piecewise((1, r > S.param("eps_high")), (0, True)) * S.token("positive")
        metrics.append(lcg.declare_term("cispo_clip", clipped, defaults=params, metric_only=True)())
    elif loss_type == "sapo":
        # -sigmoid(tau * (coef_1 - 1)) * 4 / tau * A, tau = sapo_temperature_pos if A > 0 else _neg
        tau = S.token("tau")
        policy = -4 / tau / (1 + S.exp(-tau * (r - 1))) * A
    else:
        r1 = r if delta is None else S.Min(r, S.param("delta"))   # two-sided clipping: clamp(coef_1, max=delta)
        policy = -S.Min(r1 * A, S.Min(S.Max(r, lo), hi) * A)      # coef_2 = clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            params["delta"] = float(delta)
        # TRL's clip ratios, on coef_1 after delta's clamp: low where A < 0, high where A > 0
        below = S.Piecewise((1, r1 < lo), (0, True)) * S.token("negative")
        above = S.Piecewise((1, r1 > hi), (0, True)) * S.token("positive")
        metrics += [lcg.declare_term("clip_low", below, defaults=params, metric_only=True)(),
                    lcg.declare_term("clip_high", above, defaults=params, metric_only=True)(),
                    lcg.declare_term("clip_region", below + above, defaults=params, metric_only=True)()]
    d = S.token("ref_logprobs") - l
    kl = (S.exp(d) - d - 1) * (r if bias_corrected else 1)    # per_token_kl (use_bias_correction_kl: * coef_1)
    terms = [lcg.declare_term("trl_policy", S.token("w_pol") * policy + (S.token("w_kl") * kl if beta else 0),
                              defaults=params)()]
    if entropy:
        terms.append(lcg.declare_term("trl_entropy_bonus", S.token("w_ent") * -S.vsum(S.softmax * S.logsoftmax))())
    if beta:
        metrics.append(lcg.declare_term("kl", kl, defaults=params, metric_only=True)())
    return lcg.HeadLoss(*terms, metrics=tuple(metrics), softcap=softcap, logit_scale=logit_scale)


@dataclass
class FusedObjectiveOutput(ModelOutput):
    """What the patched forward returns for ``losscodegen=(head, labels, tokens, n)``: the head's
    ``HeadOutput`` fields."""

    loss: torch.Tensor | None = None
    terms: dict | None = None
    metrics: dict | None = None


def _add_fused_objective(model: Any, cast_lm_head_to_fp32: bool) -> None:
    """Patch ``model`` (the instance TRL gave its fused LM head) so that ``model(..., losscodegen=(head,
    labels, tokens, n))`` runs the backbone and ``head.linear`` on the hidden states that predict the
    last ``n`` tokens; any other call goes to the forward it had."""
    inner = model.forward

    def forward(self, *args: Any, losscodegen: tuple | None = None, **kwargs: Any) -> Any:
        if losscodegen is None:
            return inner(*args, **kwargs)
        head, labels, tokens, n = losscodegen
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, -n - 1:-1]   # (TRL: [:, :-1], last n)
        lm_head = self.get_output_embeddings()
        hidden = hidden.to(lm_head.weight.device)
        autocast = contextlib.nullcontext()
        if cast_lm_head_to_fp32:   # TRL: the projection in fp32, outside autocast
            hidden = hidden.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        with autocast:
            out = head.linear(hidden, lm_head.weight, labels.to(hidden.device), bias=lm_head.bias, **tokens)
        return FusedObjectiveOutput(loss=out.loss, terms=out.terms, metrics=out.metrics)

    model.forward = types.MethodType(functools.wraps(type(model).forward)(forward), model)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with the same constructor; ``_compute_loss`` is one ``head.linear`` call per
    micro-batch. Options it cannot fuse raise ``ValueError`` here, naming them."""

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:     # (refused before the model and datasets are built)
            _refuse(unfused_options(config))
        super().__init__(*args, **kwargs)
        _refuse(unfused_options(self.args, self.model))
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        _add_fused_objective(target, self.args.cast_lm_head_to_fp32)
        self._lcg_heads: dict[bool, tuple[lcg.HeadLoss, frozenset[str]]] = {}
        self._lcg_final_logits = _final_logits(self.model, self.temperature)

    def _lcg_head(self, old_given: bool) -> tuple[lcg.HeadLoss, frozenset[str]]:
        """The head for batches with (or without) old log-probs, and the per-token inputs it reads (a
        formula may drop one: without old log-probs the ratios are 1, and the clip ratios 0)."""
        entry = self._lcg_heads.get(old_given)
        if entry is None:
            softcap, scale = self._lcg_final_logits
            head = _head(loss_type=self.loss_type, old_given=old_given, delta=self.args.delta, beta=self.beta != 0.0,
                         bias_corrected=bool(self.args.use_bias_correction_kl), entropy=self._entropy_bonus_enabled,
                         eps_low=self.epsilon_low, eps_high=self.epsilon_high, softcap=softcap, logit_scale=scale)
            # (advantages and old/ref log-probs: any head takes them; other tokens: those its kernel reads)
            reads = frozenset(("advantages", "old_logprobs", "ref_logprobs", *head.kernel.TOKENS))
            entry = self._lcg_heads[old_given] = (head, reads)
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

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        A = advantages.float().expand(B, C)
        # the per-token weight of the policy term: each loss_type's normalisation (TRL's, to the letter)
        if self.loss_type in ("grpo", "sapo"):
            w = maskf / mask.sum(-1, keepdim=True).clamp(min=1.0) / B / accumulation
        elif self.loss_type == "bnpo":
            w = maskf / mask.sum().clamp(min=1.0) / accumulation
        elif self.loss_type == "dr_grpo":
            w = maskf / (B * self.max_completion_length) / accumulation
        elif self.loss_type in ("dapo", "cispo"):
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            w = maskf / normalizer
        else:  # luspo
            w = maskf / B / accumulation
        # The head divides by the count of completion tokens (its valid rows) and reports its metrics as
        # means over them: the weights carry that count back.
        n = mask.sum().float()
        w = w * n
        w_pol = w
        if self.use_vllm and self.vllm_importance_sampling_correction:
            w_pol = w * inputs["importance_sampling_ratio"]
        tokens = dict(advantages=A, w_pol=w_pol.expand(B, C), negative=(A < 0).float(), positive=(A > 0).float(),
                      tau=torch.where(A > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg))
        old = inputs.get("old_per_token_logps")
        if old is not None:
            tokens["old_logprobs"] = old.float()
        if self.beta != 0.0:
            tokens.update(ref_logprobs=inputs["ref_per_token_logps"].float(), w_kl=self.beta * w)
        if self._entropy_bonus_enabled:
            if self.use_adaptive_entropy:
                coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            else:
                coef = self.entropy_coef
            tokens["w_ent"] = -coef * maskf * n / n.clamp(min=1.0) / accumulation
        head, reads = self._lcg_head(old is not None)
        tokens = {k: v for k, v in tokens.items() if k in reads}
        labels = completion_ids.masked_fill(mask == 0, -100)
        with self.accelerator.autocast():   # (as TRL calls the model; head.linear follows autocast as F.linear)
            out = model(input_ids=input_ids, attention_mask=attention_mask, losscodegen=(head, labels, tokens, C))
        loss = out.loss

        # metrics, as TRL logs them (global means over the completion tokens of every process)

        def global_mean(value):
            totals = self.accelerator.reduce(torch.stack([value * n, n]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self._entropy_bonus_enabled:
            # the policy loss without the bonus: TRL logs it before its division by the accumulation steps
            policy_loss = out.terms["trl_policy"] * (1.0 if self.loss_type in ("dapo", "cispo") else accumulation)
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
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_mean(out.metrics["kl"]))
        self._metrics[mode]["entropy"].append(global_mean(out.metrics["entropy"]))
        if self.loss_type == "cispo":
            self._metrics[mode]["cispo_clip_ratio"].append(global_mean(out.metrics["cispo_clip"]))
        elif self.loss_type != "sapo":
            self._metrics[mode]["clip_ratio/low_mean"].append(global_mean(out.metrics["clip_low"]))
            self._metrics[mode]["clip_ratio/high_mean"].append(global_mean(out.metrics["clip_high"]))
            self._metrics[mode]["clip_ratio/region_mean"].append(global_mean(out.metrics["clip_region"]))
        return loss
