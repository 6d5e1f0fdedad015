"""TRL's GKD trainer on one fused head call: ``GKDTrainer``, a subclass of
``trl.experimental.gkd.GKDTrainer`` (same constructor), whose ``compute_loss`` is TRL's generalized JSD
between the student's and the teacher's next-token distributions, computed by ``head.linear`` from both
models' final hidden states and output layers: neither model's ``[batch, seq, vocab]`` logits exist.
(A module of its own: importing ``trl.experimental`` warns.)"""
from __future__ import annotations

from typing import Any

import torch

from losscodegen.integrations.trl import add_fused_objective, final_logit_transform, jsd_head

try:
    from trl.experimental.gkd import GKDTrainer as _TRLGKDTrainer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl_gkd needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["GKDTrainer"]


class GKDTrainer(_TRLGKDTrainer):
    """``trl.experimental.gkd.GKDTrainer`` with the same constructor; ``compute_loss`` is TRL's (its
    ``generalized_jsd_loss`` at ``beta``, temperature 1, over the positions whose label is not -100,
    divided by ``num_items_in_batch``, else by those positions) from one ``head.linear`` call on the
    student's hidden states with the teacher's as ``teacher_hidden``. Models whose final logits are
    transformed (a softcap, a scale) are refused: one head carries one transform for both sides."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for name, model in (("model", self.model), ("teacher_model", self.teacher_model)):
            transform = final_logit_transform(self.accelerator.unwrap_model(model))
            if transform != (None, 1.0):
                raise ValueError(f"losscodegen's GKDTrainer: the {name}'s final logits are transformed (softcap, "
                                 f"scale: {transform}); use trl's GKDTrainer for it")
        student = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_objective(student, cast_lm_head_to_fp32=False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:   # (the caller wants the student's logits: TRL's own)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        teacher.eval()
        with torch.no_grad():
            teacher_hidden = teacher.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        out_layer = teacher.get_output_embeddings()
        labels = inputs["labels"][:, 1:]
        divisor = (labels != -100).sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        call = dict(teacher_hidden=teacher_hidden, teacher_weight=out_layer.weight, teacher_bias=out_layer.bias,
                    divisor=divisor)
        out = model(input_ids=ids, attention_mask=mask,
                    losscodegen=(jsd_head(float(self.beta), 1.0), labels, call, ids.shape[1] - 1))
        return out.loss
