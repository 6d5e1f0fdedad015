"""Hugging Face transformers: ``apply_losscodegen(model, head=None)`` patches a causal LM instance so
that its training forwards take the loss from ``head.linear`` on the final hidden states (no
``[batch, seq, vocab]`` logits), and leaves every other forward as it was (docs/integrations-transformers.md).

Which models: any whose forward is transformers' standard causal-LM loss path, recognised from the
forward's own code (``_read``), not from a list: the backbone called on the forward's arguments, the
hidden states taken and sliced by ``slice_logits_to_keep``, an ``nn.Linear`` output layer, a final-logit
transform made of scales and one tanh (Gemma's softcap, Cohere's scale, Granite's divisor: the head
computes it, with the values the forward reads, evaluated on the model), ``self.loss_function`` being
transformers' ``ForCausalLMLoss`` on those logits and labels, a mixture-of-experts router's
load-balancing loss added as transformers writes it, and the output built from these. The patched
forward runs the forward's own statements around the output layer (its backbone call, its router loss,
its output), inside the forward's own decorators; only the output layer, the transform and the loss
become the head's. A forward with anything else is refused naming the line that differs: it would
otherwise train on a silently different objective. ``register_model_type`` declares a forward that
cannot be read. ``SUPPORTED_MODEL_TYPES``: the types checked against their unpatched forward in
tests/integrations/test_integration_models.py, and those declared. ``AutoLosscodegenForCausalLM`` and
``LosscodegenCallback`` switch the patch on without calling it; the callback logs the head's terms and
metrics into the Trainer's logs.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import math
import sys
import textwrap
import types
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
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
                _read(cls, None)
            except _NotStandard:
                continue
            return f"{model_type!r} is supported already: {cls.__name__}'s forward reads as the standard path"
    return ""


# ---- reading a forward ---------------------------------------------------------------------------

class _NotStandard(Exception):
    """A forward that is not transformers' standard causal-LM loss path: the message says where."""


@dataclass(frozen=True)
class _Forward:
    """A forward read as transformers' standard causal-LM loss path (``_read``). The statements before
    the output layer and after the loss run as the forward writes them (compiled from its code, in its
    module's names); the output layer, the final-logit transform and the loss are the head's."""

    where: str                                   # "Gemma2ForCausalLM.forward (gemma2/modeling_gemma2.py)"
    function: Callable[..., Any]                 # the forward itself (undecorated)
    signature: inspect.Signature
    names: dict[str, Any]                        # the names its code sees (its module's)
    before: tuple[types.CodeType, ...]           # the backbone and the hidden states, as written
    hidden: str                                  # the local the output layer is applied to
    head: str                                    # the output layer: self.<head>
    transform: tuple[tuple, ...]                 # the final-logit transform, evaluated on the model (``_final``)
    vocab_size: tuple[types.CodeType, str]       # the loss's vocab_size (the output layer's out_features)
    labels: str                                  # the labels parameter
    varkw: str                                   # the **kwargs parameter (num_items_in_batch, shift_labels)
    logits: str
    loss: str
    # the router's load-balancing loss: its condition, `aux = f(...)`, aux's local, its coefficient
    router: tuple[types.CodeType, types.CodeType, str, types.CodeType] | None
    result: types.CodeType                       # the return's expression
    base_takes_labels: bool                      # (the labels reach the backbone)

    def __deepcopy__(self, memo: dict) -> _Forward:
        return self       # (code and a module's names, the same for a copy of the model)


@dataclass(frozen=True)
class FinalLogits:
    """A model's final-logit transform: as the head applies it (``softcap``, then ``logit_scale``), and as
    the model's forward writes it (``ops``, applied by ``apply`` to the logits returned outside training,
    to the same bits); ``text`` says what the forward does, for messages."""

    softcap: float | None = None
    logit_scale: float = 1.0
    ops: tuple[tuple[str, Any], ...] = ()
    text: str = "none"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        for op, value in self.ops:
            x = x.float() if op == "float" else value(x) if op == "tanh" else x * value if op == "mul" else x / value
        return x


_TANH = (torch.tanh, torch.nn.functional.tanh)


def _read_function(function: Callable[..., Any], where: str) -> _Forward:
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError) as e:
        raise _NotStandard(f"{where}: its source cannot be read ({e})") from None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise _NotStandard(f"{where}: not a function")
    return _Reader(definition.body, function, function.__globals__, where,
                   inspect.getsourcefile(function) or "<forward>").read()


