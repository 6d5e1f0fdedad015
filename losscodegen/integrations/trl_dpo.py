"""TRL's DPO trainer on one fused head call: ``DPOTrainer``, a subclass of ``trl.DPOTrainer`` (same
constructor), whose loss is ``preference.DPO`` of each of TRL's ``loss_type`` in one ``head.linear`` call on
the policy's hidden states and output layer."""
from __future__ import annotations

from typing import Any

import torch

import losscodegen as lcg
from losscodegen import preference as P
from losscodegen.integrations.trl_base import (add_fused_objective, empty_sequences_error, fused_policy, global_mean,
                                               refuse_unfused, router_loss_options)
from losscodegen.integrations.trl_losses import RESPONSE_TOKEN_METRICS

try:
    import trl
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["DPOTrainer", "unfused_dpo_options"]

def unfused_dpo_options(args: Any, model: Any = None) -> list[str]:
    """The options of a ``DPOConfig`` (and model) that ``DPOTrainer`` cannot fuse, each with why."""
    loss_types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
    out = [f"loss_type={t!r} (fused: {', '.join(P.DPO_LOSS_TYPES)})" for t in loss_types if t not in P.DPO_LOSS_TYPES]
    if args.ld_alpha is not None:
        out.append(f"ld_alpha={args.ld_alpha} (LD-DPO weighs the tokens past the shorter response's length)")
    return out + (router_loss_options(args, model) if model is not None else [])


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
            refuse_unfused(unfused_dpo_options(config), "DPOTrainer")
        super().__init__(*args, **kwargs)
        refused = unfused_dpo_options(self.args, self.model)
        target, softcap, scale = fused_policy(self, "DPOTrainer", refused)
        losses = [P.DPO(loss_type=t, beta=self.beta, label_smoothing=self.label_smoothing,
                        f_divergence_type=self.f_divergence_type, f_alpha_divergence_coef=self.f_alpha_divergence_coef,
                        discopop_tau=self.args.discopop_tau, use_weighting=self.use_weighting, weight=float(w))
                  for t, w in zip(self.loss_types, self.loss_weights, strict=True)]
        self._lcg_head = lcg.HeadLoss(*losses, *P.pair_statistics(),
                                      metrics=(lcg.Entropy(), *(m() for m in RESPONSE_TOKEN_METRICS)),
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
            raise empty_sequences_error("DPOTrainer", "a pair (both its responses)")
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

        def ratio(gather: Any, total: torch.Tensor, count: torch.Tensor) -> float:
            return global_mean(gather, total, count, empty=0.0)

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
