"""Hugging Face transformers: ``apply_losscodegen(model, head=None)`` patches a causal LM instance so
that its training forwards take the loss from ``head.linear`` on the final hidden states (no
``[batch, seq, vocab]`` logits), and leaves every other forward as it was (docs/integrations-transformers.md).

The patched forward does what the model's own forward does around its output layer (read from each
supported model's source in transformers 5.x, declared as a ``ModelType``): the backbone,
``slice_logits_to_keep``, the output layer, the model's final-logit transform (Gemma 2/3's softcap,
Cohere's scale, Granite's divisor), ``ForCausalLMLoss``'s label shift, ``ignore_index=-100`` and
``num_items_in_batch`` divisor, and a mixture-of-experts model's router load-balancing loss. A model
type whose forward was not checked against this is refused (``register_model_type`` declares one): a
forward that adds a loss or transforms the logits differently would otherwise train on a silently
different objective. ``AutoLosscodegenForCausalLM`` and ``LosscodegenCallback`` switch the patch on
without calling it; the callback logs the head's terms and metrics into the Trainer's logs.
"""
from __future__ import annotations

import inspect
import math
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import losscodegen as lcg
from losscodegen.inputs import check_divisor

try:
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.trainer_callback import CallbackHandler, TrainerCallback
    from transformers.utils.generic import can_return_tuple
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.transformers needs transformers>=5: pip install "losscodegen[hf]"') from e
try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # (earlier transformers 5 releases sliced inline, as this does)
    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]

__all__ = ["apply_losscodegen", "register_model_type", "AutoLosscodegenForCausalLM", "LosscodegenCallback",
           "LosscodegenState", "ModelType", "TokenMeans", "SUPPORTED_MODEL_TYPES"]


@dataclass(frozen=True)
class FinalLogits:
    """A model's final-logit transform: as the head applies it (``softcap``, then ``logit_scale``),
    and as the model's forward writes it (``apply``, for the logits returned outside training)."""

    softcap: float | None = None
    logit_scale: float = 1.0
    apply: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class ModelType:
    """How a model type's forward computes its training loss around the output layer (``register_model_type``).
    Each config attribute is read from the text config (``config.get_text_config()``)."""

    softcap: str | None = None           # logits = tanh(logits / c) * c, c = config.<softcap> (when not None)
    logit_scale: str | None = None       # logits = logits * config.<logit_scale>
    logit_divisor: str | None = None     # logits = logits / config.<logit_divisor>
    router_aux_loss: bool = False        # + router_aux_loss_coef * its module's load_balancing_loss_func(...)
    base_takes_labels: bool = False      # the base model is given labels too (Gemma 3's multimodal attention mask)

    def final_logits(self, model: nn.Module) -> FinalLogits:
        config = model.config.get_text_config()
        cap = None if self.softcap is None else getattr(config, self.softcap)
        scale = None if self.logit_scale is None else float(getattr(config, self.logit_scale))
        divisor = None if self.logit_divisor is None else float(getattr(config, self.logit_divisor))
        if cap is None and scale is None and divisor is None:
            return FinalLogits()

        def apply(x: torch.Tensor) -> torch.Tensor:   # (as the forwards write it: the same bits)
            x = x if cap is None else torch.tanh(x / cap) * cap
            x = x if scale is None else x * scale
            return x if divisor is None else x / divisor
        logit_scale = (1.0 if scale is None else scale) / (1.0 if divisor is None else divisor)
        return FinalLogits(softcap=None if cap is None else float(cap), logit_scale=logit_scale, apply=apply)


_PLAIN, _MOE = ModelType(), ModelType(router_aux_loss=True)
# model_type -> what its forward does. Every type here has a forward that is exactly: base model,
# slice_logits_to_keep, lm_head (an nn.Linear), the final-logit transform, self.loss_function(logits,
# labels, ...) and, for mixture-of-experts models with output_router_logits, the router's load-balancing
# loss, and nothing else (read from transformers 5.24's modeling files; tests/integrations/test_integration_models.py
# checks each against its unpatched forward). *ForConditionalGeneration types: their language model's
# text path (the base model takes the images).
_MODEL_TYPES: dict[str, ModelType] = {
    **dict.fromkeys(("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "phi", "phi3", "olmo", "olmo2",
                     "olmo3", "starcoder2", "smollm3", "glm", "glm4", "helium", "exaone4", "deepseek_v3",
                     "llama4_text", "qwen2_5_vl", "qwen2_vl", "llava", "ernie4_5", "seed_oss", "apertus", "arcee",
                     "nemotron", "stablelm", "hunyuan_v1_dense", "glm4_moe", "mistral3", "qwen3_vl", "internvl",
                     "smolvlm", "hunyuan_v1_moe", "glm4v"), _PLAIN),
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "qwen3_next", "olmoe", "phimoe", "ernie4_5_moe",
                     "minimax"), _MOE),
    "granitemoe": ModelType(logit_divisor="logits_scaling", router_aux_loss=True),
    "gemma2": ModelType(softcap="final_logit_softcapping"),
    "gemma3_text": ModelType(softcap="final_logit_softcapping"),
    "gemma3": ModelType(base_takes_labels=True),     # (Gemma3ForConditionalGeneration applies no softcap)
    "paligemma": ModelType(softcap="final_logit_softcapping"),
    "falcon_h1": ModelType(logit_scale="lm_head_multiplier"),
    "cohere": ModelType(logit_scale="logit_scale"), "cohere2": ModelType(logit_scale="logit_scale"),
    "granite": ModelType(logit_divisor="logits_scaling"),
}
# the types apply_losscodegen patches: those checked against transformers' forwards, and those
# register_model_type adds (it rebinds this tuple: read it as a module attribute)
SUPPORTED_MODEL_TYPES = tuple(sorted(_MODEL_TYPES))


