"""TRL's CPO trainer on one fused head call: ``CPOTrainer``, a subclass of
``trl.experimental.cpo.CPOTrainer`` (same constructor), whose ``get_batch_loss_metrics`` computes TRL's
CPO loss (``cpo_loss`` of its ``loss_type`` averaged over the pairs, plus ``cpo_alpha`` times the chosen
responses' NLL) and the metrics TRL logs in one ``head.linear`` call on the policy's hidden states and
output layer: no ``[2B, T, V]`` logits. (A module of its own: importing ``trl.experimental`` warns.)
``trl_orpo.ORPOTrainer`` shares its pair forward (``fused_pair_forward``)."""
from __future__ import annotations

from typing import Any

import torch

import losscodegen as lcg
from losscodegen import preference as P
from losscodegen.integrations.trl import add_fused_objective, final_logit_transform

try:
    from trl.experimental.cpo import CPOTrainer as _TRLCPOTrainer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl_cpo needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["CPOTrainer"]


def fused_pair_trainer(trainer: Any, name: str, refused: list[str]) -> tuple[Any, float]:
    """Check a TRL pair trainer (CPO, ORPO) built: refuse what one fused call on the policy's hidden states
    cannot compute (with ``refused``, the trainer's own), patch its model for ``add_fused_objective``, and
    return the patched model and its logit scale."""
    target = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    softcap, scale = final_logit_transform(target)
    if trainer.is_encoder_decoder:
        refused.append("an encoder-decoder model")
    if softcap is not None:
        refused.append(f"a final-logit softcap ({softcap * abs(scale)}: TRL's logits/chosen, a mean of the full "
                       "logits, is then no function of the hidden states' mean)")
    if trainer.aux_loss_enabled and trainer.aux_loss_coef != 0.0:
        refused.append(f"router_aux_loss_coef={trainer.aux_loss_coef} (a mixture-of-experts load-balancing loss)")
    if refused:
        raise ValueError(f"losscodegen's {name} cannot fuse " + "; ".join(refused)
                         + f": use trl.experimental.{name[:-len('Trainer')].lower()}.{name} for these")
    add_fused_objective(target, cast_lm_head_to_fp32=False)
    return target, scale


def fused_pair_forward(model: Any, target: Any, scale: float, cat: dict, head: lcg.HeadLoss, labels: torch.Tensor,
                       call: dict) -> tuple[lcg.HeadOutput, torch.Tensor]:
    """One ``head.linear`` call on TRL's concatenated batch ``cat`` (labels ``[2B, T - 1]``, shifted), and
    each position's mean logit over the vocabulary ``[2B, T]`` (TRL logs means of the full logits): linear
    in the hidden state, ``h . mean(W) + mean(b)`` times the logit scale, from the backbone's output."""
    hidden = []
    hook = target.base_model.register_forward_hook(
        lambda module, inputs, output: hidden.append(output.last_hidden_state.detach()))
    try:
        out = model(cat["concatenated_input_ids"], attention_mask=cat["concatenated_attention_mask"],
                    use_cache=False, losscodegen=(head, labels, call, labels.shape[1]))
    finally:
        hook.remove()
    lm_head = target.get_output_embeddings()
    with torch.no_grad():
        mean_logit = hidden[0].float() @ lm_head.weight.float().mean(0)
        if lm_head.bias is not None:
            mean_logit = mean_logit + lm_head.bias.float().mean()
    return out, mean_logit * scale


def gathered_mean(acc: Any, total: torch.Tensor, count: float) -> float:
    """``total / count`` summed over the processes (``acc``: the accelerator)."""
    totals = acc.gather_for_metrics(torch.stack([total.float(), total.new_tensor(count)])[None]).reshape(-1, 2).sum(0)
    return (totals[0] / totals[1]).item()


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
            return gathered_mean(acc, total, count)

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
