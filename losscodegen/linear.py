"""Fused linear heads: ``head.linear(hidden, weight, labels, ...)`` is the head on
``hidden @ weight.T + bias`` without the ``[rows, V]`` logits ever existing whole.

The rows go through in chunks. For each chunk cuBLAS writes the chunk's logits (and the teacher's)
into one buffer that every chunk reuses; the head's kernel overwrites them with dL/dlogits; two more
products write the chunk's rows of dL/dhidden and add its share to dL/dweight (and dL/dbias). So the
forward ends with every gradient known, and backward only scales them by the upstream gradient, as
``head(...)`` does. Peak memory above the inputs: the gradients, plus one chunk of logits.

- Segment terms need every row's values before any gradient: a first pass over the chunks writes
  the rows' values and segment sums, the segment kernel runs, and a second pass computes each
  chunk's logits again for its gradient (one more product of the logits' size).
- ``reduction="none"`` has upstream gradients per row (on the per-row loss and on each term's
  ``out.rows``), which must weigh dL/dlogits before the products that mix rows: the forward computes
  the values and keeps the packed stats; backward makes each chunk's logits again and runs only the
  gradient launch on them, its terms weighted per row by the upstream gradients, then the products.
- Vocab-parallel: ``weight`` (and bias, teacher weight and bias) hold this rank's vocabulary rows; the
  packed stats are exchanged once per chunk, and dL/dhidden is all-reduced over the group once.
- A teacher whose hidden states, weight or bias require grad (co-distillation): the head's
  teacher-gradient kernel writes each chunk's dL/dteacher_logits into a buffer of its own (the
  teacher's logits are read again after the gradient read, at the label's column), and the same
  products give the teacher's gradients.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from . import collectives
from .autograd import BACKWARD_TWICE, refuse_create_graph, row_outputs
from .inputs import _FLOATS, check_logits, check_rows
from .launch import Launcher

_MIN_CHUNK = 256
_TILE_ROWS = 256


@dataclass
class _Gradients:
    """One side's (the student's, or the teacher's) gradients."""

    hidden: torch.Tensor | None    # [rows, H]
    weight: torch.Tensor | None    # [V_local, H]
    bias: torch.Tensor | None      # [V_local], fp32 while accumulating


