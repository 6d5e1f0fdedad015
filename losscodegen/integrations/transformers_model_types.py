"""The model types of ``apply_losscodegen``: those checked against their unpatched forward in losscodegen's
tests (``SUPPORTED_MODEL_TYPES``), and ``register_model_type``'s declarations of a forward that cannot be
read as transformers' standard causal-LM loss path, each served by ``declared``: that path, written here
as a function of the model (run under the runtime's output layer and loss, as a read forward is)."""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from losscodegen.integrations.transformers_reading import (Forward, NotStandard, read_class, slice_logits_to_keep,
                                                           where_of)

# The model types tests/integrations/test_integration_models.py builds (tiny configs of the installed
# transformers) and checks against their unpatched forward: loss, router loss and every gradient. Every
# one is patched because its forward reads as the standard path, as any other model's would be; this is
# the record of what was checked (Liger-Kernel's 50 types among them, that test says how), not a gate.
_VERIFIED_MODEL_TYPES = (
    "apertus", "arcee", "cohere", "cohere2", "deepseek_v3", "deepseek_v4", "ernie4_5", "ernie4_5_moe", "exaone4",
    "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n_text", "gemma4", "gemma4_text", "glm", "glm4",
    "glm4_moe", "glm4v", "glm4v_moe", "gpt_oss", "granite", "granitemoe", "helium", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "internvl", "llama", "llama4", "llama4_text", "llava", "minimax", "ministral", "ministral3",
    "mistral", "mistral3", "mistral4", "mistral_large4", "mixtral", "mllama", "mllama_text_model", "nemotron",
    "olmo", "olmo2", "olmo3", "olmoe", "paligemma", "phi", "phi3", "phimoe", "qwen2", "qwen2_5_vl", "qwen2_moe",
    "qwen2_vl", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "qwen3_vl", "qwen3_vl_moe", "seed_oss", "smollm3", "smolvlm", "stablelm", "starcoder2")


@dataclass(frozen=True)
class ModelType:
    """A forward declared with ``register_model_type``: what it computes around its output layer. Each
    config attribute is read from the text config (``config.get_text_config()``)."""

    softcap: str | None = None           # logits = tanh(logits / c) * c, c = config.<softcap> (when not None)
    logit_scale: str | None = None       # logits = logits * config.<logit_scale>
    logit_divisor: str | None = None     # logits = logits / config.<logit_divisor>
    router_aux_loss: bool = False        # + router_aux_loss_coef * its module's load_balancing_loss_func(...)
    base_takes_labels: bool = False      # the backbone is given labels too (Gemma 3's multimodal attention mask)


# model_type -> its declaration (register_model_type)
_MODEL_TYPES: dict[str, ModelType] = {}


def declarations() -> dict[str, ModelType]:
    """The types ``register_model_type`` has declared, each with its declaration."""
    return _MODEL_TYPES
# the types checked against transformers' forwards, and those register_model_type adds (it rebinds this
# tuple: read it as a module attribute)
SUPPORTED_MODEL_TYPES = tuple(sorted(_VERIFIED_MODEL_TYPES))