@functools.lru_cache(maxsize=None)
def _read(cls: type, declared: ModelType | None) -> _Forward:
    """``cls``'s forward (undecorated) read as the standard path (``_NotStandard`` where it is not), or with
    ``declared``, the forward ``register_model_type`` declares for it, read the same way."""
    function = inspect.unwrap(cls.forward)
    name = function.__qualname__
    module = sys.modules.get(function.__module__)
    short = "/".join((getattr(module, "__file__", None) or "?").split("/")[-2:])
    if declared is None:
        return _read_function(function, f"{name} ({short})")
    names, body = _declared_forward(cls, function, declared)
    tree = ast.parse(body)
    return _Reader(tree.body, function, names, f"the forward register_model_type declares for {name}",
                   "<declared forward>").read()


def _declared_forward(cls: type, function: Callable[..., Any], spec: ModelType) -> tuple[dict[str, Any], str]:
    """The code of the forward ``spec`` declares, for ``function``'s arguments, and the names it sees (its
    module's; the router's ``load_balancing_loss_func`` of the first class of ``cls``'s whose module has one)."""
    parameters = inspect.signature(function).parameters
    plain = [p.name for p in parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    varkw = next((p.name for p in parameters.values() if p.kind == p.VAR_KEYWORD), None)
    if varkw is None or "labels" not in plain:
        raise _NotStandard(f"{function.__qualname__} takes no labels and **kwargs: not a causal LM's forward")
    lines, config = [], "self.config.get_text_config()"
    router = "output_router_logits" if "output_router_logits" in plain else f"{config}.output_router_logits"
    if spec.router_aux_loss and router == "output_router_logits":
        lines.append(f"output_router_logits = output_router_logits if output_router_logits is not None else "
                     f"{config}.output_router_logits")
    passed = [f"{n}={n}" for n in plain if n not in ("labels", "logits_to_keep", "output_router_logits")]
    passed += ["labels=labels"] * spec.base_takes_labels + [f"output_router_logits={router}"] * spec.router_aux_loss
    lines += [f"outputs = self.model({', '.join(passed + ['**' + varkw])})",
              "hidden_states = outputs.last_hidden_state"]
    if "logits_to_keep" in plain:
        lines.append("hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)")
    lines.append("logits = self.lm_head(hidden_states)")
    if spec.softcap:
        cap = f"{config}.{spec.softcap}"
        lines += [f"if {cap} is not None:", f"    logits = logits / {cap}", "    logits = torch.tanh(logits)",
                  f"    logits = logits * {cap}"]
    if spec.logit_scale:
        lines.append(f"logits = logits * {config}.{spec.logit_scale}")
    if spec.logit_divisor:
        lines.append(f"logits = logits / {config}.{spec.logit_divisor}")
    lines += ["loss = None", "if labels is not None:",
              f"    loss = self.loss_function(logits, labels, self.lm_head.out_features, **{varkw})"]
    fields = ["loss=loss", "logits=logits", f"{_CACHE}=getattr(outputs, {_CACHE!r}, None)",
              "hidden_states=outputs.hidden_states", "attentions=outputs.attentions"]
    if spec.router_aux_loss:
        lines += ["aux_loss = None", f"if {router}:",
                  "    aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, "
                  "self.num_experts_per_tok, attention_mask)",
                  "    if labels is not None:", "        loss += self.router_aux_loss_coef * aux_loss.to(loss.device)"]
        fields += ["aux_loss=aux_loss", "router_logits=outputs.router_logits"]
    output = "MoeCausalLMOutputWithPast" if spec.router_aux_loss else "CausalLMOutputWithPast"
    lines.append(f"return {output}({', '.join(fields)})")
    router_loss = next((f for c in cls.__mro__ if (f := getattr(sys.modules.get(c.__module__),
                                                               "load_balancing_loss_func", None)) is not None), None)
    names = {**vars(sys.modules[function.__module__]), "slice_logits_to_keep": slice_logits_to_keep,
             "torch": torch, "CausalLMOutputWithPast": CausalLMOutputWithPast,
             "MoeCausalLMOutputWithPast": MoeCausalLMOutputWithPast}
    if spec.router_aux_loss and router_loss is not None:
        names["load_balancing_loss_func"] = router_loss
    return names, "\n".join(lines)


_PASSING = (ast.Name, ast.Attribute, ast.Constant, ast.Subscript, ast.Slice, ast.Tuple, ast.Compare, ast.IfExp,
            ast.BoolOp, ast.UnaryOp, ast.Call, ast.keyword, ast.Load, ast.Store, ast.NamedExpr, ast.cmpop, ast.boolop,
            ast.unaryop, ast.expr_context)


class _Reader:
    """Reads a forward's statements in order against transformers' standard causal-LM loss path (the
    forward ``LlamaForCausalLM`` has, and the variations transformers' families write), raising
    ``_NotStandard`` at the first statement that is not part of it."""

    def __init__(self, body: list[ast.stmt], function: Callable[..., Any], names: dict[str, Any], where: str,
                 file: str):
        self.function, self.names, self.where, self.file = function, names, where, file
        self.signature = inspect.signature(function)
        params = self.signature.parameters
        self.varkw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
        self.params = {p for p in params if params[p].kind != params[p].VAR_POSITIONAL}
        self.known = set(self.params)    # the locals a statement run as written may read
        self.body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        self.at = 0

    # -- messages
    def fail(self, node: ast.AST, why: str) -> None:
        text = ast.unparse(node).splitlines()[0]
        line = getattr(node, "lineno", None)
        raise _NotStandard(f"{self.where}{'' if line is None else f', line {line}'}: `{text}`: {why}")

    def code(self, node: ast.AST, mode: str = "eval") -> types.CodeType:
        """``node`` compiled (an expression, or a statement with ``exec``), its lines the forward's."""
        tree = ast.Expression(node) if mode == "eval" else ast.Module([node], [])
        return compile(tree, self.file, mode)

    @staticmethod
    def assignment(name: str, value: ast.expr, where: ast.stmt) -> ast.Assign:
        """``name = value`` at ``where``'s lines (an annotated assignment's annotation left out)."""
        stmt = ast.Assign([ast.Name(name, ast.Store())], value)
        for node in (stmt, stmt.targets[0]):
            ast.copy_location(node, where)
        return stmt

    # -- expressions
    def resolve(self, node: ast.expr) -> Any:
        """The object a dotted global name (``torch.tanh``) is in the forward's module, or None."""
        if isinstance(node, ast.Name):
            return self.names[node.id] if node.id in self.names else getattr(builtins, node.id, None)
        if isinstance(node, ast.Attribute):
            return getattr(self.resolve(node.value), node.attr, None)
        return None

    def passing(self, node: ast.AST, names: set[str], why: str) -> None:
        """``node`` only reads ``names`` and their attributes, items and comparisons (and the config's
        ``get_text_config()``, ``getattr``): nothing it runs can touch the logits or the loss."""
        allowed_calls = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                config = isinstance(sub.func, ast.Attribute) and sub.func.attr == "get_text_config"
                attribute = isinstance(sub.func, ast.Name) and sub.func.id not in self.known \
                    and self.resolve(sub.func) is getattr and len(sub.args) in (2, 3)
                if not (config and not sub.args or attribute) or sub.keywords:
                    self.fail(node, why)
                allowed_calls.add(id(sub.func))
            elif not isinstance(sub, _PASSING):
                self.fail(node, why)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in names \
                    and id(sub) not in allowed_calls:
                self.fail(node, f"{why} (it reads {sub.id})")

    def value(self, node: ast.expr, local: set[str]) -> types.CodeType:
        """A value the final-logit transform reads from the model (evaluated when it is patched)."""
        self.passing(node, {"self"} | local, "the logits are transformed by a value that is not an attribute "
                                              "of the model or its config")
        return self.code(node)

    @staticmethod
    def is_name(node: ast.AST, name: str | None = None) -> bool:
        return isinstance(node, ast.Name) and (name is None or node.id == name)

    @staticmethod
    def assigned(stmt: ast.stmt) -> tuple[str, ast.expr] | None:
        """``name = value`` (annotated or not): (name, value)."""
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            return stmt.targets[0].id, stmt.value
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            return stmt.target.id, stmt.value
        return None

    def labels_test(self, node: ast.expr) -> bool:
        return (isinstance(node, ast.Compare) and self.is_name(node.left, "labels") and len(node.ops) == 1
                and isinstance(node.ops[0], ast.IsNot) and isinstance(node.comparators[0], ast.Constant)
                and node.comparators[0].value is None)

    def next(self) -> ast.stmt | None:
        return self.body[self.at] if self.at < len(self.body) else None

    # -- the path, in order
    def read(self) -> _Forward:
        if self.varkw is None or "labels" not in self.params:
            raise _NotStandard(f"{self.where}: takes no labels and **kwargs: not a causal LM's forward")
        before = self.read_backbone()
        hidden = self.read_hidden(before)
        head, logits, transform, loss = self.read_logits(hidden)
        vocab_size, loss = self.read_loss(logits, loss)
        router = self.read_router(loss)
        result = self.read_result(logits, loss, router[2] if router else None)
        return _Forward(self.where, self.function, self.signature, self.names, tuple(before), self.hidden, head,
                        transform, vocab_size, "labels", self.varkw, logits, loss, router, result,
                        self.base_takes_labels)

    def read_backbone(self) -> list[types.CodeType]:
        before = []
        # `x = x if x is not None else self.config.x`: an argument's default from the config
        while (stmt := self.next()) is not None and (got := self.assigned(stmt)) and isinstance(got[1], ast.IfExp) \
                and got[0] in self.params and self.is_name(got[1].body, got[0]):
            self.passing(got[1].test, self.known, "not an argument's default")
            self.passing(got[1].orelse, {"self"}, "an argument's default that is not read from the model")
            before.append(self.code(self.assignment(got[0], got[1], stmt), "exec"))
            self.at += 1
        stmt = self.next()
        got = stmt and self.assigned(stmt)
        if not got or not isinstance(got[1], ast.Call) or not isinstance(got[1].func, ast.Attribute):
            self.fail(stmt or ast.Pass(), "expected the backbone's call, `outputs = self.model(...)`")
        call = got[1]
        chain = call.func
        while isinstance(chain, ast.Attribute):
            chain = chain.value
        if not self.is_name(chain, "self"):
            self.fail(stmt, "expected the backbone's call, `outputs = self.model(...)`")
        for arg in [*call.args, *(k.value for k in call.keywords if k.arg is not None)]:
            self.passing(arg, self.known, "the backbone is given something other than the forward's arguments")
        if any(k.arg is None and not self.is_name(k.value, self.varkw) for k in call.keywords):
            self.fail(stmt, f"the backbone is given ** of something other than **{self.varkw}")
        self.base_takes_labels = any(self.is_name(n, "labels") for n in ast.walk(call))
        before.append(self.code(self.assignment(got[0], call, stmt), "exec"))
        self.outputs = got[0]
        self.known.add(got[0])
        self.at += 1
        return before

    def hidden_step(self, stmt: ast.stmt, hidden: set[str]) -> str | None:
        """``stmt`` takes or slices the backbone's hidden states: the local it assigns (None if it does not)."""
        got = self.assigned(stmt)
        if not got:
            return None

        def taken(node: ast.expr) -> bool:   # outputs.last_hidden_state, outputs[0], or a local holding them
            return (isinstance(node, ast.Attribute) and self.is_name(node.value, self.outputs)
                    and node.attr == "last_hidden_state") or (
                isinstance(node, ast.Subscript) and self.is_name(node.value, self.outputs)
                and isinstance(node.slice, ast.Constant) and node.slice.value == 0) or (
                isinstance(node, ast.Name) and node.id in hidden)
        value = got[1]
        if taken(value) and not isinstance(value, ast.Name):
            return got[0]
        if isinstance(value, ast.Call) and self.resolve(value.func) is slice_logits_to_keep \
                and len(value.args) == 2 and not value.keywords and taken(value.args[0]):
            self.passing(value.args[1], self.known, "the hidden states are sliced by something other than an argument")
            return got[0]
        return None

    def read_hidden(self, before: list[types.CodeType]) -> set[str]:
        hidden: set[str] = set()
        while (stmt := self.next()) is not None:
            if isinstance(stmt, ast.If) and not stmt.orelse and stmt.body and all(
                    self.hidden_step(s, hidden) for s in stmt.body):
                self.passing(stmt.test, self.known | hidden, "the hidden states are sliced under a condition that "
                                                             "reads something other than the arguments")
                hidden |= {self.assigned(s)[0] for s in stmt.body}
            elif (name := self.hidden_step(stmt, hidden)) is not None:
                hidden.add(name)
            else:
                break
            self.known |= hidden
            before.append(self.code(stmt, "exec"))
            self.at += 1
        return hidden

    def logits_expr(self, node: ast.expr, current: str | None, hidden: set[str], local: set[str]) -> list[tuple]:
        """The ops a logits expression applies, in order: ("head", attr, hidden) first (the output layer's
        call), then ("mul"/"div", value code, text), ("tanh", function), ("float",)."""
        if current is not None and self.is_name(node, current):
            return []
        if current is None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and self.is_name(node.func.value, "self") and len(node.args) == 1 and not node.keywords \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in hidden:
            return [("head", node.func.attr, node.args[0].id)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "float", "contiguous") and not node.args and not node.keywords:     # (the loss upcasts them anyway)
            ops = self.logits_expr(node.func.value, current, hidden, local)
            return ops + [("float",)] * (node.func.attr == "float")
        if isinstance(node, ast.Call) and self.resolve(node.func) in _TANH and len(node.args) == 1 \
                and not node.keywords:
            return [*self.logits_expr(node.args[0], current, hidden, local), ("tanh", self.resolve(node.func))]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            for logits, other in ((node.left, node.right), (node.right, node.left)):
                if other is node.left and isinstance(node.op, ast.Div):
                    break
                try:
                    ops = self.logits_expr(logits, current, hidden, local)
                except _NotStandard:
                    continue
                return [*ops, ("mul" if isinstance(node.op, ast.Mult) else "div", self.value(other, local),
                               ast.unparse(other))]
        self.fail(node, "the logits are computed or transformed in a way the head does not compute (it knows an "
                        "nn.Linear output layer, scales and a tanh softcap)")

    def read_logits(self, hidden: set[str]) -> tuple[str, str, tuple, str | None]:
        """The output layer's call and the final-logit transform: ("ops", [op, ...]), ("let", name, code,
        text) (a value the transform reads), ("if", code, text, [item, ...]), evaluated on the model."""
        stmt = self.next()
        got = stmt and self.assigned(stmt)
        if not got:
            self.fail(stmt or ast.Pass(), "expected the output layer's call, `logits = self.lm_head(hidden_states)`")
        try:
            ops = self.logits_expr(got[1], None, hidden, set())
        except _NotStandard:
            ops = []
        if not ops or ops[0][0] != "head":
            self.fail(stmt, "expected the output layer applied to the hidden states the backbone returned, "
                            "`logits = self.lm_head(hidden_states)` (then scaled or softcapped)")
        (_, head, self.hidden), logits = ops[0], got[0]
        self.at += 1
        transform, local, loss = [("ops", tuple(ops[1:]))], set(), None

        def statement(stmt: ast.stmt) -> tuple:
            got = self.assigned(stmt)
            if got and got[0] == logits:
                return ("ops", tuple(self.logits_expr(got[1], logits, set(), local)))
            if got and got[0] not in self.known | {logits}:
                item = ("let", got[0], self.value(got[1], local), ast.unparse(got[1]))
                local.add(got[0])
                return item
            if isinstance(stmt, ast.If) and not stmt.orelse:
                local.update(sub.target.id for sub in ast.walk(stmt.test) if isinstance(sub, ast.NamedExpr))
                return ("if", self.value(stmt.test, local), ast.unparse(stmt.test),
                        tuple(statement(s) for s in stmt.body))
            self.fail(stmt, "not part of the standard path between the output layer and the loss")
        while (stmt := self.next()) is not None and not (isinstance(stmt, ast.If) and self.labels_test(stmt.test)):
            got = self.assigned(stmt)
            if got and isinstance(got[1], ast.Constant) and got[1].value is None and got[0] not in self.known:
                loss = got[0]            # `loss = None`
            else:
                transform.append(statement(stmt))
            self.at += 1
        return head, logits, tuple(transform), loss

    def read_loss(self, logits: str, loss: str | None) -> tuple[tuple[types.CodeType, str], str]:
        stmt = self.next()
        if stmt is None or not isinstance(stmt, ast.If) or not self.labels_test(stmt.test) or stmt.orelse:
            self.fail(stmt or ast.Pass(), "expected `if labels is not None: loss = self.loss_function(logits, labels, "
                                          "...)`")
        got = self.assigned(stmt.body[0])
        call = got and got[1]
        if len(stmt.body) != 1 or not isinstance(call, ast.Call) or not (
                isinstance(call.func, ast.Attribute) and call.func.attr == "loss_function"
                and self.is_name(call.func.value, "self")):
            self.fail(stmt.body[-1] if len(stmt.body) > 1 else stmt.body[0],
                      "the loss is not `self.loss_function(logits, labels, ...)` alone")
        if loss is not None and got[0] != loss:
            self.fail(stmt.body[0], "the loss is assigned to another name than the one the forward returns")
        spread = [k for k in call.keywords if k.arg is None]
        if len(spread) != 1 or not self.is_name(spread[0].value, self.varkw):
            self.fail(call, f"the loss is not given the forward's **{self.varkw} (num_items_in_batch, shift_labels)")
        try:
            bound = inspect.signature(ForCausalLMLoss).bind(*call.args, **{k.arg: k.value for k in call.keywords
                                                                           if k.arg is not None})
        except TypeError as e:
            self.fail(call, f"not a call of transformers' ForCausalLMLoss ({e})")
        if not self.is_name(bound.arguments["logits"], logits) or not self.is_name(bound.arguments["labels"], "labels"):
            self.fail(call, f"the loss is not computed on the logits ({logits}) and the labels")
        named = set(bound.arguments) - {"logits", "labels", "vocab_size", "kwargs"}
        if named:
            self.fail(call, f"the loss is given {', '.join(sorted(named))} of its own")
        self.at += 1
        vocab = bound.arguments["vocab_size"]
        return (self.value(vocab, set()), ast.unparse(vocab)), got[0]

    def read_router(self, loss: str) -> tuple | None:
        stmt = self.next()
        got = stmt and self.assigned(stmt)
        if not (got and isinstance(got[1], ast.Constant) and got[1].value is None):
            return None
        aux = got[0]
        self.at += 1
        stmt = self.next()
        shape = "expected the router's load-balancing loss as transformers adds it (`if output_router_logits: " \
                "aux_loss = load_balancing_loss_func(...); if labels is not None: loss += coef * aux_loss.to(...)`)"
        if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 2:
            self.fail(stmt or ast.Pass(), shape)
        self.passing(stmt.test, self.known, shape)
        got = self.assigned(stmt.body[0])
        if not got or got[0] != aux or not isinstance(got[1], ast.Call) or not isinstance(got[1].func, ast.Name) \
                or not callable(self.resolve(got[1].func)):
            self.fail(stmt.body[0], shape)
        for arg in [*got[1].args, *(k.value for k in got[1].keywords)]:
            self.passing(arg, self.known, "the router's loss reads something other than the model, the "
                                                   "arguments and the backbone's outputs")
        inner = stmt.body[1]
        add = inner.body[0] if isinstance(inner, ast.If) and len(inner.body) == 1 and not inner.orelse else None
        if not (isinstance(inner, ast.If) and self.labels_test(inner.test) and isinstance(add, ast.AugAssign)
                and self.is_name(add.target, loss) and isinstance(add.op, ast.Add)
                and isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Mult)
                and ast.unparse(add.value.right) == f"{aux}.to({loss}.device)"):
            self.fail(inner, shape)
        self.passing(add.value.left, {"self"}, shape)
        self.at += 1
        self.known.add(aux)
        return self.code(stmt.test), self.code(stmt.body[0], "exec"), aux, self.code(add.value.left)

    def read_result(self, logits: str, loss: str, aux: str | None) -> types.CodeType:
        stmt = self.next()
        if not isinstance(stmt, ast.Return) or not isinstance(stmt.value, ast.Call) or stmt.value.args \
                or not isinstance(self.resolve(stmt.value.func), type):
            self.fail(stmt or ast.Pass(), "expected `return <output class>(loss=loss, logits=logits, ...)`")
        owned = {"loss": loss, "logits": logits, "aux_loss": aux}
        for k in stmt.value.keywords:
            if k.arg in owned and owned[k.arg] is not None and self.is_name(k.value, owned[k.arg]):
                continue
            self.passing(k.value, self.known, "the output holds the logits or the loss in another "
                                                               "field, or something the backbone did not return")
        if self.at != len(self.body) - 1:
            self.fail(self.body[self.at + 1], "a statement after the return")
        return self.code(stmt.value)


