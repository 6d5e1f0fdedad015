"""The patched forward of ``apply_losscodegen``: the model's own forward, run as written (its code, its
decorators), with two of its attributes standing in for theirs while it runs: the output layer
(``self.lm_head``) returns ``DeferredLogits`` (the hidden states and the layer, and the final-logit
transform the forward then applies, recorded), and ``self.loss_function`` is the head's loss on them. In
training the logits are never computed: the head's ``head.linear`` takes the hidden states. Outside
training the deferred logits are computed as the forward computes them (the same operations, the same
bits) and returned. Nothing of the forward's source is compiled or evaluated.

``probe`` reads the final-logit transform when the model is patched: the forward run once without labels,
its backbone standing in by a stand-in that returns empty hidden states on the meta device, so that the
deferred logits record the scales and tanh the forward applies, with the values it reads from the model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import types
import warnings
from fractions import Fraction
from typing import Any, Callable, Iterator

import torch
from torch import nn

from losscodegen.inputs import check_divisor
from losscodegen.integrations.transformers_reading import Forward

IGNORE_INDEX = -100   # ForCausalLMLoss's, and what transformers' collators pad labels with
_TANH = (torch.tanh, torch.nn.functional.tanh, torch.Tensor.tanh)
# a tensor method torch dispatches to DeferredLogits where a tensor is on the left: what it applies
_TENSOR_OPS = {"__mul__": "mul", "__rmul__": "mul", "mul": "mul", "multiply": "mul"}


class DeferredLogits:
    """What the output layer returns inside a patched forward with labels: its input ``hidden`` and the
    ``layer``, the final-logit transform applied to it since (``ops``: ``("mul" | "div", value, line)``,
    ``("tanh", function, None)``, ``("float", None, None)``), and, where the logits are wanted (outside
    training), ``raw`` (the layer's output) and ``value`` (the transform applied, as the forward applies
    it). Any other use of the logits is refused, naming it."""

    __slots__ = ("hidden", "layer", "ops", "raw", "value", "source")

    def __init__(self, hidden: torch.Tensor, layer: nn.Linear, ops: tuple, raw: torch.Tensor | None,
                 value: torch.Tensor | None, source: _DeferringLayer):
        self.hidden, self.layer, self.ops, self.raw, self.value, self.source = hidden, layer, ops, raw, value, source

    def _then(self, op: str, operand: Any, line: int | None, value: torch.Tensor | None) -> DeferredLogits:
        out = DeferredLogits(self.hidden, self.layer, self.ops + ((op, operand, line),), self.raw, value, self.source)
        self.source.latest = out
        return out

    def __mul__(self, other: Any) -> DeferredLogits:
        return self._then("mul", other, sys._getframe(1).f_lineno, None if self.value is None else self.value * other)

    def __rmul__(self, other: Any) -> DeferredLogits:
        return self._then("mul", other, sys._getframe(1).f_lineno, None if self.value is None else other * self.value)

    def __truediv__(self, other: Any) -> DeferredLogits:
        return self._then("div", other, sys._getframe(1).f_lineno, None if self.value is None else self.value / other)

    def float(self) -> DeferredLogits:
        return self._then("float", None, None, None if self.value is None else self.value.float())

    def contiguous(self) -> DeferredLogits:     # (a layout, not a value: no op)
        out = DeferredLogits(self.hidden, self.layer, self.ops, self.raw,
                             None if self.value is None else self.value.contiguous(), self.source)
        self.source.latest = out
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _TANH and len(args) == 1 and not kwargs:
            (x,) = args
            return x._then("tanh", func, None, None if x.value is None else func(x.value))
        name = getattr(func, "__name__", repr(func))
        if _TENSOR_OPS.get(name) == "mul" and len(args) == 2 and not kwargs:
            x, other = (args[1], args[0]) if isinstance(args[1], DeferredLogits) else args
            return x._then("mul", other, sys._getframe(1).f_lineno, None if x.value is None else func(*(
                a.value if a is x else a for a in args)))
        raise TypeError(f"apply_losscodegen: the forward applies {name} to the logits of its output layer, which the "
                        "head does not compute (it knows scales, a tanh and .float())")

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"apply_losscodegen: the forward reads .{name} of the logits of its output layer, which "
                             "the patched forward does not compute (it knows scales, a tanh and .float())")


class _DeferringLayer(nn.Module):
    """Stands in for the output layer during a patched forward: ``DeferredLogits`` of its input (computed
    by the layer too where ``eager``). ``latest``: the last logits derived from them (the probe's)."""

    def __init__(self, layer: nn.Linear, eager: bool):
        super().__init__()
        object.__setattr__(self, "layer", layer)      # (not a submodule: the stand-in holds no parameters)
        self.eager, self.out_features, self.latest = eager, layer.out_features, None

    def forward(self, hidden: torch.Tensor) -> DeferredLogits:
        raw = self.layer(hidden) if self.eager else None
        self.latest = DeferredLogits(hidden, self.layer, (), raw, raw, self)
        return self.latest


@contextlib.contextmanager
def _standing_in(model: nn.Module, path: tuple[str, ...], stand: nn.Module) -> Iterator[None]:
    """``model.<path>`` is ``stand`` inside (a submodule swapped in its parent's modules, then back)."""
    parent = model
    for name in path[:-1]:
        parent = getattr(parent, name)
    if not isinstance(parent, nn.Module) or path[-1] not in parent._modules:
        raise ValueError(f"apply_losscodegen: self.{'.'.join(path)} is not a submodule of the model: the patched "
                         "forward cannot stand in for it")
    held = parent._modules[path[-1]]
    parent._modules[path[-1]] = stand
    try:
        yield
    finally:
        parent._modules[path[-1]] = held


@contextlib.contextmanager
def _forward_standing_in(model: nn.Module, path: tuple[str, ...], forward: Callable[..., Any]) -> Iterator[None]:
    """``model.<path>``'s forward is ``forward`` inside (the module itself stays: the final-logit transform
    may read its attributes, Falcon-H1's ``self.model.lm_head_multiplier``)."""
    module = model
    for name in path:
        module = getattr(module, name)
    with _instance_attribute(module, "forward", forward):
        yield


@contextlib.contextmanager
def head_loss_as_loss_function(model: nn.Module, loss: Callable[..., Any]) -> Iterator[None]:
    """``model.loss_function`` is ``loss`` inside (transformers' property reads ``_loss_function``)."""
    with _instance_attribute(model, "_loss_function", loss):
        yield


@contextlib.contextmanager
def _instance_attribute(obj: object, name: str, value: Any) -> Iterator[None]:
    """``obj.<name>`` set on the instance inside (past nn.Module's __setattr__), then as it was: the
    instance's own value back, or none (the class's again)."""
    had = vars(obj).get(name, _NONE)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if had is _NONE:
            del obj.__dict__[name]
        else:
            object.__setattr__(obj, name, had)


_NONE = object()


class _ProbeOutputs:
    """The stand-in backbone's outputs: its hidden states (empty, on the meta device), None for the rest."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class FinalLogits:
    """A model's final-logit transform: as the head applies it (``softcap``, then ``logit_scale``), and as
    the forward applies it (``ops``: ``(op, value)``, read by ``probe``); ``text`` says what the forward
    does, for messages."""

    softcap: float | None = None
    logit_scale: float = 1.0
    ops: tuple[tuple[str, Any], ...] = ()
    text: str = "none"


def probe(model: nn.Module, forward: Forward) -> FinalLogits:
    """The final-logit transform ``forward`` applies on ``model``: run once without labels, its backbone
    standing in by empty hidden states (nothing is computed), folded into the head's softcap and scale.
    The forward is given one token's ids (on the meta device: forwards compare their length with the
    hidden states')."""
    layer = _DeferringLayer(linear(model, forward), eager=False)
    hidden = torch.empty(1, 1, 0, device="meta")
    arguments: dict[str, Any] = {"labels": None}
    if "input_ids" in forward.signature.parameters:
        arguments["input_ids"] = torch.zeros(1, 1, dtype=torch.long, device="meta")
    if "output_router_logits" in forward.signature.parameters:   # (the stand-in has no router logits)
        arguments["output_router_logits"] = False
    with torch.no_grad(), _forward_standing_in(model, forward.backbone, lambda *a, **k: _ProbeOutputs(hidden)), \
            _standing_in(model, (forward.head,), layer):
        try:
            forward.run(model, **arguments)
        except Exception as e:
            raise ValueError(f"apply_losscodegen: {forward.where}: run with a stand-in for its backbone (to read its "
                             f"final-logit transform) it raised {type(e).__name__}: {e}") from e
    if layer.latest is None:
        raise ValueError(f"apply_losscodegen: {forward.where}: run without labels, it did not call its output layer "
                         f"self.{forward.head}")
    return _folded(layer.latest.ops, forward)


def _folded(ops: tuple, forward: Forward) -> FinalLogits:
    """The forward's transform folded into the head's softcap and scale (``scale * c * tanh(x / c)``), or
    refused. (Exact rationals: a softcap c's 1/c and c give 1 exactly.)"""
    texts = {line: list(scales) for line, scales in forward.scales.items()}
    text, values = "logits", {}      # (the transform as the forward writes it, for messages)
    before, after, tanh = Fraction(1), Fraction(1), 0
    for op, value, line in ops:
        if op == "tanh":
            tanh += 1
            text = f"tanh({text})"
        if op not in ("mul", "div"):
            continue
        written = next((t for o, t in texts.get(line, ()) if o == op), None)
        if written is not None:
            texts[line].remove((op, written))
        name = written or repr(value)
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not math.isfinite(value) or value == 0:
            raise ValueError(
                f"apply_losscodegen: {forward.where}: the logits are {'multiplied' if op == 'mul' else 'divided'} by "
                f"{name}, {f'= {value!r}' if number else f'a {type(value).__name__}'}: the head's softcap and "
                "logit_scale are finite nonzero numbers (a tensor may be learned, and change)")
        factor = Fraction(value) if op == "mul" else 1 / Fraction(value)
        if tanh:
            after *= factor
        else:
            before *= factor
        text, values[name] = f"{text} {'*' if op == 'mul' else '/'} {name}", value
    text = "none" if not values and text == "logits" else text + "".join(
        f"{', with' if i == 0 else ','} {k} = {v!r}" for i, (k, v) in enumerate(values.items()) if k != repr(v))
    kept = tuple((op, value) for op, value, _ in ops)
    if tanh > 1:
        raise ValueError(f"apply_losscodegen: {forward.where}: the final logits go through tanh {tanh} times "
                         f"({text}): the head computes one softcap")
    if not tanh:
        return FinalLogits(None, float(before), kept, text)
    return FinalLogits(float(1 / abs(before)), float(after * before), kept, text)


def linear(model: nn.Module, forward: Forward) -> nn.Linear:
    """The output layer, an ``nn.Linear`` (whose map the head computes from its weight and bias)."""
    layer = getattr(model, forward.head, None)
    if not isinstance(layer, nn.Linear) or type(layer).forward is not nn.Linear.forward:
        raise ValueError(f"apply_losscodegen: {forward.where}: the output layer self.{forward.head} is a "
                         f"{type(layer).__name__}, not an nn.Linear (the head computes the linear layer itself from "
                         "its weight: apply_losscodegen before wrapping it, e.g. with PEFT)")
    return layer


def patched_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's forward with the head in place of its output layer, final-logit transform and loss;
    without labels, the model's own forward."""
    state = self.losscodegen
    forward: Forward = state.forward
    bound = forward.signature.bind(self, *args, **kwargs)
    extra = bound.arguments.get(forward.varkw, {})
    labels, shift_labels = bound.arguments.get("labels"), extra.get("shift_labels")
    if labels is None and shift_labels is None:
        if self.training and torch.is_grad_enabled() and not state.warned_unused:
            state.warned_unused = True
            warnings.warn("apply_losscodegen: a training forward without labels returns the logits and does not use "
                          "the head: the loss is computed outside the model (Trainer's label_smoothing_factor, "
                          "compute_loss_func, or a trainer's own loss). For label smoothing use "
                          "CrossEntropy(label_smoothing=...) in the head instead", stacklevel=3)
        return forward.function(self, *args, **kwargs)      # generation, or logits only: the model's own forward
    if labels is None:
        # shift_labels alone: the forward takes its loss branch on labels; the loss uses shift_labels as given
        bound.arguments["labels"] = nn.functional.pad(shift_labels, (1, 0), value=IGNORE_INDEX)[..., :-1]
    layer = _DeferringLayer(linear(self, forward), eager=not self.training)
    with _standing_in(self, (forward.head,), layer), \
            head_loss_as_loss_function(self, functools.partial(_head_loss, self)):
        output = forward.run(*bound.args, **bound.kwargs)
    # the logits field: None in training (never computed), else the logits as the forward computed them
    changes = {f.name: None if self.training else value.value for f in dataclasses.fields(output)
               if isinstance(value := getattr(output, f.name), DeferredLogits)}
    return dataclasses.replace(output, **changes) if changes else output


def _head_loss(model: nn.Module, logits: Any, labels: torch.Tensor, vocab_size: Any,
               num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
               shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """``model.loss_function`` during a patched forward (``ForCausalLMLoss``'s arguments): the head's loss
    from the deferred logits, labels shifted as ``ForCausalLMLoss`` shifts them."""
    state = model.losscodegen
    where = state.forward.where
    if not isinstance(logits, DeferredLogits):
        raise ValueError(f"apply_losscodegen: {where}: self.loss_function was given {type(logits).__name__}, not the "
                         f"logits of its output layer self.{state.forward.head}")
    if ignore_index != IGNORE_INDEX:
        raise ValueError(f"ignore_index={ignore_index}: the head ignores the labels transformers marks with -100")
    if vocab_size != logits.layer.out_features:
        raise ValueError(f"apply_losscodegen: {where}: the loss views the logits with vocab_size={vocab_size!r}, but "
                         f"self.{state.forward.head} has {logits.layer.out_features} outputs")
    ops = tuple((op, value) for op, value, _ in logits.ops)
    if len(ops) != len(state.final_logits.ops) or not all(
            type(a) is type(b) and a == b for got, want in zip(ops, state.final_logits.ops) for a, b in zip(got, want)):
        raise ValueError(f"apply_losscodegen: {where}: the final-logit transform is {ops} in this forward, but was "
                         f"{state.final_logits.ops} ({state.final_logits.text}) when the model was patched: the head "
                         "computes the one it was built with (patch the model again after changing its config)")
    hidden = logits.hidden
    if shift_labels is None:
        # ForCausalLMLoss: pad one ignored label at the end, then position t predicts label t + 1
        shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(hidden.device, non_blocking=True)
    valid = (shift_labels != IGNORE_INDEX).sum()
    divisor = _divisor(num_items_in_batch, valid)
    layer, head = logits.layer, state.head
    if logits.raw is None:
        out = head.linear(hidden, layer.weight, shift_labels, bias=layer.bias, divisor=divisor)
    else:
        out = head(logits.raw, shift_labels, divisor=divisor)
    state.terms, state.metrics = out.terms, out.metrics
    (state.train if model.training else state.eval).add(out, valid, num_items_in_batch)
    return out.loss


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


def rewrapped(decorated: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    """``decorated``'s decorators (each a closure over the function it wraps, as ``functools.wraps``
    writes them) around ``inner`` in place of the function they wrap: the same code, run around ours."""
    if not hasattr(decorated, "__wrapped__"):
        return inner
    wrapped = rewrapped(decorated.__wrapped__, inner)
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