def register_model_type(model_type: str, *, softcap: str | None = None, logit_scale: str | None = None,
                        logit_divisor: str | None = None, router_aux_loss: bool = False,
                        base_takes_labels: bool = False) -> None:
    """Let ``apply_losscodegen`` patch models of ``model_type`` (``config.model_type``), whose forward
    is: ``outputs = self.base_model(...)`` (given ``labels`` too with ``base_takes_labels``), the hidden
    states sliced by ``slice_logits_to_keep``, ``logits = self.lm_head(hidden)`` (an ``nn.Linear``), then
    the final-logit transform named by config attributes (``softcap``: ``tanh(x / c) * c``; then
    ``logit_scale``: times it; ``logit_divisor``: divided by it), ``loss = self.loss_function(logits,
    labels, ...)``, and with ``router_aux_loss``, ``loss += self.router_aux_loss_coef *
    load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
    attention_mask)`` (the function of the model's own module) when ``output_router_logits``. A forward
    that does anything else would train on a different objective: check it against the unpatched model
    (loss and gradients) before relying on it."""
    global SUPPORTED_MODEL_TYPES
    if not isinstance(model_type, str) or not model_type:
        raise TypeError(f"model_type must be a non-empty str (a config's model_type), got {model_type!r}")
    _MODEL_TYPES[model_type] = ModelType(softcap=softcap, logit_scale=logit_scale, logit_divisor=logit_divisor,
                                         router_aux_loss=bool(router_aux_loss),
                                         base_takes_labels=bool(base_takes_labels))
    SUPPORTED_MODEL_TYPES = tuple(sorted(_MODEL_TYPES))


# the outputs' key-value cache field: "cache" since transformers 5.24 ("past_key_values" before)
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_IGNORE_INDEX = -100   # ForCausalLMLoss's, and what transformers' collators pad labels with


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
    forward: Callable[..., Any]          # the model's own forward, bound to it
    model_type: ModelType
    router_loss: Callable[..., torch.Tensor] | None   # its module's load_balancing_loss_func (router_aux_loss)
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

    ``head=None`` is ``HeadLoss(CrossEntropy())`` with the model's final-logit softcap and scale
    (from its config); a head given must have them too (an error says which differ), and
    ``ignore_index=-100``. ``model.losscodegen`` (a ``LosscodegenState``) holds the head and the last
    training forward's terms and metrics.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"apply_losscodegen: model type {model_type!r} ({type(model).__name__}) is not one whose "
                         f"forward losscodegen has been checked against; supported: {', '.join(sorted(_MODEL_TYPES))} "
                         "(register_model_type adds one)")
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(lm_head, nn.Linear):
        raise ValueError(f"apply_losscodegen: {type(model).__name__} needs an nn.Linear lm_head "
                         f"(a causal LM such as {model_type.capitalize()}ForCausalLM), got {type(lm_head).__name__}")
    if "_loss_function" in vars(model) or LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM") \
            is not ForCausalLMLoss:
        raise ValueError("apply_losscodegen: the model's loss_function is not transformers' ForCausalLMLoss "
                         "(a custom loss would be replaced silently)")
    if "losscodegen" in vars(model):
        raise ValueError("apply_losscodegen: this model is already patched (model.losscodegen)")
    spec = _MODEL_TYPES[model_type]
    final = spec.final_logits(model)
    router_loss = sys.modules[type(model).__module__].load_balancing_loss_func if spec.router_aux_loss else None
    if head is None:
        head = lcg.HeadLoss(lcg.CrossEntropy(), softcap=final.softcap, logit_scale=final.logit_scale)
    elif not isinstance(head, lcg.HeadLoss):
        raise TypeError(f"head must be a losscodegen HeadLoss, got {type(head).__name__}")
    _check_head(head, final, model_type)
    # (set without nn.Module's __setattr__: the state holds a module, the head, that must not become a
    # submodule of the model)
    object.__setattr__(model, "losscodegen", LosscodegenState(head, final, model.forward, spec, router_loss))

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _forward(self, *args, **kwargs)
    # The Trainer reads the forward's parameters (the columns it keeps, whether it takes
    # num_items_in_batch): the model's own. A function of this instance's, bound to it, so that a
    # deepcopy of the model is bound to the copy.
    forward.__signature__ = inspect.signature(type(model).forward)
    object.__setattr__(model, "forward", types.MethodType(can_return_tuple(forward), model))
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


