"""Autograd for heads. The forward launch also writes dL/dlogits for an upstream gradient of 1;
backward multiplies it by the real upstream gradient, on the device (``Backend.scale_rows``), so no
call waits for the host and one call supports one backward.

Eager calls go through ``_HeadFunction``. Under ``torch.compile`` a call is one opaque
``torch.library`` op, ``losscodegen::head``, with a fake implementation (the output shapes) and
registered autograd: Dynamo traces none of our Python and Inductor never compiles the generated
kernel. The op keeps its gradient buffer and returns a small handle to it instead, and the backward
op ``losscodegen::head_grad`` takes the buffer back by that handle, scales it and returns it. A
buffer saved for backward and scaled there in place would first be copied by AOTAutograd's
functionalization: one more pass over [rows, V] on every step.
"""
from __future__ import annotations

import itertools
import uuid
import weakref
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import collectives, launch
from .inputs import Call, rows_view

BACKWARD_TWICE = ("backward ran twice through the same call; its gradients are consumed by the first "
                  "(call the head again instead)")
NOT_TWICE_DIFFERENTIABLE = (
    "a head's backward is not differentiable (its gradient is computed by the kernel, not by torch "
    "ops): torch.autograd.grad(..., create_graph=True) or backward(create_graph=True) through a "
    "head is not supported; compute penalties on its gradient with a torch reference loss instead")


def refuse_create_graph(who: str) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode on inside backward): the
    gradient it returns has no graph, and a second-order result through it would be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{who}: {NOT_TWICE_DIFFERENTIABLE}")


class _HeadFunction(torch.autograd.Function):
    # One output, the loss: the values leave through ``values_out`` (an output more costs the
    # autograd engine host time in forward and in backward, and they have no gradient). ``teacher``:
    # the teacher's logits where they require grad (``Call.teacher_grad``), else None.
    @staticmethod
    def forward(ctx, logits, teacher, head, call, values_out):
        # (in place only into logits that asked for their gradient: a teacher's alone leaves them be)
        inplace = head.inplace_backward and logits.requires_grad
        loss, values, grad, launcher = launch.run(head, call, grad=True, inplace=inplace)
        if inplace:
            # The logits now hold their gradient: a node that saved them fails loudly in backward.
            torch.autograd.graph.increment_version(logits)
        ctx.grad, ctx.shape, ctx.scale_rows = grad, logits.shape, head.backend.scale_rows
        ctx.tgrad, ctx.t_shape = launcher.tgrad, None if teacher is None else teacher.shape
        values_out.append(values)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_create_graph("HeadLoss")
        grad, ctx.grad, tgrad, ctx.tgrad = ctx.grad, None, ctx.tgrad, None
        if grad is None:
            raise RuntimeError(f"HeadLoss: {BACKWARD_TWICE}")
        ctx.scale_rows(grad, grad_loss)
        if tgrad is not None:
            ctx.scale_rows(tgrad, grad_loss)
            tgrad = tgrad.view(ctx.t_shape)
        # A view even of the same shape: a new tensor over the buffer, which AccumulateGrad keeps as
        # .grad without a copy (under inplace_backward the buffer is the logits themselves, and
        # returning them would be copied: measured, peak memory +2.1 GB at 8192 x 128256).
        return grad.view(ctx.shape), tgrad, None, None, None


class _RowsFunction(torch.autograd.Function):
    # reduction="none": the per-row loss and each row term's rows are outputs with a gradient (the
    # metrics' rows and the values leave through ``out``, detached). The forward keeps the packed
    # stats; backward runs one gradient launch whose per-row term weights are the upstream gradients
    # of all of them at once (launch.backward).
    @staticmethod
    def forward(ctx, logits, teacher, head, call, out):
        loss, values, _, launcher = launch.run(head, call, grad=True, inplace=False)
        head.keep_scalars(call)
        rows = row_outputs(head, launcher, call)
        # the deferred gradient launch reads the logits and the call's inputs again: saved, so that
        # one changed in place before backward fails there (torch's version check)
        ctx.save_for_backward(logits, *call.tensors())
        ctx.launcher, ctx.shape = launcher, logits.shape
        ctx.inplace = head.inplace_backward and logits.requires_grad
        ctx.t_shape = None if teacher is None else teacher.shape
        ctx.set_materialize_grads(False)
        out += [values, rows]
        return (loss, *[rows[n] for n in head.kernel.SPEC.row_loss_terms])

    @staticmethod
    def backward(ctx, grad_loss, *grad_rows):
        refuse_create_graph("HeadLoss")
        launcher, ctx.launcher = ctx.launcher, None
        if launcher is None:
            raise RuntimeError(f"HeadLoss: {BACKWARD_TWICE}")
        logits = ctx.saved_tensors[0]       # (unpacked: an input changed in place since fails here)
        launcher.head.restore_scalars(launcher.call)
        grad = launch.backward(launcher, grad_loss, list(grad_rows), inplace=ctx.inplace)
        if ctx.inplace:
            # The logits now hold their gradient: a node that saved them, whose backward runs after
            # this one, fails loudly there (as _HeadFunction's forward does for the other reductions).
            torch.autograd.graph.increment_version(logits)
        tgrad = None if launcher.tgrad is None else launcher.tgrad.view(ctx.t_shape)
        return grad.view(ctx.shape), tgrad, None, None, None