@dataclass
class _Fused:
    """One call of ``head.linear``, checked: everything needed to run its chunks (twice, under
    ``reduction="none"``)."""

    head: Any
    call: Any
    hidden: torch.Tensor                 # [rows, H]
    weight: torch.Tensor                 # [V_local, H]
    bias: torch.Tensor | None
    teacher_hidden: torch.Tensor | None  # [rows, H_t], detached
    teacher_weight: torch.Tensor | None
    teacher_bias: torch.Tensor | None
    chunk: int

    def run(self, *, grad: tuple[bool, ...] | None):
        """(loss, values, gradients or None, the launcher). ``grad``: which of hidden, weight, bias,
        teacher_hidden, teacher_weight, teacher_bias want one; the gradients: the student's and the
        teacher's (None unless the call's teacher requires grad). Under reduction="none" the
        gradients are deferred to ``backward``."""
        head, call, dev = self.head, self.call, self.hidden.device
        flags = head.checks.before(dev) if head.validate else None
        width = max(self.hidden.element_size(),
                    self.teacher_hidden.element_size() if self.teacher_hidden is not None else 0)
        launcher = Launcher(head, call, grad=grad is not None, flags=flags, dtype=self.hidden.dtype,
                            element_size=width)
        grads = self._gradients(grad) if grad is not None and not launcher.layout.deferred else None
        buffers = self._buffers()
        first, second = launcher.passes()
        for launches, last in ((first, not second), (second, True)):
            if not launches:
                continue
            for start in range(0, call.rows, self.chunk):
                stop = min(start + self.chunk, call.rows)
                x, t, dt = self._logits(start, stop, *buffers)
                with_grad = grads is not None and last
                launcher.run(launches, x, t, x if with_grad else None, row_offset=start,
                             tgrad=dt if with_grad else None)
                if with_grad:
                    self._add(grads, x, dt, start, stop)
            if launches is first:
                launcher.segments()
        if grads is not None:
            self._finish(grads)
        if flags is not None:
            head.checks.after(dev, launcher.vocab, launcher.n_seg)
        return launcher.ws.loss(call), launcher.ws.values(), grads, launcher

    def backward(self, launcher: Launcher, want: tuple[bool, ...], grad_loss: torch.Tensor | None,
                 grad_rows: list[torch.Tensor | None]) -> tuple[_Gradients, _Gradients | None]:
        """reduction="none": each chunk's logits made again, its deferred gradient launch (the stats
        kept by the forward; the terms weighted per row by the upstream gradients on the per-row loss
        and on their rows), and the products."""
        grads = self._gradients(want)
        up_loss, up_rows = launcher.upstream(grad_loss, grad_rows)
        buffers = self._buffers()
        for start in range(0, self.call.rows, self.chunk):
            stop = min(start + self.chunk, self.call.rows)
            x, t, dt = self._logits(start, stop, *buffers)
            launcher.run(launcher.deferred(), x, t, x, start, up_loss, up_rows, dt)
            self._add(grads, x, dt, start, stop)
        self._finish(grads)
        return grads

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor the chunks read (``Call.tensors``, and the products' operands)."""
        return (self.hidden, self.weight, self.bias, self.teacher_hidden, self.teacher_weight,
                self.teacher_bias, *self.call.tensors())

    def _sides(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], ...]:
        """(hidden, weight, bias) of the student, then of the teacher where its gradient is wanted."""
        student = (self.hidden, self.weight, self.bias)
        teacher = (self.teacher_hidden, self.teacher_weight, self.teacher_bias)
        return (student, teacher) if self.call.teacher_grad else (student,)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One chunk of logits (and of the teacher's, and of their gradient where the teacher
        requires grad), which every chunk reuses."""
        V, dev = self.call.V_local, self.hidden.device
        teacher = None if self.teacher_hidden is None else \
            torch.empty(self.chunk, V, dtype=self.teacher_hidden.dtype, device=dev)
        return (torch.empty(self.chunk, V, dtype=self.hidden.dtype, device=dev), teacher,
                torch.empty_like(teacher) if self.call.teacher_grad else None)

    def _logits(self, start: int, stop: int, buf: torch.Tensor, tbuf: torch.Tensor | None,
                dtbuf: torch.Tensor | None):
        """Rows [start, stop)'s logits and the teacher's, in the buffers, and the rows of the
        teacher's gradient buffer (None where it requires no grad)."""
        x = _affine(self.hidden[start:stop], self.weight, self.bias, buf[:stop - start])
        t = None if tbuf is None else _affine(self.teacher_hidden[start:stop], self.teacher_weight,
                                              self.teacher_bias, tbuf[:stop - start])
        return x, t, None if dtbuf is None else dtbuf[:stop - start]

    def _finish(self, grads: tuple[_Gradients, ...]) -> None:
        for g, (_, _, bias) in zip(grads, self._sides()):
            if g.hidden is not None and self.call.group is not None:
                collectives.all_reduce(g.hidden, self.call.group)
            if g.bias is not None:
                g.bias = g.bias.to(bias.dtype)

    def _gradients(self, want: tuple[bool, ...]) -> tuple[_Gradients, ...]:
        """The student's gradients (``want[:3]``: hidden, weight, bias), then the teacher's
        (``want[3:]``) where its gradient is wanted."""
        # (dL/dweight is written by the first chunk's product; with no rows there is no chunk, and the
        # gradient of an empty sum is 0)
        empty = torch.empty_like if self.call.rows else torch.zeros_like
        return tuple(_Gradients(torch.empty_like(hidden) if h else None, empty(weight) if w else None,
                                torch.zeros(weight.shape[0], device=weight.device) if b else None)
                     for (hidden, weight, _), (h, w, b) in zip(self._sides(), (want[:3], want[3:])))

    def _add(self, grads: tuple[_Gradients, ...], dlogits: torch.Tensor, dteacher: torch.Tensor | None,
             start: int, stop: int) -> None:
        """A chunk's dL/dlogits (and dL/dteacher_logits) into the gradients: its rows of dL/dhidden,
        its share of the others."""
        for g, d, (hidden, weight, _) in zip(grads, (dlogits, dteacher), self._sides()):
            if g.hidden is not None:
                torch.mm(d, weight, out=g.hidden[start:stop])
            if g.weight is not None:
                if start == 0:
                    torch.mm(d.t(), hidden[start:stop], out=g.weight)
                else:
                    g.weight.addmm_(d.t(), hidden[start:stop])
            if g.bias is not None:
                g.bias += d.sum(0, dtype=torch.float32)