def _evaluate(code: types.CodeType, text: str, forward: _Forward, env: dict) -> Any:
    """A value the forward reads from the model (its final-logit transform, its loss's vocab_size)."""
    try:
        return eval(code, forward.names, env)
    except Exception as e:
        raise ValueError(f"apply_losscodegen: {forward.where}: evaluating `{text}` on this model raised "
                         f"{type(e).__name__}: {e}") from e


def _final(model: nn.Module, forward: _Forward) -> FinalLogits:
    """The forward's final-logit transform on ``model``: its values read as the forward reads them, folded
    into the head's softcap and scale (``scale * c * tanh(x / c)``), or refused."""
    env: dict[str, Any] = {"self": model}
    ops: list[tuple[str, Any]] = []
    text, values = "logits", {}      # (the transform as the forward writes it, for messages)

    def run(items: tuple) -> None:
        nonlocal text
        for item in items:
            if item[0] == "let":
                env[item[1]] = _evaluate(item[2], item[3], forward, env)
            elif item[0] == "if":
                if _evaluate(item[1], item[2], forward, env):
                    run(item[3])
            else:
                for op in item[1]:
                    if op[0] not in ("mul", "div"):
                        ops.append((op[0], op[1] if op[0] == "tanh" else None))
                        text = f"tanh({text})" if op[0] == "tanh" else text
                        continue
                    value = _evaluate(op[1], op[2], forward, env)
                    number = not isinstance(value, bool) and isinstance(value, (int, float))
                    if not number or not math.isfinite(value) or value == 0:
                        raise ValueError(
                            f"apply_losscodegen: {forward.where}: the logits are "
                            f"{'multiplied' if op[0] == 'mul' else 'divided'} by {op[2]}, "
                            f"{f'= {value!r}' if number else f'a {type(value).__name__}'}: the head's softcap and "
                            "logit_scale are finite nonzero numbers (a tensor may be learned, and change)")
                    ops.append((op[0], value))
                    text, values[op[2]] = f"{text} {'*' if op[0] == 'mul' else '/'} {op[2]}", value
    run(forward.transform)
    # fold: a2 * tanh(a1 * x) (exact rationals: a softcap c's 1/c and c give 1 exactly)
    before, after, tanh = Fraction(1), Fraction(1), 0
    for op, value in ops:
        if op == "tanh":
            tanh += 1
        elif op != "float":
            factor = Fraction(value) if op == "mul" else 1 / Fraction(value)
            if tanh:
                after *= factor
            else:
                before *= factor
    text = "none" if not values and text == "logits" else text + "".join(
        f"{', with' if i == 0 else ','} {k} = {v!r}" for i, (k, v) in enumerate(values.items()))
    if tanh > 1:
        raise ValueError(f"apply_losscodegen: {forward.where}: the final logits go through tanh {tanh} times "
                         f"({text}): the head computes one softcap")
    if not tanh:
        return FinalLogits(None, float(before), tuple(ops), text)
    return FinalLogits(float(1 / abs(before)), float(after * before), tuple(ops), text)


