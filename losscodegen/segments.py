"""Segment terms (GSPO, a DPO pair loss): between the launch that writes every row's values (and
adds them to its segment's sums) and the gradient launch, one program of the generated segment
kernel turns the sums into each segment term's value and, per segment, dL/du for the gradient."""
from __future__ import annotations

import torch

from . import collectives
from .backends import Launchable


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


def run(call, ws, n_seg: int, kernel: Launchable, args: tuple) -> None:
    """The segment kernel (the head's ``segments_<key>`` as its backend launches it, from the
    launcher's layout) with ``args``, its SEGMENT_ARGS, after summing the segments over
    ``segment_group``."""
    if call.segment_group is not None:
        collectives.all_reduce(ws.seg_sums(n_seg), call.segment_group)
    kernel(1, *args)
