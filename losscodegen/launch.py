"""Launching a head's kernels: the per-call workspace, the plan's launches with what the host does
between them, and two small generic kernels (a prologue that zeroes the workspace's accumulators and
counts the valid rows; scale a stored gradient by the upstream one).

A default call on one device is: one allocation (the workspace), the one-program prologue, and one
launch of the head's kernel, whose last program writes the terms, the metrics and the loss. Nothing
waits for the device. What a call's shapes decide (tiles, launches, each launch's compiled kernel:
``dispatch.py``) is worked out once per signature and kept by the head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import triton
import triton.language as tl

from . import collectives, segments, tiles
from .dispatch import Kernel
from .plan import Launch

_BLOCK_R = 256      # rows a tile when the last program reduces the rows' values
_BLOCK_PROLOGUE = 4096
_MAX_OFFSETS = 64   # workspace layouts a layout keeps, by row count


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


_PROLOGUES = {count: Kernel(_prologue, COUNT=count, BLOCK=_BLOCK_PROLOGUE, num_warps=8) for count in (False, True)}
_SCALES: dict[int, Kernel] = {}     # by V


def scale_rows(grad: torch.Tensor, upstream: torch.Tensor) -> None:
    """``grad`` [rows, V] times ``upstream`` (a scalar, or one value a row), in place."""
    g = upstream if upstream.dtype == torch.float32 else upstream.float()
    if g.dim() > 1 or not g.is_contiguous():
        g = g.reshape(-1).contiguous()
    V = grad.shape[1]
    kernel = _SCALES.get(V)
    if kernel is None:
        kernel = _SCALES[V] = Kernel(_scale_rows, BLOCK_V=min(tiles.pow2(V), 4096))
    kernel(grad.shape[0], grad, grad.stride(0), g, int(g.dim() != 0), V)


@dataclass(frozen=True)
class _Layout:
    """What a call's signature decides (not its row count: a training run may bring a new one every
    step), worked out at its first call and kept by the head: the vocabulary a rank holds, the tiles
    and the launches, each with its kernel (and what that compiled)."""

    world: int
    vocab: int
    steps: tuple[tuple[Launch, Kernel], ...]  # each launch with the head's kernel for it (its
                                               # constexprs and the fixed arguments)
    cut: int                       # steps[:cut] run before the segment step
    count: bool                    # whether a launch counts the valid rows (the default divisor)
    offsets: dict = field(default_factory=dict, compare=False)  # _offsets by (rows, segments)


def _layout(head, call, *, grad: bool, dtype: torch.dtype, element_size: int, exchange: bool) -> _Layout:
    k = head.kernel
    world, rank = collectives.group_info(call.group)
    config = tiles.choose(head, k, call.V_local, dtype, call.device, sharded=call.group is not None)
    launches = head.launches(sharded=call.group is not None, grad=grad, split=config.split, exchange=exchange)
    cut = next((i + 1 for i, launch in enumerate(launches) if launch.then == "segments"), len(launches))
    fn = getattr(k, f"head_loss_{k.KEY}")
    options = config.launch(call.V_local, element_size)
    block_k = tiles.pow2(call.topk_ids.shape[1]) if k.USES_TOPK else 1
    fixed = (world, *head.row_weights, head.logit_scale, float(head.softcap or 1.0), call.V_local,
             rank * call.V_local, call.V_local * world, head.ignore_index)
    kernels = tuple(Kernel(fn, *fixed, SUM=call.reduction == "sum", PER_ROW=call.reduction == "none",
                           STATS=launch.stats, EXCHANGE=launch.exchange, MERGE=launch.merge,
                           EXACT=launch.exact, STORE_STATS=launch.store_stats, ROWS=launch.rows,
                           GRAD=launch.grad, BLOCK_K=block_k, BLOCK_R=_BLOCK_R, **options)
                    for launch in launches)
    return _Layout(world, call.V_local * world, tuple(zip(launches, kernels)), cut,
                   call.divisor is None and call.reduction != "sum" and head.has_row_outputs)


def _offsets(k: ModuleType, n_rows: int, *, per_row: bool, keep_stats: bool, n_seg: int) -> list[int]:
    """The workspace's offsets in ``Workspace``'s order, where its zeroed part ends, and its size."""
    if n_rows >= 1 << 24:
        raise ValueError(f"a call takes fewer than 2**24 rows (its counts are exact fp32), got {n_rows}")
    zeroed = k.FIXED_SLOTS + (max(n_seg, 1) * (len(k.SEGMENT_MEANS) + 1) if k.SEGMENTS else 0)
    sizes = [n_rows * len(k.ROW_VALUES), n_rows if per_row else 0,
             n_rows * len(k.COLUMNS) if keep_stats else 0, n_rows * len(k.EXACT) if keep_stats else 0,
             max(n_seg, 1) * len(k.SEGMENT_MEANS) if k.SEGMENTS else 0]
    offsets = [zeroed]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    rows, loss_rows, stats, exact, seg_coefs, size = offsets
    return [rows, loss_rows, stats, exact, k.FIXED_SLOTS, seg_coefs, zeroed, size]


def workspace(size: int, device: torch.device) -> torch.Tensor:
    """A workspace's memory, left as it comes (tests fill it with NaN, to show nothing reads it
    before writing it)."""
    return torch.empty(size, device=device)


@dataclass(slots=True)
class Workspace:
    """One call's fp32 scratch: the kernel's fixed slots (each output's value, the loss, the
    valid-row count, the finished-row count) and the segment sums, which the prologue zeroes; then
    per-row values, per-row losses, the packed stats, the exact sums and the segment coefficients,
    each written before it is read."""

    t: torch.Tensor
    n_rows: int
    off_rows: int
    off_loss_rows: int
    off_stats: int
    off_exact: int
    off_seg_sums: int
    off_seg_coefs: int
    k: ModuleType

    def values(self) -> torch.Tensor:
        return self.t.narrow(0, 0, len(self.k.OUTPUTS))

    def loss(self, call) -> torch.Tensor:
        if call.reduction == "none":
            return self.t[self.off_loss_rows:self.off_loss_rows + self.n_rows].view(call.shape)
        return self.t.select(0, self.k.LOSS)

    def stats(self, start: int, stop: int) -> torch.Tensor:
        width = len(self.k.COLUMNS)
        return self.t[self.off_stats + start * width:self.off_stats + stop * width]

    def exact(self, start: int, stop: int) -> torch.Tensor:
        width = len(self.k.EXACT)
        return self.t[self.off_exact + start * width:self.off_exact + stop * width]

    def seg_sums(self, n_seg: int) -> torch.Tensor:
        return self.t[self.off_seg_sums:self.off_seg_sums + max(n_seg, 1) * (len(self.k.SEGMENT_MEANS) + 1)]


class Launcher:
    """Runs a plan's launches over the rows of one call, or over one chunk of them at a time."""

    def __init__(self, head, call, *, grad: bool, flags: torch.Tensor | None, dtype: torch.dtype,
                 element_size: int):
        """``dtype``: the logits'; ``element_size``: the widest of the logits and the teacher's."""
        k = self.k = head.kernel
        self.head, self.call, self.flags = head, call, flags
        self.gathered: torch.Tensor | None = None  # all ranks' packed stats, after a "gather"
        self.n_seg = segments.count(call, head.ignore_index) if k.SEGMENTS else 0
        # (an exact read takes the all-gather: it reads every row again after the exchange anyway)
        self.exchange = None if k.HAS_EXACT else collectives.exchange(call.group, call.device)
        key = (call.V_local, dtype, element_size, call.device, call.reduction, call.group, grad,
               call.divisor is None, call.topk_ids.shape[1] if k.USES_TOPK else 0, self.exchange is not None,
               head.logit_scale, head.softcap, head.ignore_index)   # (the kernels hold these three)
        layout = head.layouts.get(key)
        if layout is None:
            layout = _layout(head, call, grad=grad, dtype=dtype, element_size=element_size,
                             exchange=self.exchange is not None)
            if head.tile_override is None:   # (a configuration being measured is nobody's to keep)
                head.layouts[key] = layout
        self.layout, self.vocab = layout, layout.vocab
        offsets = layout.offsets.get((call.rows, self.n_seg))
        if offsets is None:
            if len(layout.offsets) >= _MAX_OFFSETS:   # (row counts that change every step)
                layout.offsets.clear()
            offsets = layout.offsets[call.rows, self.n_seg] = _offsets(
                k, call.rows, per_row=call.reduction == "none", keep_stats=len(layout.steps) > 1, n_seg=self.n_seg)
        *offsets, zeroed, size = offsets
        self.ws = Workspace(workspace(size, call.device), call.rows, *offsets, k)
        _PROLOGUES[layout.count](1, self.ws.t, zeroed, call.labels, call.mask, call.rows, head.ignore_index,
                                 k.COUNT)

    def run(self, launches: tuple[tuple[Launch, Kernel], ...], x: torch.Tensor, teacher: torch.Tensor | None,
            grad: torch.Tensor | None, row_offset: int = 0) -> None:
        """``launches`` (from ``passes``) over rows ``[row_offset, row_offset + len(x))`` of the call,
        whose logits (and teacher logits) are ``x`` (``teacher``); the gradient goes to ``grad``."""
        for launch, kernel in launches:
            self._launch(launch, kernel, x, teacher, grad, row_offset)
            if launch.then == "gather":
                n = x.shape[0]
                gathered = torch.empty(self.layout.world * n * len(self.k.COLUMNS), device=x.device)
                collectives.gather(gathered, self.ws.stats(row_offset, row_offset + n), self.call.group)
                self.gathered = gathered
            elif launch.then == "sum_exact":
                collectives.all_reduce(self.ws.exact(row_offset, row_offset + x.shape[0]), self.call.group)

    def passes(self) -> tuple[tuple[tuple[Launch, Kernel], ...], tuple[tuple[Launch, Kernel], ...]]:
        """The launches (each with its kernel) before the segment step (it needs every row's
        values: all chunks of rows go through the first part before it), and those after it."""
        steps, cut = self.layout.steps, self.layout.cut
        return steps[:cut], steps[cut:]

    def segments(self) -> None:
        """The segment step, between the passes: the segment kernel (after summing the segments
        over ``segment_group``)."""
        if self.k.SEGMENTS:
            segments.run(self.k, self.head, self.call, self.ws, self.n_seg)

    def _launch(self, launch: Launch, kernel: Kernel, x, teacher, grad, row_offset: int) -> None:
        k, call, ws = self.k, self.call, self.ws
        args = [x, x.stride(0), x if grad is None else grad, 0 if grad is None else grad.stride(0),
                call.labels, call.mask]
        if k.USES_TEACHER:
            args += [teacher, teacher.stride(0)]
        args += call.tokens
        if k.USES_TOPK:
            args += [call.topk_ids, call.topk_logprobs, call.topk_ids.stride(0), call.topk_ids.shape[1]]
        if k.SEGMENTS:
            args += [call.segment_ids, self.n_seg, ws.off_seg_sums, ws.off_seg_coefs]
        gathered, peers, epoch = (self.gathered if launch.merge else None), None, 0
        if launch.exchange:
            gathered, peers, epoch = self.exchange.next(x.shape[0], len(k.COLUMNS))
        args += [ws.t, ws.off_rows, ws.off_loss_rows, ws.off_stats, ws.off_exact, gathered, peers, epoch,
                 call.divisor, self.flags, row_offset, call.rows]
        kernel(x.shape[0], *args)


def run(head, call, *, grad: bool, inplace: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One call on whole logits: (loss, values of the outputs, gradient buffer or None). With
    ``inplace`` the gradient buffer is the logits' own storage."""
    device = call.device
    flags = head.checks.before(device) if head.validate else None
    width = max(call.x.element_size(), call.teacher.element_size() if call.teacher is not None else 0)
    launcher = Launcher(head, call, grad=grad, flags=flags, dtype=call.x.dtype, element_size=width)
    grad_buf = None
    if grad:
        grad_buf = call.x if inplace else torch.empty_like(call.x)
    first, second = launcher.passes()
    launcher.run(first, call.x, call.teacher, grad_buf)
    launcher.segments()
    launcher.run(second, call.x, call.teacher, grad_buf)
    if flags is not None:
        head.checks.after(device, launcher.vocab, launcher.n_seg)
    return launcher.ws.loss(call), launcher.ws.values(), grad_buf