# ``Function.apply`` without its Python wrapper, which inspects the Function and unwraps its
# arguments for torch.func on every call (4 µs a call on a fast host); under torch.func transforms
# the wrapper runs.
_apply = super(torch.autograd.Function, _HeadFunction).apply


def row_outputs(head, launcher: launch.Launcher, call: Call) -> dict[str, torch.Tensor]:
    """``out.rows`` of a reduction="none" call: each term's and metric's per-row values, labels'
    shape, detached views of the workspace (tensors of their own to autograd: in-place ops work). A row
    term of batch quantiles (S.row_quantile), evaluated row by row by the segment kernel, has its rows
    in the per-row loss only."""
    spec = head.kernel.SPEC
    rows = launcher.ws.rows(call)
    return {n: rows[spec.row_values.index(n)].detach() for n in spec.outputs if n in spec.row_values}


def eager(head, logits: torch.Tensor, call: Call,
          teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, values, rows): ``rows`` holds every output's per-row values under reduction="none".
    ``teacher``: the teacher's logits as given, where they require grad (``Call.teacher_grad``)."""
    per_row = call.reduction == "none"
    if (logits.requires_grad or call.teacher_grad) and torch.is_grad_enabled():
        side: list = []
        if per_row:
            loss, *term_rows = _RowsFunction.apply(logits, teacher, head, call, side)
            return loss, side[0], {**side[1], **dict(zip(head.kernel.SPEC.row_loss_terms, term_rows))}
        if torch._C._are_functorch_transforms_active():
            loss = _HeadFunction.apply(logits, teacher, head, call, side)
        else:
            loss = _apply(logits, teacher, head, call, side)
        return loss, side[0], {}
    loss, values, _, launcher = launch.run(head, call, grad=False, inplace=False)
    return loss, values, row_outputs(head, launcher, call) if per_row else {}


# ---- torch.compile ---------------------------------------------------------------------------------
_HEADS: dict[str, weakref.ref] = {}     # the op takes no module: a head is named by an id


def register(head) -> str:
    # unique across heads, copies and processes: a pickled id met in another process names no one
    head_id = f"{head.key}/{uuid.uuid4().hex}"
    _HEADS[head_id] = weakref.ref(head, lambda _, i=head_id: _HEADS.pop(i, None))
    return head_id


def head_of(head_id: str):
    return _HEADS[head_id]()


# The op's arguments, declared once: (name, schema type, how ``compiled`` fills it from the head, the
# logits and the Call). The schema, the op's and its fake's parameters, the Call the op rebuilds and
# the backward's gradient tuple are all derived from this list.
_OP_ARGS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("head_id", "str", lambda head, x, call: head.head_id),
    ("logits", "Tensor", lambda head, x, call: x),
    ("labels", "Tensor?", lambda head, x, call: call.labels),
    ("loss_mask", "Tensor?", lambda head, x, call: call.mask),
    ("teacher", "Tensor?", lambda head, x, call: call.teacher),
    ("tokens", "Tensor[]", lambda head, x, call: list(call.tokens)),
    ("vectors", "Tensor[]", lambda head, x, call: list(call.vectors)),
    ("topk_ids", "Tensor?", lambda head, x, call: call.topk_ids),
    ("topk_logprobs", "Tensor?", lambda head, x, call: call.topk_logprobs),
    ("segment_ids", "Tensor?", lambda head, x, call: call.segment_ids),
    ("num_segments", "int?", lambda head, x, call: call.num_segments),
    ("divisor", "Tensor?", lambda head, x, call: call.divisor),
    ("reduction", "str", lambda head, x, call: call.reduction),
    ("process_group", "str?", lambda head, x, call: collectives.group_name(call.group)),
    ("segment_group", "str?", lambda head, x, call: collectives.group_name(call.segment_group)),
    ("grad", "bool", lambda head, x, call: x.requires_grad and torch.is_grad_enabled()),
)
_OP_NAMES = tuple(name for name, _, _ in _OP_ARGS)
# outputs: the loss, the values, every output's rows ([ROW_VALUES, *rows] under reduction="none",
# else [0]) and the handle of what backward needs
_OP_RETURNS = "(Tensor, Tensor, Tensor, Tensor)"