def _linear(model: nn.Module, forward: _Forward) -> nn.Linear:
    """The output layer, an ``nn.Linear`` (whose map the head computes from its weight and bias)."""
    layer = getattr(model, forward.head, None)
    if not isinstance(layer, nn.Linear) or type(layer).forward is not nn.Linear.forward:
        raise ValueError(f"apply_losscodegen: {forward.where}: the output layer self.{forward.head} is a "
                         f"{type(layer).__name__}, not an nn.Linear (the head computes the linear layer itself from "
                         "its weight: apply_losscodegen before wrapping it, e.g. with PEFT)")
    return layer


def _output_layer(model: nn.Module, forward: _Forward) -> nn.Linear:
    layer = _linear(model, forward)
    vocab = _evaluate(*forward.vocab_size, forward, {"self": model})
    if vocab != layer.out_features:
        raise ValueError(f"apply_losscodegen: {forward.where}: the loss views the logits with vocab_size "
                         f"{forward.vocab_size[1]} = {vocab!r}, but self.{forward.head} has {layer.out_features} "
                         "outputs")
    return layer


def _loss_function(model: nn.Module) -> Any:
    """What ``model.loss_function`` is (as transformers' property resolves it, without its warning)."""
    if inspect.getattr_static(type(model), "loss_function", None) is not \
            inspect.getattr_static(transformers.PreTrainedModel, "loss_function"):
        return inspect.getattr_static(type(model), "loss_function")
    if "_loss_function" in vars(model):
        return vars(model)["_loss_function"]
    loss_type = getattr(model, "loss_type", None)
    return LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM")


