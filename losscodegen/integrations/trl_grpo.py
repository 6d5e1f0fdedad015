"""TRL's GRPO trainer on one fused head call: ``GRPOTrainer``, a subclass of ``trl.GRPOTrainer`` (same
constructor), whose ``_compute_loss`` computes TRL's whole objective (policy term, KL penalty, entropy bonus)
in one ``head.linear`` call per micro-batch, and logs TRL's metric names (docs/integrations-trl.md).

TRL 1.16's ``_compute_loss`` gets per-token log-probs and entropies from its chunked fused LM head, then
builds each ``loss_type`` in torch. Here every part of that is a formula declared from TRL's code
(``trl_losses.grpo_head``), per token, or per completion as a segment term where TRL reads a sequence's
quantity (GSPO's ratio, VESPO's weight, the off-policy mask), with each ``loss_type``'s normalisation (and
the vLLM importance-sampling ratios, the KL's beta, the entropy bonus's coefficient) folded into per-token
weights: the head's sum is the loss. Options that one call cannot hold are refused at construction, by
name (``unfused_options``).
"""
from __future__ import annotations

import math
from typing import Any

import torch

import losscodegen as lcg
from losscodegen.integrations.trl_base import (add_fused_objective, global_mean, policy_model, refuse_unfused,
                                               router_loss_options)
from losscodegen.integrations.trl_lm_head import final_logit_transform
from losscodegen.integrations.trl_losses import grpo_head, log_gamma

try:
    import trl
    from trl.trainer.utils import nanmax, nanmin
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["GRPOTrainer", "FUSED_LOSS_TYPES", "FUSED_IMPORTANCE_SAMPLING_LEVELS", "unfused_options"]

FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
FUSED_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# the loss types whose clip ratios TRL logs per sequence at the token level (a min and a max over sequences)
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


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
    return out + (router_loss_options(args, model) if model is not None else [])


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with the same constructor; ``_compute_loss`` is one ``head.linear`` call per
    micro-batch. Options it cannot fuse raise ``ValueError`` here, naming them."""

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:     # (refused before the model and datasets are built)
            refuse_unfused(unfused_options(config), "GRPOTrainer")
        super().__init__(*args, **kwargs)
        refuse_unfused(unfused_options(self.args, self.model), "GRPOTrainer")
        if self.top_entropy_quantile < 1.0 and self.accelerator.num_processes > 1:
            # (TRL's quantile is over every process's tokens; the head's over its call's rows)
            refuse_unfused([f"top_entropy_quantile={self.top_entropy_quantile} on {self.accelerator.num_processes} "
                     "processes (TRL gathers every process's entropies for the quantile); fused on one"], "GRPOTrainer")
        target = policy_model(self.model)
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
            head = grpo_head(loss_type=self.loss_type, sequence=self.importance_sampling_level == "sequence",
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

        def global_ratio(total: torch.Tensor, count: torch.Tensor) -> float:
            return global_mean(self.accelerator.gather, total, count, empty=0.0)

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
            phi_empty = torch.exp(log_gamma(log_w, k, lam, torch.exp)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
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