def _affine(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``h @ w.T + b`` written into ``out``."""
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b, h, w.t(), out=out)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, fused, side):
        want = tuple(ctx.needs_input_grad[:6])
        ctx.fused, ctx.want, ctx.shape = fused, want, hidden.shape
        ctx.t_shape = None if teacher_hidden is None else teacher_hidden.shape
        loss, values, ctx.grads, launcher = fused.run(grad=want)
        ctx.mark_non_differentiable(values)
        ctx.set_materialize_grads(False)
        ctx.launcher = None
        if fused.call.reduction != "none":
            return loss, values
        # the terms' rows are outputs with a gradient (the metrics' rows leave through ``side``).
        # Backward makes the logits again and launches on them: what it reads is saved, so that an
        # input changed in place before backward fails there (torch's version check)
        ctx.launcher = launcher
        ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, *fused.tensors())
        fused.head.keep_scalars(fused.call)
        rows = row_outputs(fused.head, launcher, fused.call)
        side.append(rows)
        return (loss, values, *[rows[n] for n in fused.head.kernel.SPEC.row_loss_terms])

    @staticmethod
    def backward(ctx, grad_loss, _grad_values, *grad_rows):
        refuse_create_graph("HeadLoss.linear")
        if ctx.fused.call.reduction == "none":
            launcher, ctx.launcher = ctx.launcher, None
            if launcher is None:
                raise RuntimeError(f"HeadLoss.linear: {BACKWARD_TWICE}")
            ctx.saved_tensors
            ctx.fused.head.restore_scalars(ctx.fused.call)
            if grad_loss is None and all(g is None for g in grad_rows):
                return (None,) * 8
            grads = ctx.fused.backward(launcher, ctx.want, grad_loss, list(grad_rows))
        else:
            if grad_loss is None:
                return (None,) * 8
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError(f"HeadLoss.linear: {BACKWARD_TWICE}")
            for g in (t for side in grads for t in (side.hidden, side.weight, side.bias)):
                if g is not None:
                    ctx.fused.head.backend.scale_rows(g.view(-1, g.shape[-1]), grad_loss)
        student, teacher = grads[0], grads[1] if len(grads) > 1 else _Gradients(None, None, None)
        hidden = None if student.hidden is None else student.hidden.view(ctx.shape)
        t_hidden = None if teacher.hidden is None else teacher.hidden.view(ctx.t_shape)
        return hidden, student.weight, student.bias, t_hidden, teacher.weight, teacher.bias, None, None


def run(*args: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any]:
    """(loss, values, rows, the checked call). Eager even inside a compiled function (a graph break):
    Dynamo would trace into the chunk loop and the kernels' launches, which it cannot (docs/api.md).
    (torch.compiler.disable applied here, where Dynamo runs, not at import: it imports Dynamo, 2-3 s.)"""
    return torch.compiler.disable(_run)(*args) if torch.compiler.is_compiling() else _run(*args)


def _run(head, hidden, weight, labels, bias, teacher_hidden, teacher_weight, teacher_bias, chunk_rows,
         inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any]:
    hidden, weight, bias = _as_linear(hidden, weight, bias)
    teacher_hidden, teacher_weight, teacher_bias = _as_linear(teacher_hidden, teacher_weight, teacher_bias)
    fused = _check(head, hidden, weight, labels, bias, teacher_hidden, teacher_weight, teacher_bias,
                   chunk_rows, inputs)
    per_row = fused.call.reduction == "none"
    operands = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in operands):
        side: list = []
        loss, values, *term_rows = _LinearFunction.apply(*operands, fused, side)
        rows = {**side[0], **dict(zip(head.kernel.SPEC.row_loss_terms, term_rows))} if per_row else {}
        return loss, values, rows, fused.call
    loss, values, _, launcher = fused.run(grad=None)
    return loss, values, row_outputs(head, launcher, fused.call) if per_row else {}, fused.call


def _as_linear(hidden: Any, weight: Any, bias: Any) -> tuple[Any, Any, Any]:
    """``hidden``, ``weight`` and ``bias`` in the dtype that ``F.linear`` computes in: under autocast
    for their device, autocast's dtype (as ``F.linear``: each floating input but float64 is cast);
    otherwise, where floating dtypes still differ (bf16 hidden states, an fp32 weight), the widest
    of them, by torch's type promotion (``F.linear`` raises there: docs/decisions.md). Autograd
    records the casts, so each input's gradient comes back in its own dtype."""
    given = [t for t in (hidden, weight, bias) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not given:
        return hidden, weight, bias
    device = given[0].device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    dtypes = [autocast if autocast is not None and t.dtype != torch.float64 else t.dtype for t in given]
    if any(d not in _FLOATS for d in dtypes):
        return hidden, weight, bias     # (a dtype no head computes in: the checks name it)
    dtype = functools.reduce(torch.promote_types, dtypes)

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return cast(hidden), cast(weight), cast(bias)


def _check(head, hidden, weight, labels, bias, teacher_hidden, teacher_weight, teacher_bias, chunk_rows,
           inputs) -> _Fused:
    spec = head.kernel.SPEC
    if "teacher_logits" in inputs:
        raise TypeError("head.linear takes the teacher as teacher_hidden= and teacher_weight= "
                        "(teacher logits are made a chunk at a time), not teacher_logits=")
    if _look_swapped(hidden, weight, labels):
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} look swapped (the "
                         "labels have one label a row of weight): head.linear takes (hidden [..., H], weight "
                         "[V, H], labels [...]), the hidden states first; Liger's "
                         "LigerFusedLinearCrossEntropyLoss()(lin_weight, _input, target) takes the weight first")
    h, shape = check_logits(hidden, "hidden")
    w = _check_weight("weight", weight, h)
    b = _check_bias("bias", bias, w)
    th = tw = tb = None
    if spec.uses_teacher:
        if teacher_hidden is None or teacher_weight is None:
            raise ValueError("teacher_hidden and teacher_weight are required by "
                             + head.terms_reading("teacher_logits"))
        th, t_shape = check_logits(teacher_hidden, "teacher_hidden")
        if t_shape != shape:
            raise ValueError(f"teacher_hidden must have hidden's rows {shape}, got {t_shape}")
        th = th.detach()
        tw = _check_weight("teacher_weight", teacher_weight, th).detach()
        if tw.shape[0] != w.shape[0]:
            raise ValueError(f"teacher_weight must have weight's {w.shape[0]} vocabulary rows, got "
                             f"{tw.shape[0]}")
        tb = _check_bias("teacher_bias", teacher_bias, tw)
        tb = None if tb is None else tb.detach()
    elif teacher_hidden is not None or teacher_weight is not None:
        raise ValueError("teacher_hidden/teacher_weight given, but no term of this head reads a teacher")
    call = check_rows(head, spec, shape, w.shape[0], h.device, labels, inputs)
    # (co-distillation: the teacher's side requires grad, and gets its gradients)
    call.teacher_grad = th is not None and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (teacher_hidden, teacher_weight, teacher_bias))
    # (bytes a row of a chunk takes: its logits, the teacher's, and their gradient where wanted)
    teacher_bytes = 0 if th is None else th.element_size() * (1 + call.teacher_grad)
    per_row = w.shape[0] * (h.element_size() + teacher_bytes)
    return _Fused(head, call, h, w, b, th, tw, tb,
                  _chunk_rows(head, chunk_rows, call.rows, per_row, h.device, call.group is not None))


