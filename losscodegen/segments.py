"""Segment terms (GSPO, a DPO pair loss): between the launch that writes every row's values (and
adds them to its segment's sums) and the gradient launch, one program of the generated segment
kernel turns the sums into each segment term's value and, per segment, dL/du for the gradient."""
from __future__ import annotations

import torch

from . import collectives
from .backends import Launchable


# The most segments a call sizes its segment sums for: fp32 counts are exact below it, and the sums
# take a few floats a segment. Larger ids are compacted (``compact``) where that keeps the values.
MAX_SEGMENTS = 1 << 24


def compact(ids: torch.Tensor) -> torch.Tensor:
    """Segment ids of any size (global sample indices: 2**40) as ids in ``[0, rows)`` that group the
    rows alike, on the device without a host sync: a sort, then each distinct id numbered in order.
    A negative id is kept as it is, so the kernel still flags it on a valid row."""
    order = torch.argsort(ids)
    ordered = ids[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    dense = torch.empty_like(ids)
    dense[order] = first.cumsum(0) - 1
    return torch.where(ids < 0, ids, dense)


def check_count(n_seg: int) -> int:
    """``n_seg`` where the call can size its segments for it, else a ValueError naming it (the same on
    every rank: after the MAX all-reduce, or the num_segments every rank was given)."""
    if n_seg > MAX_SEGMENTS:
        raise ValueError(
            f"num_segments={n_seg} (segment ids up to {n_seg - 1}): at most {MAX_SEGMENTS} segments fit a "
            "call. Number the segments from 0 (torch.unique(ids, return_inverse=True)[1]); a head whose "
            "segment terms only group rows (no normalize='sequence', no segment_group) takes ids of any "
            "size when num_segments is not given")
    return n_seg


def count(call, ignore_index: int) -> int:
    """``num_segments``, or the largest segment id of a valid row plus one. The latter waits for the
    device (one host sync, and a MAX all-reduce over ``segment_group``): pass ``num_segments=``.
    (Where the ids only group rows, inputs.check_rows has compacted them and set num_segments.)"""
    if call.num_segments is not None:
        return call.num_segments
    seg = call.segment_ids
    valid = call.labels != ignore_index if call.labels is not None else torch.ones_like(seg, dtype=torch.bool)
    if call.mask is not None:
        valid = valid & call.mask
    top = torch.where(valid, seg, -1).max() if seg.numel() else torch.full((), -1, device=seg.device)
    if call.segment_group is not None:
        collectives.all_reduce(top, call.segment_group, "max")
    return check_count(int(top.item()) + 1)


def run(call, ws, n_seg: int, kernel: Launchable, args: tuple) -> None:
    """The segment kernel (the head's ``segments_<key>`` as its backend launches it, from the
    launcher's layout) with ``args``, its SEGMENT_ARGS, after summing the segments over
    ``segment_group``."""
    if call.segment_group is not None:
        collectives.all_reduce(ws.seg_sums(n_seg), call.segment_group)
    kernel(1, *args)
