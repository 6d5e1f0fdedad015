"""The Triton backend's two small generic kernels: a prologue that zeroes a call's workspace
accumulators and counts the valid rows, and the scale of a stored gradient by the upstream one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ...plan import pow2
from .dispatch import Kernel

_BLOCK_PROLOGUE = 4096


@triton.jit
def _prologue(ws_ptr, n_zero, y_ptr, mask_ptr, n_rows, ignore_index, count_slot, COUNT: tl.constexpr,
              BLOCK: tl.constexpr):
    # One program, before the head's kernel: zeroes what the kernel accumulates into (its first
    # n_zero slots), then counts the valid rows, the default divisor, into its slot. (Stored, not
    # added: exact in fp32 below 2**24 rows.)
    i = tl.arange(0, BLOCK)
    for start in range(0, n_zero, BLOCK):
        tl.store(ws_ptr + start + i, tl.zeros([BLOCK], tl.float32), mask=start + i < n_zero)
    if COUNT:
        total = 0.0
        for start in range(0, n_rows, BLOCK):
            live = start + i < n_rows
            if y_ptr is not None:
                live = live & (tl.load(y_ptr + start + i, mask=start + i < n_rows, other=ignore_index) != ignore_index)
            if mask_ptr is not None:
                live = live & (tl.load(mask_ptr + start + i, mask=start + i < n_rows, other=0) != 0)
            total += tl.sum(live.to(tl.float32), 0)
        tl.debug_barrier()  # (after every thread's zeros)
        tl.store(ws_ptr + count_slot, total)


@triton.jit
def _scale_rows(grad_ptr, grad_stride, g_ptr, g_stride, V, BLOCK_V: tl.constexpr):
    # A gradient stored for an upstream gradient of 1, multiplied by the real one, on the device: a
    # row is skipped entirely when it is 1, the common case, without the host ever looking at it.
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr + row * g_stride)
    if g != 1.0:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ptr = grad_ptr + row * grad_stride + cols
            d = tl.load(ptr, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(ptr, (d * g).to(grad_ptr.dtype.element_ty), mask=cols < V)


# whether Triton runs kernels in its interpreter (the only way it runs them on CPU tensors): it decides
# when a kernel is defined, from TRITON_INTERPRET
INTERPRETED = isinstance(_prologue, InterpretedFunction)
PROLOGUES = {count: Kernel(_prologue, COUNT=count, BLOCK=_BLOCK_PROLOGUE, num_warps=8) for count in (False, True)}
_SCALES: dict[int, Kernel] = {}     # by V


def scale_rows(grad: torch.Tensor, upstream: torch.Tensor) -> None:
    """``grad`` [rows, V] times ``upstream`` (a scalar, or one value a row), in place."""
    g = upstream if upstream.dtype == torch.float32 else upstream.float()
    if g.dim() > 1 or not g.is_contiguous():
        g = g.reshape(-1).contiguous()
    V = grad.shape[1]
    kernel = _SCALES.get(V)
    if kernel is None:
        kernel = _SCALES[V] = Kernel(_scale_rows, BLOCK_V=min(pow2(V), 4096))
    kernel(grad.shape[0], grad, grad.stride(0), g, int(g.dim() != 0), V)
