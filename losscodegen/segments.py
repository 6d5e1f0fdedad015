"""Segment terms (GSPO, a DPO pair loss): between the launch that writes every row's values (and
adds them to its segment's sums) and the gradient launch, one program of the generated segment
kernel turns the sums into each segment term's value and, per segment, dL/du for the gradient."""
from __future__ import annotations

from types import ModuleType

import torch

from . import collectives, tiles
from .dispatch import Kernel, by_name


def count(call, ignore_index: int) -> int:
    """``num_segments``, or the largest segment id of a valid row plus one. The latter waits for the
    device (one host sync, and a MAX all-reduce over ``segment_group``): pass ``num_segments=``."""
    if call.num_segments is not None:
        return call.num_segments
    seg = call.segment_ids
    valid = call.labels != ignore_index if call.labels is not None else torch.ones_like(seg, dtype=torch.bool)
    if call.mask is not None:
        valid = valid & call.mask
    top = torch.where(valid, seg, -1).max() if seg.numel() else torch.full((), -1, device=seg.device)
    if call.segment_group is not None:
        collectives.all_reduce(top, call.segment_group, "max")
    return int(top.item()) + 1


_KERNELS: dict[tuple, Kernel] = {}     # a head's segment kernel, by its weights and constexprs


def run(kernel: ModuleType, head, call, ws, n_seg: int, args: tuple) -> None:
    """The segment kernel, with ``args`` (its SEGMENT_ARGS, from the launcher)."""
    if call.segment_group is not None:
        collectives.all_reduce(ws.seg_sums(n_seg), call.segment_group)
    name = f"segments_{kernel.KEY}"
    fixed = {f"weight_{n}": w for n, w in zip(kernel.SEGMENTS, head.weights_of(kernel.SEGMENTS))}
    constexprs = dict(SUM=call.reduction == "sum", BLOCK_S=min(tiles.pow2(n_seg), 1024))
    key = (getattr(kernel, name), *by_name(fixed, kernel.SEGMENT_FIXED, name),
           *by_name(constexprs, kernel.SEGMENT_CONSTEXPRS, name))
    launch = _KERNELS.get(key)
    if launch is None:
        launch = _KERNELS[key] = Kernel(key[0], *key[1:1 + len(kernel.SEGMENT_FIXED)],
                                        **dict(zip(kernel.SEGMENT_CONSTEXPRS, key[1 + len(kernel.SEGMENT_FIXED):])))
    launch(1, *args)
