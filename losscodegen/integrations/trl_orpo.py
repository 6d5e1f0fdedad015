"""TRL's ORPO trainer on one fused head call: ``ORPOTrainer``, a subclass of
``trl.experimental.orpo.ORPOTrainer`` (same constructor), whose ``get_batch_loss_metrics`` computes TRL's
ORPO loss (the chosen responses' NLL minus ``odds_ratio_loss`` averaged over the pairs) and the metrics
TRL logs in one ``head.linear`` call on the policy's hidden states and output layer: no ``[2B, T, V]``
logits. (A module of its own: importing ``trl.experimental`` warns.)

TRL's two parts read different tokens: its NLL every token of the chosen sequences (prompt and response),
its odds ratio each response's average log-probability over the response's tokens. The head's rows are
every token (the NLL's); ``preference.ORPO`` and ``orpo_statistics`` are formulas of a pair's segment
sums (``segment_sum``: the segment's row count times ``segment_mean``), read here over the completion
rows only: each ``segment_mean(x)`` becomes ``segment_mean(completion * x)``, with the per-row token
``completion`` 1 on the responses' rows and 0 on the prompts'.
"""
from __future__ import annotations

from typing import Any

import torch

import losscodegen as lcg
from losscodegen import preference as P
from losscodegen.integrations.trl_base import fused_pair_forward, fused_pair_trainer, global_mean
from losscodegen.integrations.trl_losses import on_completions

try:
    from trl.experimental.orpo import ORPOTrainer as _TRLORPOTrainer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl_orpo needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["ORPOTrainer"]

class ORPOTrainer(_TRLORPOTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` with the same constructor; the loss is ``preference.ORPO(beta)``
    over the responses' tokens plus ``ChosenNLL()`` over every token of the chosen sequences, one pair a
    segment, and ``orpo_statistics`` give the logged rewards, log-probs and log odds. TRL's
    ``logits/chosen`` / ``logits/rejected`` (means of the full logits) come from the backbone's output
    (``trl_base.fused_pair_forward``). Refused at construction: an encoder-decoder model, a softcapped model,
    a mixture-of-experts load-balancing loss, a negative ``beta``; at a step, a response without a
    completion token (TRL's average log-probability is then NaN)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        refused = [f"beta={self.beta} (a negative weight of the odds ratio)"] if self.beta < 0 else []
        self._lcg_target, self._lcg_scale = fused_pair_trainer(self, "ORPOTrainer", refused)
        statistics = {t.name: t for t in map(on_completions, P.orpo_statistics())}
        log_odds_ratio = lcg.declare_term("log_odds_ratio", P.logsigmoid(statistics["log_odds"].formula))
        self._lcg_head = lcg.HeadLoss(on_completions(P.ORPO(beta=self.beta)), P.ChosenNLL(), *statistics.values(),
                                      log_odds_ratio(weight=0.0), logit_scale=self._lcg_scale)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        acc = self.accelerator
        cat = self.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=self.padding_value,
                                       device=acc.device)
        B = batch["chosen_labels"].shape[0]
        # TRL's NLL: every token of the sequence; its odds ratio: the response's (concatenated_labels)
        labels = cat["concatenated_input_ids"].masked_fill(cat["concatenated_attention_mask"] == 0, -100)[:, 1:]
        completion = cat["concatenated_labels"][:, 1:] != -100
        if bool((completion.sum(1) == 0).any()):
            raise ValueError("losscodegen's ORPOTrainer: a response has no completion token (truncated by "
                             "max_length?): TRL's average log-probability is then NaN; raise max_length or drop "
                             "such examples")
        head = self._lcg_head
        call = dict(P.pair_inputs(head, labels), completion=completion.float())
        out, mean_logit = fused_pair_forward(model, self._lcg_target, self._lcg_scale, cat, head, labels, call)

        def mean(total: torch.Tensor, count: float) -> float:
            return global_mean(acc.gather_for_metrics, total, count)

        logps_chosen, logps_rejected = out.terms["logps_chosen"] * B, out.terms["logps_rejected"] * B
        # TRL's accuracy compares the rewards, beta times the log-probs: none where beta is 0
        accuracy = out.terms["reward_accuracy"] if self.beta > 0 else out.loss.new_zeros(())
        metrics = {
            "rewards/chosen": mean(self.beta * logps_chosen, B),
            "rewards/rejected": mean(self.beta * logps_rejected, B),
            "rewards/accuracies": mean(accuracy * B, B),
            "rewards/margins": mean(self.beta * (logps_chosen - logps_rejected), B),
            "logps/rejected": mean(logps_rejected, B), "logps/chosen": mean(logps_chosen, B),
            # (TRL: each process's mean over its logits but the last position's, then over the processes)
            "logits/rejected": mean(mean_logit[B:, :-1].mean(), 1),
            "logits/chosen": mean(mean_logit[:B, :-1].mean(), 1),
            "nll_loss": mean(out.terms["chosen_nll"], 1),
            "log_odds_ratio": mean(out.terms["log_odds_ratio"], 1), "log_odds_chosen": mean(out.terms["log_odds"], 1),
        }
        prefix = "eval_" if train_eval == "eval" else ""
        return out.loss, {prefix + k: v for k, v in metrics.items()}