def _check_head(head: lcg.HeadLoss, final: FinalLogits, model_type: str) -> None:
    wanted = f"HeadLoss(..., softcap={final.softcap}, logit_scale={final.logit_scale})"
    if (head.softcap is None) != (final.softcap is None) or (
            final.softcap is not None and not math.isclose(head.softcap, final.softcap, rel_tol=1e-9)):
        raise ValueError(f"head.softcap={head.softcap}, but this {model_type} model's final logits are softcapped "
                         f"with {final.softcap} (config.final_logit_softcapping): build it as {wanted}")
    if not math.isclose(head.logit_scale, final.logit_scale, rel_tol=1e-9):
        raise ValueError(f"head.logit_scale={head.logit_scale}, but this {model_type} model scales its final logits "
                         f"by {final.logit_scale} (from its config): build it as {wanted}")
    if head.ignore_index != _IGNORE_INDEX:
        raise ValueError(f"head.ignore_index={head.ignore_index}: transformers marks ignored labels with -100")
    if not head.loss_terms:
        raise ValueError("head has no loss terms (metrics only): a training forward needs a loss")


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: LosscodegenState = self.losscodegen
    bound = inspect.signature(state.forward).bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    extra = arguments.pop("kwargs", {})   # (every supported forward ends in **kwargs)
    labels = arguments.pop("labels", None)
    shift_labels = extra.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        if self.training and torch.is_grad_enabled() and not state.warned_unused:
            state.warned_unused = True
            warnings.warn("apply_losscodegen: a training forward without labels returns the logits and does not use "
                          "the head: the loss is computed outside the model (Trainer's label_smoothing_factor, "
                          "compute_loss_func, or a trainer's own loss). For label smoothing use "
                          "CrossEntropy(label_smoothing=...) in the head instead", stacklevel=3)
        return state.forward(*args, **kwargs)      # generation, or logits only: the model's own forward
    num_items_in_batch = extra.pop("num_items_in_batch", None)
    extra.pop("ignore_index", None)                # (ForCausalLMLoss's keyword; the head checks -100)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    spec = state.model_type
    if spec.router_aux_loss and arguments.get("output_router_logits") is None:   # (as the forward resolves it)
        arguments["output_router_logits"] = self.config.output_router_logits
    if spec.base_takes_labels:
        arguments["labels"] = labels
    outputs = self.model(**arguments, **extra)     # (every supported forward's backbone: self.model)
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    if shift_labels is None:
        # ForCausalLMLoss: pad one ignored label at the end, then position t predicts label t + 1
        shift_labels = nn.functional.pad(labels, (0, 1), value=_IGNORE_INDEX)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(hidden.device, non_blocking=True)
    valid = (shift_labels != _IGNORE_INDEX).sum()
    divisor = _divisor(num_items_in_batch, valid)
    head, lm_head = state.head, self.lm_head
    logits = None
    if self.training:
        out = head.linear(hidden, lm_head.weight, shift_labels, bias=lm_head.bias, divisor=divisor)
    else:
        raw = lm_head(hidden)
        out = head(raw, shift_labels, divisor=divisor)
        logits = raw if state.final_logits.apply is None else state.final_logits.apply(raw)
    state.terms, state.metrics = out.terms, out.metrics
    (state.train if self.training else state.eval).add(out, valid, num_items_in_batch)
    common = dict(logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    common[_CACHE] = getattr(outputs, _CACHE, None)
    if not spec.router_aux_loss:
        return CausalLMOutputWithPast(loss=out.loss, **common)
    loss, aux_loss = out.loss, None
    if arguments["output_router_logits"]:
        aux_loss = state.router_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                     arguments.get("attention_mask"))
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, router_logits=outputs.router_logits, **common)


def _divisor(num_items_in_batch: Any, valid: torch.Tensor) -> torch.Tensor | None:
    """The head's divisor for ``num_items_in_batch`` (errors name it): the count, plus 1 where this
    batch has no valid label. Such a batch's sum is 0, so its loss is 0 with a zero gradient, also
    where the count is 0 (an accumulation step of prompt tokens only: the Trainer's tensor 0, which
    would give 0/0), while a batch with valid labels divides by the count as given. On the device:
    no host sync."""
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, (int, float)) and not isinstance(num_items_in_batch, bool) \
            and num_items_in_batch == 0:
        num_items_in_batch = torch.zeros((), device=valid.device)   # (a number must be > 0: the count as a tensor)
    return check_divisor(num_items_in_batch, "mean", valid.device, name="num_items_in_batch") + (valid == 0)


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