def _forward_of(model: nn.Module) -> tuple[_Forward, FinalLogits]:
    """How ``model``'s forward computes its loss: read from its code, else its type's declaration."""
    cls, model_type = type(model), getattr(model.config, "model_type", None)
    declaration = _MODEL_TYPES.get(model_type)

    def declared() -> _Forward:
        try:
            return _read(cls, declaration)
        except _NotStandard as e:
            raise ValueError(f"apply_losscodegen: register_model_type({model_type!r}, ...) cannot serve "
                             f"{cls.__name__}: {e}") from None
    try:
        forward = _read(cls, None)
    except _NotStandard as e:
        if declaration is None:
            raise ValueError(f"apply_losscodegen: {cls.__name__} (model type {model_type!r}) does not follow "
                             f"transformers' standard causal-LM loss path: {e}. A forward that differs would train on "
                             "a different objective; if you have checked that this one computes the standard loss, "
                             "register_model_type declares it") from None
        forward = declared()
        return forward, _final(model, forward)
    final = _final(model, forward)
    if declaration is not None:     # a declaration must not contradict the forward's own code
        other = declared()
        other_final = _final(model, other)
        differs = [f"{name}: declared {d}, the forward's {f}" for name, d, f in (
            ("softcap", other_final.softcap, final.softcap), ("logit_scale", other_final.logit_scale, final.logit_scale),
            ("router_aux_loss", other.router is not None, forward.router is not None),
            ("base_takes_labels", other.base_takes_labels, forward.base_takes_labels)) if d != f]
        if differs:
            raise ValueError(f"apply_losscodegen: register_model_type({model_type!r}, ...) contradicts "
                             f"{forward.where}, which reads as the standard path: {'; '.join(differs)}")
    return forward, final


