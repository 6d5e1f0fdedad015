"""Hugging Face transformers: ``apply_losscodegen(model, head=None)`` patches a causal LM instance so
that its training forwards take the loss from ``head.linear`` on the final hidden states (no
``[batch, seq, vocab]`` logits), and leaves every other forward as it was (docs/integrations-transformers.md).

Which models: any whose forward is transformers' standard causal-LM loss path, recognised from the
forward's own code (losscodegen.integrations.transformers_reading), not from a list: the backbone called on
the forward's arguments, the hidden states taken and sliced by ``slice_logits_to_keep``, an ``nn.Linear``
output layer, a final-logit transform made of scales and one tanh (Gemma's softcap, Cohere's scale,
Granite's divisor: the head computes it, with the values the forward reads), ``self.loss_function`` being
transformers' ``ForCausalLMLoss`` on those logits and labels, a mixture-of-experts router's load-balancing
loss added as transformers writes it, and the output built from these. The patched forward runs the
forward itself, inside its own decorators, with its output layer returning deferred logits and its
``loss_function`` the head's (losscodegen.integrations.transformers_runtime): only the output layer, the
transform and the loss become the head's. A forward with anything else is refused naming the line that
differs: it would otherwise train on a silently different objective. ``register_model_type`` declares a
forward that cannot be read (losscodegen.integrations.transformers_model_types). ``SUPPORTED_MODEL_TYPES``:
the types checked against their unpatched forward in tests/integrations/test_integration_models.py, and
those declared. ``AutoLosscodegenForCausalLM`` and ``LosscodegenCallback`` switch the patch on without
calling it; the callback logs the head's terms and metrics into the Trainer's logs.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import losscodegen as lcg

try:
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.trainer_callback import CallbackHandler, TrainerCallback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.transformers needs transformers>=5: pip install "losscodegen[hf]"') from e

from losscodegen.integrations import transformers_model_types as model_types
from losscodegen.integrations.transformers_model_types import ModelType, register_model_type
from losscodegen.integrations.transformers_reading import Forward, NotStandard, read_class
from losscodegen.integrations.transformers_runtime import (IGNORE_INDEX, FinalLogits, head_loss_as_loss_function,
                                                           linear, patched_forward, probe, rewrapped)

__all__ = ["apply_losscodegen", "register_model_type", "AutoLosscodegenForCausalLM", "LosscodegenCallback",
           "LosscodegenState", "ModelType", "TokenMeans", "SUPPORTED_MODEL_TYPES", "FinalLogits"]


def __getattr__(name: str) -> Any:
    # (register_model_type rebinds the tuple in its module: read there, it is never stale here)
    if name == "SUPPORTED_MODEL_TYPES":
        return model_types.SUPPORTED_MODEL_TYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class TokenMeans:
    """The head's terms and metrics summed over the forwards since the last ``take()``, and the tokens
    they scored: ``take()`` gives each as a per-token mean over all of them (an accumulated batch, or the
    evaluation set), not the last micro-batch's. Sums stay on the device until ``take()``. (A term with
    class weights, whose value is a weighted mean, is averaged over its micro-batches by token count.)"""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: torch.Tensor | None = None

    def add(self, out: lcg.HeadOutput, tokens: torch.Tensor, divisor: Any) -> None:
        # a term is its sum over the valid rows / divisor; a metric a mean over the valid rows
        divisor = tokens if divisor is None else divisor
        values = {**{k: v * divisor for k, v in out.terms.items()}, **{k: v * tokens for k, v in out.metrics.items()}}
        for k, v in values.items():
            self.sums[k] = v if k not in self.sums else self.sums[k] + v
        self.tokens = tokens if self.tokens is None else self.tokens + tokens

    def take(self) -> dict[str, float]:
        """The per-token means (over every process, where torch.distributed runs), then empty."""
        if self.tokens is None:
            return {}
        names = list(self.sums)
        totals = torch.stack([self.sums[k].float() for k in names] + [self.tokens.float()])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        self.sums, self.tokens = {}, None
        totals = totals.tolist()
        return {k: v / max(totals[-1], 1.0) for k, v in zip(names, totals)}


@dataclass
class LosscodegenState:
    """``model.losscodegen`` on a patched model: the head, the model's final-logit transform, the last
    forward's ``terms`` and ``metrics`` (detached fp32 scalars, unweighted, as in ``HeadOutput``), and
    ``train`` / ``eval``: their per-token means since they were last taken (``LosscodegenCallback`` logs them)."""

    head: lcg.HeadLoss
    final_logits: FinalLogits
    forward: Forward                     # the model's forward, as read or declared
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    train: TokenMeans = field(default_factory=TokenMeans)
    eval: TokenMeans = field(default_factory=TokenMeans)
    warned_unused: bool = False          # (a training forward without labels warns once)

    def take_for(self, logs: dict) -> dict[str, float]:
        """What a Trainer's ``logs`` gets of the head: for a training log (it has ``loss``), the per-token
        means of ``train``; for ``evaluate()``'s (``{prefix}_loss``), those of ``eval`` under its prefix
        (``eval_cross_entropy``); each then empty. {} for another log."""
        if "loss" in logs:
            return self.train.take()
        prefix = next((k[:-len("loss")] for k in logs if k.endswith("_loss")), None)
        return {} if prefix is None else {prefix + k: v for k, v in self.eval.take().items()}



def apply_losscodegen(model: nn.Module, head: lcg.HeadLoss | None = None) -> nn.Module:
    """Patch ``model`` (a transformers causal LM instance, e.g. ``LlamaForCausalLM``) in place and
    return it. Its class and every other instance are left alone.

    - A forward with ``labels`` (or ``shift_labels``) in training mode returns the loss of ``head``
      from ``head.linear`` on the final hidden states, labels shifted as the model shifts them,
      ``num_items_in_batch`` (which the Trainer passes) as the divisor; ``outputs.logits`` is None.
    - With labels outside training mode (evaluation), the logits as the model computes them, and
      the head's loss on them.
    - Without labels: the model's own forward, unchanged (generation).

    The model's forward must read as transformers' standard causal-LM loss path (or its type be declared
    with ``register_model_type``); one that does not is refused naming the line that differs.
    ``head=None`` is ``HeadLoss(CrossEntropy())`` with the model's final-logit softcap and scale (as its
    forward reads them); a head given must have them too (an error says which differ), and
    ``ignore_index=-100``. ``model.losscodegen`` (a ``LosscodegenState``) holds the head and the last
    training forward's terms and metrics.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if "losscodegen" in vars(model):
        raise ValueError("apply_losscodegen: this model is already patched (model.losscodegen)")
    if _loss_function(model) is not ForCausalLMLoss:
        raise ValueError("apply_losscodegen: the model's loss_function is not transformers' ForCausalLMLoss "
                         "(a custom loss would be replaced silently)")
    stand_in = object()
    with head_loss_as_loss_function(model, stand_in):     # (as the patched forward gives it the head's loss)
        if model.loss_function is not stand_in:
            raise ValueError(f"apply_losscodegen: {type(model).__name__} defines loss_function itself, not as "
                             "transformers' property reads it: the patched forward cannot give it the head's loss")
    forward, final = _forward_of(model)
    linear(model, forward)
    if head is None:
        head = lcg.HeadLoss(lcg.CrossEntropy(), softcap=final.softcap, logit_scale=final.logit_scale)
    elif not isinstance(head, lcg.HeadLoss):
        raise TypeError(f"head must be a losscodegen HeadLoss, got {type(head).__name__}")
    _check_head(head, final, type(model).__name__)
    # (set without nn.Module's __setattr__: the state holds a module, the head, that must not become a
    # submodule of the model)
    object.__setattr__(model, "losscodegen", LosscodegenState(head, final, forward))

    @functools.wraps(forward.function)
    def patched(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return patched_forward(self, *args, **kwargs)
    # The forward's own decorators (returning a tuple on return_dict=False, renamed arguments, the
    # config's defaults) run around it as around the model's. The Trainer reads the forward's parameters
    # (the columns it keeps, whether it takes num_items_in_batch): the model's own. A function of this
    # instance's, bound to it, so that a deepcopy of the model is bound to the copy.
    patched.__signature__ = forward.signature
    object.__setattr__(model, "forward", types.MethodType(rewrapped(type(model).forward, patched), model))
    # TRL's trainers replace the forward with their fused LM head, then tag the model: the tag is when
    # a head TRL's fused loss does not compute is refused (docs/integrations-trl.md)
    object.__setattr__(model, "add_model_tags", types.MethodType(_add_model_tags, model))
    return model


def _add_model_tags(self: nn.Module, tags: Any) -> None:
    type(self).add_model_tags(self, tags)
    if "trl" not in sys.modules:
        return
    from losscodegen.integrations.trl_lm_head import drops_objective
    if drops_objective(self):
        terms = ", ".join(t.name for t in self.losscodegen.head.loss_terms)
        tags = ", ".join(map(str, tags if isinstance(tags, (list, tuple)) else [tags]))
        raise ValueError(
            f"this {type(self).__name__} was patched by apply_losscodegen with a head whose objective is not "
            f"cross-entropy alone ({terms}), and a TRL trainer (tags: {tags}) has given it TRL's fused LM head, whose "
            "loss is plain cross-entropy: it would train on a different objective. Use "
            "losscodegen.integrations.trl.SFTTrainer (which trains on the head's objective), transformers.Trainer, "
            "or a head of CrossEntropy() alone")


def _check_head(head: lcg.HeadLoss, final: FinalLogits, model: str) -> None:
    wanted = f"build it as HeadLoss(..., softcap={final.softcap}, logit_scale={final.logit_scale})"
    does = f"this {model}'s forward " + ("applies no transform to its final logits" if final.text == "none" else
                                         f"transforms its final logits by {final.text}")
    if (head.softcap is None) != (final.softcap is None) or (
            final.softcap is not None and not math.isclose(head.softcap, final.softcap, rel_tol=1e-9)):
        raise ValueError(f"head.softcap={head.softcap}, but {does}: "
                         f"{'no softcap' if final.softcap is None else f'a softcap of {final.softcap}'}; {wanted}")
    if not math.isclose(head.logit_scale, final.logit_scale, rel_tol=1e-9):
        raise ValueError(f"head.logit_scale={head.logit_scale}, but {does}: a scale of {final.logit_scale}; {wanted}")
    if head.ignore_index != IGNORE_INDEX:
        raise ValueError(f"head.ignore_index={head.ignore_index}: transformers marks ignored labels with -100")
    if not head.loss_terms:
        raise ValueError("head has no loss terms (metrics only): a training forward needs a loss")


def _loss_function(model: nn.Module) -> Any:
    """What ``model.loss_function`` is (as transformers' property resolves it, without its warning)."""
    if inspect.getattr_static(type(model), "loss_function", None) is not \
            inspect.getattr_static(transformers.PreTrainedModel, "loss_function"):
        return inspect.getattr_static(type(model), "loss_function")
    if "_loss_function" in vars(model):
        return vars(model)["_loss_function"]
    loss_type = getattr(model, "loss_type", None)
    return LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM")


def _forward_of(model: nn.Module) -> tuple[Forward, FinalLogits]:
    """How ``model``'s forward computes its loss: read from its code, else its type's declaration; and its
    final-logit transform (``probe``)."""
    cls, model_type = type(model), getattr(model.config, "model_type", None)
    declaration = model_types.declarations().get(model_type)

    def declared() -> Forward:
        try:
            return model_types.declared(cls, declaration)
        except NotStandard as e:
            raise ValueError(f"apply_losscodegen: register_model_type({model_type!r}, ...) cannot serve "
                             f"{cls.__name__}: {e}") from None
    try:
        forward = read_class(cls)
    except NotStandard as e:
        if declaration is None:
            raise ValueError(f"apply_losscodegen: {cls.__name__} (model type {model_type!r}) does not follow "
                             f"transformers' standard causal-LM loss path: {e}. A forward that differs would train on "
                             "a different objective; if you have checked that this one computes the standard loss, "
                             "register_model_type declares it") from None
        forward = declared()
        return forward, probe(model, forward)
    final = probe(model, forward)
    if declaration is not None:     # a declaration must not contradict the forward's own code
        other = declared()
        other_final = probe(model, other)
        differs = [f"{name}: declared {d}, the forward's {f}" for name, d, f in (
            ("softcap", other_final.softcap, final.softcap), ("logit_scale", other_final.logit_scale, final.logit_scale),
            ("router_aux_loss", other.router, forward.router),
            ("base_takes_labels", other.base_takes_labels, forward.base_takes_labels)) if d != f]
        if differs:
            raise ValueError(f"apply_losscodegen: register_model_type({model_type!r}, ...) contradicts "
                             f"{forward.where}, which reads as the standard path: {'; '.join(differs)}")
    return forward, final


def _patchable(model: nn.Module) -> nn.Module:
    """The causal LM under a PEFT wrapper (the instance whose forward the patch replaces)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


class LosscodegenCallback(TrainerCallback):
    """``Trainer(..., callbacks=[LosscodegenCallback(head=None)])``: patches the trainer's model with
    ``apply_losscodegen(model, head)`` when the trainer is built (or when training begins, if added later;
    a model patched already is kept, and must have ``head`` if one is given), and logs the head's terms and
    metrics into the Trainer's logs (``log_history`` and every ``report_to``): per-token means over the
    tokens since the last log (with ``logging_steps=1``, the accumulated batch), and for ``evaluate()`` over
    the evaluation set, under the evaluation's prefix (``eval_cross_entropy``)."""

    def __init__(self, head: lcg.HeadLoss | None = None):
        if head is not None and not isinstance(head, lcg.HeadLoss):
            raise TypeError(f"head must be a losscodegen HeadLoss or None, got {type(head).__name__}")
        self.head = head

    def _patch(self, args: Any, model: nn.Module | None) -> None:
        # Logs reach report_to through the dict the callbacks are given, in their order: this one goes
        # first, so that the reporting callbacks (before the user's in the Trainer's list) see its values.
        handler = sys._getframe(2).f_locals.get("self")     # (CallbackHandler.call_event, which calls us)
        if isinstance(handler, CallbackHandler) and handler.callbacks[0] is not self:
            handler.callbacks.remove(self)
            handler.callbacks.insert(0, self)
        if model is None:
            return
        target = _patchable(model)
        state = vars(target).get("losscodegen")
        if state is None:
            apply_losscodegen(target, self.head)
        elif self.head is not None and state.head is not self.head:
            raise ValueError("LosscodegenCallback(head=...): the trainer's model is patched already, with another head")
        if getattr(args, "label_smoothing_factor", 0.0):
            warnings.warn(f"label_smoothing_factor={args.label_smoothing_factor}: the Trainer computes a "
                          "label-smoothed loss from the logits itself, and the head is not used; use "
                          "CrossEntropy(label_smoothing=...) "
                          "in the head instead", stacklevel=4)

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._patch(args, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        self._patch(args, model)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, model: nn.Module | None = None,
               **kwargs: Any) -> None:
        lcg_state = None if model is None else vars(_patchable(model)).get("losscodegen")
        if logs is None or lcg_state is None:
            return
        values = lcg_state.take_for(logs)
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)   # (the Trainer appended a copy of logs before calling us)


class AutoLosscodegenForCausalLM(transformers.AutoModelForCausalLM):
    """``transformers.AutoModelForCausalLM`` whose models come patched: ``from_pretrained(...)`` and
    ``from_config(...)`` take the same arguments, plus ``head=`` (None: ``HeadLoss(CrossEntropy())`` with
    the model's final-logit transform), and return ``apply_losscodegen(model, head)``."""

    @classmethod
    def from_pretrained(cls, *args: Any, head: lcg.HeadLoss | None = None, **kwargs: Any) -> nn.Module:
        return apply_losscodegen(transformers.AutoModelForCausalLM.from_pretrained(*args, **kwargs), head)

    @classmethod
    def from_config(cls, config: Any, *, head: lcg.HeadLoss | None = None, **kwargs: Any) -> nn.Module:
        return apply_losscodegen(transformers.AutoModelForCausalLM.from_config(config, **kwargs), head)