def op_args(head, logits: torch.Tensor, call: Call) -> list[Any]:
    """The op's arguments for a call, in the declared order."""
    return [fill(head, logits, call) for _, _, fill in _OP_ARGS]


def compiled(head, logits: torch.Tensor, call: Call,
             teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    if teacher is not None:
        # teacher logits that require grad: the call runs eagerly (a graph break, as head.linear's),
        # the op returning the logits' gradient only
        return torch.compiler.disable(eager)(head, logits, call, teacher)
    loss, values, rows, _ = torch.ops.losscodegen.head(*op_args(head, logits, call))
    if call.reduction != "none":
        return loss, values, {}
    spec = head.kernel.SPEC
    # a term's rows are differentiable, a metric's detached, as in eager (``row_outputs``)
    return loss, values, {n: rows[spec.row_values.index(n)] if n in spec.row_loss_terms else
                          rows[spec.row_values.index(n)].detach() for n in spec.outputs}


# The ops are defined with a schema and a plain kernel, not with ``torch.library.custom_op``, whose
# Python wrapper runs on every call (an aliasing check, a dynamo shim): docs/decisions.md.
_LIB = torch.library.Library("losscodegen", "DEF")
_LIB.define(f"head({', '.join(f'{t} {n}' for n, t, _ in _OP_ARGS)}) -> {_OP_RETURNS}")
_LIB.define("head_grad(Tensor handle, Tensor grad_loss, Tensor? grad_rows, Tensor? logits, Tensor?[] reread, "
            "int[] shape, ScalarType dtype, Device device) -> Tensor")
# reduction="none": the op's inputs besides the logits that the deferred gradient launch reads again
# (``Call.tensors``), saved for backward and handed back to it: one changed in place since the
# forward fails torch's version check, and the launch reads what autograd kept
_REREAD = ("labels", "loss_mask", "teacher", "topk_ids", "topk_logprobs", "segment_ids", "divisor")


def _head_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a = dict(zip(_OP_NAMES, args))
    head, logits = head_of(a["head_id"]), a["logits"]
    call = Call(tuple(logits.shape[:-1]), logits.shape[-1], logits.device,
                rows_view(logits, logits.shape[-1]), a["labels"], a["loss_mask"], a["teacher"],
                tuple(a["tokens"]), a["topk_ids"], a["topk_logprobs"], a["segment_ids"], a["num_segments"],
                a["divisor"], a["reduction"], collectives.resolve(a["process_group"]),
                collectives.resolve(a["segment_group"]), (), None, tuple(a["vectors"]))
    # Inductor may reuse the logits' memory once the op has read them: the gradient gets its own.
    loss, values, grad_buf, launcher = launch.run(head, call, grad=a["grad"], inplace=False)
    if call.reduction == "none":
        rows = launcher.ws.rows(call).clone()   # (outputs of an op never alias each other)
        backward = launcher if a["grad"] else None
        if backward is not None:
            head.keep_scalars(call)
    else:
        rows, backward = logits.new_empty((0,), dtype=torch.float32), grad_buf
    return loss.clone(), values, rows, _keep(head, backward)


def _head_fake(*args: Any):
    a = dict(zip(_OP_NAMES, args))
    spec, logits = head_of(a["head_id"]).kernel.SPEC, a["logits"]
    per_row = a["reduction"] == "none"
    loss_shape = logits.shape[:-1] if per_row else ()
    rows_shape = (len(spec.row_values), *logits.shape[:-1]) if per_row else (0,)
    return (logits.new_empty(loss_shape, dtype=torch.float32),
            logits.new_empty((len(spec.outputs),), dtype=torch.float32),
            logits.new_empty(rows_shape, dtype=torch.float32), torch.empty(1, dtype=torch.int64))


def _setup_context(ctx, inputs, output):
    a = dict(zip(_OP_NAMES, inputs))
    logits = a["logits"]
    ctx.shape, ctx.dtype, ctx.device = list(logits.shape), logits.dtype, logits.device
    ctx.n_lists = {name: len(a[name]) for name, kind, _ in _OP_ARGS if kind == "Tensor[]"}
    # (reduction="none": the deferred gradient launch reads the logits and the other inputs again,
    # so they are saved)
    deferred = a["reduction"] == "none" and a["grad"]
    reread = [a[name] for name in _REREAD] + list(a["tokens"]) + list(a["vectors"]) if deferred else []
    ctx.save_for_backward(output[3], logits if deferred else None, *reread)
    ctx.mark_non_differentiable(output[1], output[3])


def _backward(ctx, grad_loss, _grad_values, grad_rows, _grad_handle):
    # (Under torch.compile this runs while tracing, without grad mode; AOTAutograd itself refuses
    # a double backward through a compiled graph.)
    refuse_create_graph("HeadLoss")
    handle, logits, *reread = ctx.saved_tensors
    grad = torch.ops.losscodegen.head_grad(handle, grad_loss, grad_rows, logits, reread, ctx.shape, ctx.dtype,
                                           ctx.device)
    return tuple(grad if name == "logits" else [None] * ctx.n_lists[name] if kind == "Tensor[]" else None
                 for name, kind, _ in _OP_ARGS)



def _head_grad_op(handle: torch.Tensor, grad_loss: torch.Tensor, grad_rows: torch.Tensor | None,
                  logits: torch.Tensor | None, reread: list[torch.Tensor | None], shape: list[int],
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    head, kept = _take(handle)
    if isinstance(kept, launch.Launcher):    # reduction="none": the deferred gradient launch
        spec = head.kernel.SPEC
        terms = [None if grad_rows is None else grad_rows[spec.row_values.index(n)] for n in spec.row_loss_terms]
        # (the saved inputs, which autograd kept and checked: one changed in place since the forward
        # failed its version check before this op ran)
        call = kept.call
        call.x = rows_view(logits, logits.shape[-1])
        (call.labels, call.mask, call.teacher, call.topk_ids, call.topk_logprobs, call.segment_ids,
         call.divisor) = reread[:len(_REREAD)]
        n = len(_REREAD) + len(call.tokens)
        call.tokens, call.vectors = tuple(reread[len(_REREAD):n]), tuple(reread[n:])
        head.restore_scalars(call)
        grad = launch.backward(kept, grad_loss, terms, inplace=False)
    else:
        grad = kept
        head.backend.scale_rows(grad, grad_loss)
    return grad.view(shape)


def _head_grad_fake(handle, grad_loss, grad_rows, logits, reread, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


_LIB.impl("head", _head_op, "CompositeExplicitAutograd")
_LIB.impl("head_grad", _head_grad_op, "CompositeExplicitAutograd")
torch.library.register_fake("losscodegen::head", _head_fake, lib=_LIB)
torch.library.register_fake("losscodegen::head_grad", _head_grad_fake, lib=_LIB)
torch.library.register_autograd("losscodegen::head", _backward, setup_context=_setup_context, lib=_LIB)


# Gradient buffers between a compiled forward and its backward, by handle. An entry whose handle is
# gone (its graph freed without a backward) is dropped at the next call.
_GRADS: dict[int, tuple[StorageWeakRef, Any, Any]] = {}
_handles = itertools.count()


def _keep(head, kept: Any) -> torch.Tensor:
    """A handle to what backward needs: the gradient buffer, or (reduction="none") the launcher of
    the deferred gradient launch."""
    for key in [key for key, (ref, _, _) in _GRADS.items() if ref.expired()]:
        del _GRADS[key]
    key = next(_handles) if kept is not None else -1
    handle = torch.tensor([key])
    if kept is not None:
        _GRADS[key] = (StorageWeakRef(handle.untyped_storage()), head, kept)
    return handle


def _take(handle: torch.Tensor) -> tuple[Any, Any]:
    entry = _GRADS.pop(handle.item(), None)
    if entry is None:
        raise RuntimeError(f"HeadLoss: {BACKWARD_TWICE}")
    return entry[1], entry[2]