def register_model_type(model_type: str, *, softcap: str | None = None, logit_scale: str | None = None,
                        logit_divisor: str | None = None, router_aux_loss: bool = False,
                        base_takes_labels: bool = False, replace: bool = False) -> None:
    """Let ``apply_losscodegen`` patch models of ``model_type`` (``config.model_type``) whose forward it
    cannot read as transformers' standard causal-LM loss path, declaring that the forward is:
    ``outputs = self.model(...)`` given every argument but ``labels`` and ``logits_to_keep`` (``labels``
    too with ``base_takes_labels``), the hidden states sliced by ``slice_logits_to_keep``, ``logits =
    self.lm_head(hidden)`` (an ``nn.Linear``), then the final-logit transform named by config attributes
    (``softcap``: ``tanh(x / c) * c``; then ``logit_scale``: times it; ``logit_divisor``: divided by it),
    ``loss = self.loss_function(logits, labels, ...)``, and with ``router_aux_loss``, ``loss +=
    self.router_aux_loss_coef * load_balancing_loss_func(outputs.router_logits, self.num_experts,
    self.num_experts_per_tok, attention_mask)`` (the function of the model class's module, or of
    its nearest parent class's that has one) when
    ``output_router_logits``. A forward that does anything else would train on a different objective:
    check it against the unpatched model (loss and gradients) before relying on it.

    A type supported already (one checked in losscodegen's tests, one whose transformers class has a
    forward that reads as the standard path, or one declared before) is refused unless ``replace=True``.
    A model whose forward reads as the standard path is patched as its code says in any case, and one
    whose code contradicts its type's declaration (a softcap it applies and the declaration lacks) is refused."""
    global SUPPORTED_MODEL_TYPES
    if not isinstance(model_type, str) or not model_type:
        raise TypeError(f"model_type must be a non-empty str (a config's model_type), got {model_type!r}")
    for name, value in (("softcap", softcap), ("logit_scale", logit_scale), ("logit_divisor", logit_divisor)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be the name of a config attribute (a str, e.g. {name}="
                            f"{_EXAMPLE_ATTRIBUTE[name]!r}: the value is read from the model's config) or None, "
                            f"got {value!r}")
        if value is not None and not value.isidentifier():
            raise ValueError(f"{name} must be the name of a config attribute, got {value!r}")
    for name, value in (("router_aux_loss", router_aux_loss), ("base_takes_labels", base_takes_labels),
                        ("replace", replace)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if not replace:
        supported = _supported_already(model_type)
        if supported:
            raise ValueError(f"register_model_type({model_type!r}): {supported}. Declaring it again would replace "
                             "that; pass replace=True to declare it anyway (the declaration then serves the models of "
                             "this type whose forward cannot be read, and a model whose forward contradicts it is "
                             "refused)")
    _MODEL_TYPES[model_type] = ModelType(softcap=softcap, logit_scale=logit_scale, logit_divisor=logit_divisor,
                                         router_aux_loss=router_aux_loss, base_takes_labels=base_takes_labels)
    SUPPORTED_MODEL_TYPES = tuple(sorted({*_VERIFIED_MODEL_TYPES, *_MODEL_TYPES}))


_EXAMPLE_ATTRIBUTE = dict(softcap="final_logit_softcapping", logit_scale="logit_scale", logit_divisor="logits_scaling")


def _supported_already(model_type: str) -> str:
    """Why ``model_type`` needs no declaration ('' if it does)."""
    if model_type in _MODEL_TYPES:
        return f"{model_type!r} is declared already ({_MODEL_TYPES[model_type]})"
    if model_type in _VERIFIED_MODEL_TYPES:
        return (f"{model_type!r} is supported already: its forward reads as transformers' standard causal-LM loss "
                "path, and was checked against the unpatched model in losscodegen's tests")
    from transformers.models.auto import modeling_auto
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        cls = getattr(transformers, mapping.get(model_type, ""), None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            try:
                read_class(cls)
            except NotStandard:
                continue
            return f"{model_type!r} is supported already: {cls.__name__}'s forward reads as the standard path"
    return ""



# the outputs' key-value cache field: "cache" since transformers 5.24 ("past_key_values" before)
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def declared(cls: type, spec: ModelType) -> Forward:
    """The forward ``spec`` declares for ``cls`` (whose own forward is run where there are no labels)."""
    function = inspect.unwrap(cls.forward)
    signature = inspect.signature(function)
    params = signature.parameters
    plain = [p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][1:]
    varkw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
    where = f"the forward register_model_type declares for {function.__qualname__}"
    if varkw is None or "labels" not in plain:
        raise NotStandard(f"{where_of(cls)}: takes no labels and **kwargs: not a causal LM's forward")
    router_loss = next((f for c in cls.__mro__ if (f := getattr(sys.modules.get(c.__module__),
                                                               "load_balancing_loss_func", None)) is not None), None)
    if spec.router_aux_loss and router_loss is None:
        raise NotStandard(f"{where}: router_aux_loss, but no module of {cls.__name__}'s classes has a "
                          "load_balancing_loss_func")

    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        return _declared_path(self, spec, router_loss, {n: arguments[n] for n in plain}, arguments[varkw],
                              "logits_to_keep" in plain)
    return Forward(where, function, run, signature, "lm_head", ("model",), varkw, spec.router_aux_loss,
                   spec.base_takes_labels)


def _declared_path(self: nn.Module, spec: ModelType, router_loss: Callable[..., Any] | None, arguments: dict[str, Any],
                   extra: dict[str, Any], sliced: bool) -> Any:
    """transformers' standard causal-LM loss path, as ``register_model_type`` documents it."""
    config = self.config.get_text_config()
    labels, logits_to_keep = arguments.pop("labels"), arguments.pop("logits_to_keep", 0)
    router = arguments.pop("output_router_logits", None)
    router = config.output_router_logits if spec.router_aux_loss and router is None else router
    passed = dict(arguments, **({"labels": labels} if spec.base_takes_labels else {}),
                  **({"output_router_logits": router} if spec.router_aux_loss else {}))
    outputs = self.model(**passed, **extra)
    hidden_states = outputs.last_hidden_state
    if sliced:
        hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    if spec.softcap and (cap := getattr(config, spec.softcap)) is not None:
        logits = torch.tanh(logits / cap) * cap
    if spec.logit_scale:
        logits = logits * getattr(config, spec.logit_scale)
    if spec.logit_divisor:
        logits = logits / getattr(config, spec.logit_divisor)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.lm_head.out_features, **extra)
    fields = dict(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                  **{_CACHE: getattr(outputs, _CACHE, None)})
    if not spec.router_aux_loss:
        return CausalLMOutputWithPast(**fields)
    aux_loss = None
    if router:
        aux_loss = router_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                               arguments.get("attention_mask"))
        if labels is not None:
            fields["loss"] = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(aux_loss=aux_loss, router_logits=outputs.router_logits, **fields)
