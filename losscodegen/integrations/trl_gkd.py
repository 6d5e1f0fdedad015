"""TRL's GKD trainer on one fused head call: ``GKDTrainer``, a subclass of
``trl.experimental.gkd.GKDTrainer`` (same constructor), whose ``compute_loss`` is TRL's generalized JSD
between the student's and the teacher's next-token distributions, computed by ``head.linear`` from both
models' final hidden states and output layers: neither model's ``[batch, seq, vocab]`` logits exist.
(A module of its own: importing ``trl.experimental`` warns.)"""
from __future__ import annotations

from typing import Any

import torch

from losscodegen.integrations.trl_base import add_fused_objective, policy_model
from losscodegen.integrations.trl_lm_head import final_logit_transform
from losscodegen.integrations.trl_losses import jsd_head

try:
    from trl.experimental.gkd import GKDTrainer as _TRLGKDTrainer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl_gkd needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["GKDTrainer"]


class GKDTrainer(_TRLGKDTrainer):
    """``trl.experimental.gkd.GKDTrainer`` with the same constructor; ``compute_loss`` is TRL's (its
    ``generalized_jsd_loss`` at ``beta``, temperature 1, over the positions whose label is not -100,
    divided by ``num_items_in_batch``, else by those positions) from one ``head.linear`` call on the
    student's hidden states with the teacher's as ``teacher_hidden``. The student's final-logit transform
    (its config's softcap and scale, as its forward applies it) is the head's; the head takes the teacher's
    logits as they come, so a teacher's scale is folded into its hidden states and bias (its logits are linear
    in them), and a softcapped teacher is refused."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        (cap, scale), (teacher_cap, teacher_scale) = (final_logit_transform(self.accelerator.unwrap_model(m))
                                                      for m in (self.model, self.teacher_model))
        if teacher_cap is not None:
            raise ValueError(f"losscodegen's GKDTrainer: the teacher's final logits are softcapped "
                             f"({teacher_cap * abs(teacher_scale)}), which the fused head does not apply to a teacher; "
                             "use trl's GKDTrainer for it")
        self._lcg_head = jsd_head(float(self.beta), 1.0, cap, scale)
        self._lcg_teacher_scale = teacher_scale
        student = policy_model(self.model)
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
        # (the teacher is frozen, as TRL runs it under no_grad: its output layer's parameters, which may
        # still require grad, get no gradient from the loss)
        weight, bias = out_layer.weight.detach(), None if out_layer.bias is None else out_layer.bias.detach()
        scale = self._lcg_teacher_scale
        if scale != 1.0:   # the teacher's scaled logits: its hidden states and bias times the scale
            teacher_hidden = teacher_hidden * scale
            bias = None if bias is None else bias * scale
        labels = inputs["labels"][:, 1:]
        divisor = (labels != -100).sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        call = dict(teacher_hidden=teacher_hidden, teacher_weight=weight, teacher_bias=bias, divisor=divisor)
        out = model(input_ids=ids, attention_mask=mask, losscodegen=(self._lcg_head, labels, call, ids.shape[1] - 1))
        return out.loss