def _rewrapped(decorated: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    """``decorated``'s decorators (each a closure over the function it wraps, as ``functools.wraps``
    writes them) around ``inner`` in place of the function they wrap: the same code, run around ours."""
    if not hasattr(decorated, "__wrapped__"):
        return inner
    wrapped = _rewrapped(decorated.__wrapped__, inner)
    cells = list(decorated.__closure__ or ())
    held = []
    for i, cell in enumerate(cells):
        try:
            if cell.cell_contents is decorated.__wrapped__:
                held.append(i)
        except ValueError:        # (an empty cell)
            pass
    if len(held) != 1:
        raise ValueError(f"apply_losscodegen: the forward's decorator {decorated.__qualname__} does not hold the "
                         "function it wraps as functools.wraps closures do: it cannot be kept around the patch")
    cells[held[0]] = types.CellType(wrapped)
    clone = types.FunctionType(decorated.__code__, decorated.__globals__, decorated.__name__,
                               decorated.__defaults__, tuple(cells))
    clone.__kwdefaults__ = decorated.__kwdefaults__
    clone.__dict__.update(vars(decorated))
    clone.__wrapped__ = wrapped
    return clone


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
    forward: _Forward                    # the model's forward, as read
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
    forward, final = _forward_of(model)
    _output_layer(model, forward)
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
        return _forward(self, *args, **kwargs)
    # The forward's own decorators (returning a tuple on return_dict=False, renamed arguments, the
    # config's defaults) run around it as around the model's. The Trainer reads the forward's parameters
    # (the columns it keeps, whether it takes num_items_in_batch): the model's own. A function of this
    # instance's, bound to it, so that a deepcopy of the model is bound to the copy.
    patched.__signature__ = forward.signature
    object.__setattr__(model, "forward", types.MethodType(_rewrapped(type(model).forward, patched), model))
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
    if head.ignore_index != _IGNORE_INDEX:
        raise ValueError(f"head.ignore_index={head.ignore_index}: transformers marks ignored labels with -100")
    if not head.loss_terms:
        raise ValueError("head has no loss terms (metrics only): a training forward needs a loss")


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched forward: the model's statements before its output layer and after its loss, as its
    forward writes them; the head in place of the output layer, the final-logit transform and the loss."""
    state: LosscodegenState = self.losscodegen
    forward = state.forward
    env = forward.signature.bind(self, *args, **kwargs)
    env.apply_defaults()
    env = dict(env.arguments)
    extra = env[forward.varkw]
    labels, shift_labels = env[forward.labels], extra.get("shift_labels")
    if labels is None and shift_labels is None:
        if self.training and torch.is_grad_enabled() and not state.warned_unused:
            state.warned_unused = True
            warnings.warn("apply_losscodegen: a training forward without labels returns the logits and does not use "
                          "the head: the loss is computed outside the model (Trainer's label_smoothing_factor, "
                          "compute_loss_func, or a trainer's own loss). For label smoothing use "
                          "CrossEntropy(label_smoothing=...) in the head instead", stacklevel=3)
        return forward.function(self, *args, **kwargs)      # generation, or logits only: the model's own forward
    if extra.get("ignore_index", _IGNORE_INDEX) != _IGNORE_INDEX:
        raise ValueError(f"ignore_index={extra['ignore_index']}: the head ignores the labels transformers marks "
                         "with -100")
    for code in forward.before:        # the backbone, the hidden states
        exec(code, forward.names, env)
    hidden = env[forward.hidden]
    if shift_labels is None:
        # ForCausalLMLoss: pad one ignored label at the end, then position t predicts label t + 1
        shift_labels = nn.functional.pad(labels, (0, 1), value=_IGNORE_INDEX)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    num_items_in_batch = extra.get("num_items_in_batch")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(hidden.device, non_blocking=True)
    valid = (shift_labels != _IGNORE_INDEX).sum()
    divisor = _divisor(num_items_in_batch, valid)
    head, lm_head = state.head, _linear(self, forward)    # (a layer wrapped since, by PEFT say, is refused)
    logits = None
    if self.training:
        out = head.linear(hidden, lm_head.weight, shift_labels, bias=lm_head.bias, divisor=divisor)
    else:
        raw = lm_head(hidden)
        out = head(raw, shift_labels, divisor=divisor)
        logits = state.final_logits.apply(raw)
    state.terms, state.metrics = out.terms, out.metrics
    (state.train if self.training else state.eval).add(out, valid, num_items_in_batch)
    env[forward.logits], env[forward.loss] = logits, out.loss
    if forward.router is not None:     # the router's load-balancing loss, as the forward adds it
        condition, assign, aux, coefficient = forward.router
        env[aux] = None
        if eval(condition, forward.names, env):
            exec(assign, forward.names, env)
            env[forward.loss] = out.loss + eval(coefficient, forward.names, env) * env[aux].to(out.loss.device)
    return eval(forward.result, forward.names, env)


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
