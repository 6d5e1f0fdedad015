"""TRL's CPO trainer on one fused head call: ``CPOTrainer``, a subclass of
``trl.experimental.cpo.CPOTrainer`` (same constructor), whose ``get_batch_loss_metrics`` computes TRL's
CPO loss (``cpo_loss`` of its ``loss_type`` averaged over the pairs, plus ``cpo_alpha`` times the chosen
responses' NLL) and the metrics TRL logs in one ``head.linear`` call on the policy's hidden states and
output layer: no ``[2B, T, V]`` logits. (A module of its own: importing ``trl.experimental`` warns.)
Its pair forward (``fused_pair_forward``) is ``trl_base``'s, shared with ``trl_orpo.ORPOTrainer``."""
from __future__ import annotations

from typing import Any

import torch

import losscodegen as lcg
from losscodegen import preference as P
from losscodegen.integrations.trl_base import fused_pair_forward, fused_pair_trainer, global_mean

try:
    from trl.experimental.cpo import CPOTrainer as _TRLCPOTrainer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl_cpo needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["CPOTrainer"]


class CPOTrainer(_TRLCPOTrainer):
    """``trl.experimental.cpo.CPOTrainer`` with the same constructor; the loss is ``preference.CPO`` of the
    config's ``loss_type`` (``beta``, ``label_smoothing``, ``simpo_gamma``, AlphaPO's ``alpha``) plus
    ``ChosenNLL(weight=cpo_alpha)``, one pair a segment, and ``cpo_statistics`` give the logged rewards
    and log-probs. TRL's ``logits/chosen`` / ``logits/rejected`` are means of the full logits, every
    position (prompt and padding too) and every class (``fused_pair_forward``). Refused at construction:
    an encoder-decoder model, a softcapped model (its mean logit is not linear), a mixture-of-experts
    load-balancing loss."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._lcg_target, self._lcg_scale = fused_pair_trainer(self, "CPOTrainer", [])
        options = dict(loss_type=self.loss_type, alpha=float(self.alpha))
        self._lcg_head = lcg.HeadLoss(
            P.CPO(beta=self.beta, label_smoothing=self.label_smoothing,
                  simpo_gamma=getattr(self, "simpo_gamma", 0.5), **options),
            P.ChosenNLL(weight=float(self.cpo_alpha)), *P.cpo_statistics(**options), logit_scale=self._lcg_scale)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        acc = self.accelerator
        cat = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.pad_token_id,
                                       device=acc.device)
        B = batch["chosen_labels"].shape[0]
        labels = cat["concatenated_labels"][:, 1:]
        tokens = (labels != -100).sum(1)
        if bool(((tokens[:B] + tokens[B:]) == 0).any()):
            raise ValueError("losscodegen's CPOTrainer: a pair (both its responses) has no completion token "
                             "(truncated by max_length?): TRL counts it in its mean, the fused pair terms cannot; "
                             "raise max_length or drop such examples")
        head = self._lcg_head
        out, mean_logit = fused_pair_forward(model, self._lcg_target, self._lcg_scale, cat, head, labels,
                                             P.pair_inputs(head, labels))

        def mean(total: torch.Tensor, count: float) -> float:
            return global_mean(acc.gather_for_metrics, total, count)

        prefix = "eval_" if train_eval == "eval" else ""
        chosen, rejected = self.beta * out.terms["reward_chosen"] * B, self.beta * out.terms["reward_rejected"] * B
        metrics = {
            "rewards/chosen": mean(chosen, B), "rewards/rejected": mean(rejected, B),
            "rewards/accuracies": mean(out.terms["reward_accuracy"] * B, B),
            "rewards/margins": mean(chosen - rejected, B),
            "logps/rejected": mean(out.terms["logps_rejected"] * B, B),
            "logps/chosen": mean(out.terms["logps_chosen"] * B, B),
            # (TRL: each process's mean over its logits, then the mean over the processes)
            "logits/rejected": mean(mean_logit[B:].mean(), 1), "logits/chosen": mean(mean_logit[:B].mean(), 1),
            "nll_loss": mean(out.terms["chosen_nll"] if self.cpo_alpha != 0 else out.loss.new_zeros(()), 1),
        }
        return out.loss, {prefix + k: v for k, v in metrics.items()}
