"""Segment terms (GSPO, a DPO pair loss): between the launch that writes every row's values (and
adds them to its segment's sums) and the gradient launch, one program of the generated segment
kernel turns the sums into each segment term's value and, per segment, dL/du for the gradient."""
from __future__ import annotations

from typing import Callable

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
    valid = _valid(call, ignore_index)
    top = torch.where(valid, seg, -1).max() if seg.numel() else torch.full((), -1, device=seg.device)
    if call.segment_group is not None:
        collectives.all_reduce(top, call.segment_group, "max")
    return check_count(int(top.item()) + 1)


def _valid(call, ignore_index: int) -> torch.Tensor:
    """The call's valid rows, flat: a label that is not ``ignore_index`` (all rows where the head
    reads no labels), and ``loss_mask``."""
    valid = call.labels != ignore_index if call.labels is not None \
        else torch.ones(call.rows, dtype=torch.bool, device=call.device)
    return valid if call.mask is None else valid & call.mask


def run(call, ws, n_seg: int, kernel: Launchable, args: tuple, ignore_index: int) -> None:
    """The segment kernel (the head's ``segments_<key>`` as its backend launches it, from the
    launcher's layout) with ``args``, its SEGMENT_ARGS, after summing the segments over
    ``segment_group``; around it, the order statistics (``quantiles``, ``sort``)."""
    if call.segment_group is not None:
        collectives.all_reduce(ws.seg_sums(n_seg), call.segment_group)
    quantiles(call, ws, n_seg, ignore_index)
    take_back = sort(ws, n_seg)
    kernel(1, *args)
    take_back()


def quantiles(call, ws, n_seg: int, ignore_index: int) -> None:
    """The batch quantiles (S.row_quantile), on the device, no host sync: each over the valid rows'
    values of its row quantity (the first read's, after the vocab shards' merge: the same on every
    rank), ``torch.quantile``'s linear interpolation, written in every segment's column, where the
    segment kernel and the gradient launch read it."""
    spec = ws.spec
    if not spec.segment_quantiles:
        return
    width = len(spec.segment_means)
    sums = ws.seg_sums(n_seg).view(-1, width + 1)
    valid = _valid(call, ignore_index)
    n = valid.sum()
    rank = (n - 1).clamp_min(0).double()
    rows = ws.t.narrow(0, ws.off_rows, len(spec.row_values) * call.rows).view(len(spec.row_values), call.rows)
    for name, q in spec.segment_quantiles:
        column = 1 + spec.segment_means.index(name)
        if not call.rows:
            # an empty batch (its shape says so: no sync) has no value to index; 0 as with no valid row
            sums[:, column] = 0.0
            continue
        ordered = torch.sort(torch.where(valid, rows[spec.row_values.index(name)], torch.inf)).values
        at = rank * q
        below, above = ordered[at.floor().long()], ordered[at.ceil().long()]
        value = torch.lerp(below, above, (at - at.floor()).float())
        sums[:, column] = torch.where(n > 0, value, 0.0)


def sort(ws, n_seg: int) -> Callable[[], None]:
    """The segment step's order statistics (S.segment_sorted), on the device, no host sync: each
    sorted column of the sums (a segment_sum of a row quantity) sorted over the non-empty segments,
    its k-th smallest written at the k-th non-empty segment, where the segment kernel reads it. The
    function returned, run after the kernel, moves the kernel's dL/d(k-th smallest) of each column
    to the segment that sum came from (sort's gradient), where the gradient launch reads it. Every
    rank of a vocab-parallel or segment group holds the same sums, so sorts them alike."""
    spec = ws.spec
    columns = [spec.segment_means.index(name) for name in spec.segment_sorted]
    if not columns or n_seg == 0:
        return lambda: None
    width = len(spec.segment_means)
    sums = ws.seg_sums(n_seg).view(-1, width + 1)[:n_seg]
    nonempty = sums[:, 0] != 0                       # (a NaN count, a bad row's, keeps its segment)
    position = (torch.cumsum(nonempty, 0) - 1).clamp_min(0)   # a non-empty segment's rank among them
    sources = []
    for j in columns:
        # empty segments after every non-empty one; each non-empty one reads the sum of its rank
        values, order = torch.sort(torch.where(nonempty, sums[:, j + 1], torch.inf), stable=True)
        sums[:, j + 1] = values[position]
        sources.append((j, order[position]))

    def take_back() -> None:
        coefs = ws.t[ws.off_seg_coefs:ws.off_seg_coefs + n_seg * width].view(n_seg, width)
        for j, source in sources:
            # (an empty segment's coefficient is 0: it adds nothing to the segment it points at)
            coefs[:, j] = torch.zeros_like(coefs[:, j]).index_add_(0, source, coefs[:, j])
    return take_back
