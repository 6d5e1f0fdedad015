"""TRL's KTO trainer on one fused head call: ``KTOTrainer``, a subclass of ``trl.KTOTrainer`` (same
constructor), whose loss is ``preference.KTO`` in one ``head.linear`` call on the policy's hidden states and
output layer."""
from __future__ import annotations

from typing import Any

import torch

import losscodegen as lcg
from losscodegen import preference as P
from losscodegen.integrations.trl_base import (add_fused_objective, empty_sequences_error, fused_policy, global_mean,
                                               router_loss_options)
from losscodegen.integrations.trl_losses import RESPONSE_TOKEN_METRICS

try:
    import trl
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["KTOTrainer"]

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
        refused = router_loss_options(self.args, self.model)
        target, softcap, scale = fused_policy(self, "KTOTrainer", refused)
        self._lcg_kl = torch.zeros((), device=self.accelerator.device)
        loss = P.KTO(loss_type=self.loss_type, beta=self.beta, kl=self._lcg_kl, desirable_weight=self.desirable_weight,
                     undesirable_weight=self.undesirable_weight)
        self._lcg_head = lcg.HeadLoss(loss, *P.sequence_statistics(),
                                      metrics=(lcg.Entropy(), *(m() for m in RESPONSE_TOKEN_METRICS[:2])),
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
            raise empty_sequences_error("KTOTrainer", "a completion")
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
        entropy = global_mean(acc.gather_for_metrics, out.metrics["entropy"] * n, n)
        metrics["entropy"].append(0.0 if entropy is None else entropy)
        if mode == "train":
            num_tokens_in_batch = acc.gather_for_metrics(batch["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens_in_batch // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            mean = global_mean(acc.gather_for_metrics, out.metrics[f"mean_logits_{side}"] * n, valid[rows].sum())
            if mean is not None:
                metrics[f"logits/{side}"].append(mean)
        sequences = torch.tensor(float(labels.shape[0]), device=n.device)   # (the terms are means over them)
        rewards = {}
        for side, name, rows in (("chosen", "desirable", desirable), ("rejected", "undesirable", ~desirable)):
            count = rows.sum()
            mean = global_mean(acc.gather_for_metrics, self.beta * out.terms[f"logratio_{name}"] * sequences, count)
            if mean is not None:   # (some process has such sequences)
                rewards[side] = mean
                metrics[f"rewards/{side}"].append(mean)
                metrics[f"logps/{side}"].append(
                    global_mean(acc.gather_for_metrics, out.terms[f"logps_{name}"] * sequences, count))
        if len(rewards) == 2:
            metrics["rewards/margins"].append(rewards["chosen"] - rewards["rejected"])
        return out.loss