def _look_swapped(hidden: Any, weight: Any, labels: Any) -> bool:
    """Whether ``head.linear`` was given the output layer's [V, H] weight as ``hidden`` and the hidden
    states as ``weight`` (the order of Liger's class): the labels are shaped like ``weight``'s rows,
    unlike ``hidden``'s. Shapes only: never a wait for the device."""
    return all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)) and hidden.dim() == 2 \
        and weight.dim() >= 2 and hidden.shape[-1] == weight.shape[-1] \
        and labels.shape == weight.shape[:-1] != hidden.shape[:-1]


def _check_weight(name: str, weight: Any, hidden: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{name} must be a [V, H] tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{name} is [V, H] with H = {weight.shape[1]}, but the hidden states have "
                         f"H = {hidden.shape[1]}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"{name} must have the hidden states' dtype and device ({hidden.dtype} on "
                        f"{hidden.device}), got {weight.dtype} on {weight.device}")
    return weight


def _check_bias(name: str, bias: Any, weight: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name} must be [V] = [{weight.shape[0]}], got "
                         f"{tuple(getattr(bias, 'shape', ())) or type(bias).__name__}")
    if bias.dtype != weight.dtype or bias.device != weight.device:
        raise TypeError(f"{name} must have the weight's dtype and device ({weight.dtype} on {weight.device}), "
                        f"got {bias.dtype} on {bias.device}")
    return bias


def _chunk_rows(head, chunk_rows: Any, rows: int, bytes_per_row: int, device: torch.device,
                sharded: bool) -> int:
    """``chunk_rows``, else the most rows that the chunk budget (``head.linear_chunk_bytes``, and a
    quarter of the free device memory) holds, in a multiple of 256 rows: the three products of a
    chunk run fastest on whole tiles (measured on an H100: 1536-row chunks beat 1408-row ones by 4%)."""
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        return min(chunk_rows, max(rows, 1))
    budget = head.linear_chunk_bytes
    if device.type == "cuda" and not sharded:
        # (not when vocab-parallel: free memory differs between ranks, and every rank must run the
        # same chunks, each exchanging its stats)
        budget = min(budget, torch.cuda.mem_get_info(device)[0] // 4)
    fit = max(budget // max(bytes_per_row, 1) // _TILE_ROWS * _TILE_ROWS, _MIN_CHUNK)
    return max(min(fit, rows), 1)
