"""Autograd for heads. The forward launch also writes dL/dlogits for an upstream gradient of 1;
backward multiplies it by the real upstream gradient, on the device (``launch.scale_rows``), so no
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
    # autograd engine host time in forward and in backward, and they have no gradient).
    @staticmethod
    def forward(ctx, logits, head, call, values_out):
        loss, values, grad = launch.run(head, call, grad=True, inplace=head.inplace_backward)
        if head.inplace_backward:
            # The logits now hold their gradient: a node that saved them fails loudly in backward.
            torch.autograd.graph.increment_version(logits)
        ctx.grad, ctx.shape = grad, logits.shape
        values_out.append(values)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_create_graph("HeadLoss")
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError(f"HeadLoss: {BACKWARD_TWICE}")
        launch.scale_rows(grad, grad_loss)
        # A view even of the same shape: a new tensor over the buffer, which AccumulateGrad keeps as
        # .grad without a copy (under inplace_backward the buffer is the logits themselves, and
        # returning them would be copied: measured, peak memory +2.1 GB at 8192 x 128256).
        return grad.view(ctx.shape), None, None, None


# ``Function.apply`` without its Python wrapper, which inspects the Function and unwraps its
# arguments for torch.func on every call (4 µs a call on a fast host); under torch.func transforms
# the wrapper runs.
_apply = super(torch.autograd.Function, _HeadFunction).apply


def eager(head, logits: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.requires_grad and torch.is_grad_enabled():
        values: list[torch.Tensor] = []
        if torch._C._are_functorch_transforms_active():
            loss = _HeadFunction.apply(logits, head, call, values)
        else:
            loss = _apply(logits, head, call, values)
        return loss, values[0]
    loss, values, _ = launch.run(head, call, grad=False, inplace=False)
    return loss, values


# ---- torch.compile ---------------------------------------------------------------------------------
_HEADS: dict[str, weakref.ref] = {}     # the op takes no module: a head is named by an id


def register(head) -> str:
    # unique across heads, copies and processes: a pickled id met in another process names no one
    head_id = f"{head.key}/{uuid.uuid4().hex}"
    _HEADS[head_id] = weakref.ref(head, lambda _, i=head_id: _HEADS.pop(i, None))
    return head_id


def head_of(head_id: str):
    return _HEADS[head_id]()


def compiled(head, logits: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    loss, values, _ = torch.ops.losscodegen.head(
        head.head_id, logits, call.labels, call.mask, call.teacher, list(call.tokens), call.topk_ids,
        call.topk_logprobs, call.segment_ids, call.num_segments, call.divisor, call.reduction,
        collectives.group_name(call.group), collectives.group_name(call.segment_group),
        logits.requires_grad and torch.is_grad_enabled())
    return loss, values


# The ops are defined with a schema and a plain kernel, not with ``torch.library.custom_op``, whose
# Python wrapper runs on every call (an aliasing check, a dynamo shim): docs/decisions.md.
_LIB = torch.library.Library("losscodegen", "DEF")
_LIB.define("head(str head_id, Tensor logits, Tensor? labels, Tensor? loss_mask, Tensor? teacher, "
            "Tensor[] tokens, Tensor? topk_ids, Tensor? topk_logprobs, Tensor? segment_ids, "
            "int? num_segments, Tensor? divisor, str reduction, str? process_group, str? segment_group, "
            "bool grad) -> (Tensor, Tensor, Tensor)")
_LIB.define("head_grad(Tensor handle, Tensor grad_loss, int[] shape, ScalarType dtype, Device device) -> Tensor")


def _head_op(head_id: str, logits: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
             teacher: torch.Tensor | None, tokens: list[torch.Tensor], topk_ids: torch.Tensor | None,
             topk_logprobs: torch.Tensor | None, segment_ids: torch.Tensor | None, num_segments: int | None,
             divisor: torch.Tensor | None, reduction: str, process_group: str | None,
             segment_group: str | None, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head = head_of(head_id)
    call = Call(tuple(logits.shape[:-1]), logits.shape[-1], logits.device,
                rows_view(logits, logits.shape[-1]), labels, loss_mask, teacher, tuple(tokens),
                topk_ids, topk_logprobs, segment_ids, num_segments, divisor, reduction,
                collectives.resolve(process_group), collectives.resolve(segment_group))
    # Inductor may reuse the logits' memory once the op has read them: the gradient gets its own.
    loss, values, grad_buf = launch.run(head, call, grad=grad, inplace=False)
    return loss.clone(), values, _keep(grad_buf)  # (outputs of an op never alias each other)


def _head_fake(head_id, logits, labels, loss_mask, teacher, tokens, topk_ids, topk_logprobs, segment_ids,
               num_segments, divisor, reduction, process_group, segment_group, grad):
    n_outputs = len(head_of(head_id).kernel.OUTPUTS)
    loss_shape = logits.shape[:-1] if reduction == "none" else ()
    return (logits.new_empty(loss_shape, dtype=torch.float32),
            logits.new_empty((n_outputs,), dtype=torch.float32), torch.empty(1, dtype=torch.int64))


def _setup_context(ctx, inputs, output):
    logits = inputs[1]
    ctx.shape, ctx.dtype, ctx.device = list(logits.shape), logits.dtype, logits.device
    ctx.n_tokens = len(inputs[5])
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_loss, _grad_values, _grad_handle):
    # (Under torch.compile this runs while tracing, without grad mode; AOTAutograd itself refuses
    # a double backward through a compiled graph.)
    refuse_create_graph("HeadLoss")
    (handle,) = ctx.saved_tensors
    grad = torch.ops.losscodegen.head_grad(handle, grad_loss, ctx.shape, ctx.dtype, ctx.device)
    # one entry an input, the tokens' list included
    return (None, grad, None, None, None, [None] * ctx.n_tokens) + (None,) * 9


def _head_grad_op(handle: torch.Tensor, grad_loss: torch.Tensor, shape: list[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    grad = _take(handle)
    launch.scale_rows(grad, grad_loss)
    return grad.view(shape)


def _head_grad_fake(handle, grad_loss, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


_LIB.impl("head", _head_op, "CompositeExplicitAutograd")
_LIB.impl("head_grad", _head_grad_op, "CompositeExplicitAutograd")
torch.library.register_fake("losscodegen::head", _head_fake, lib=_LIB)
torch.library.register_fake("losscodegen::head_grad", _head_grad_fake, lib=_LIB)
torch.library.register_autograd("losscodegen::head", _backward, setup_context=_setup_context, lib=_LIB)


# Gradient buffers between a compiled forward and its backward, by handle. An entry whose handle is
# gone (its graph freed without a backward) is dropped at the next call.
_GRADS: dict[int, tuple[StorageWeakRef, torch.Tensor]] = {}
_handles = itertools.count()


def _keep(grad: torch.Tensor | None) -> torch.Tensor:
    for key in [key for key, (ref, _) in _GRADS.items() if ref.expired()]:
        del _GRADS[key]
    key = next(_handles) if grad is not None else -1
    handle = torch.tensor([key])
    if grad is not None:
        _GRADS[key] = (StorageWeakRef(handle.untyped_storage()), grad)
    return handle


def _take(handle: torch.Tensor) -> torch.Tensor:
    entry = _GRADS.pop(handle.item(), None)
    if entry is None:
        raise RuntimeError(f"HeadLoss: {BACKWARD_TWICE}")
    return entry[1]
