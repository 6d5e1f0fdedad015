"""TRL's SFT trainer on losscodegen's fused LM head: ``SFTTrainer``, a subclass of ``trl.SFTTrainer`` (same
constructor), that trains a model patched by ``apply_losscodegen`` on its head's objective."""
from __future__ import annotations

from typing import Any

from losscodegen.integrations.trl_base import policy_model
from losscodegen.integrations.trl_lm_head import (add_fused_lm_head, computes_trls_fused_loss, fusing_objective,
                                                  trl_fused_head_of)

try:
    import trl
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["SFTTrainer"]

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
        target = policy_model(self.model)
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
