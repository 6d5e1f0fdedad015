"""Collectives: vocab-parallel heads exchange their packed row statistics, and segment terms sum
their segments over a sequence-parallel group. One round each, whatever the terms."""
from __future__ import annotations

import os
from typing import Any

import torch


def group_info(group: Any) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) without one."""
    if group is None:
        return 1, 0
    import torch.distributed as dist
    return dist.get_world_size(group), dist.get_rank(group)


def shard_columns(group: Any, width: int, device: torch.device) -> tuple[int, int]:
    """(this rank's first vocabulary column, the whole vocabulary's size) from every rank's
    ``width``: shards of any width, in rank order. One all-gather of one int a rank, which waits for
    it: the head calls it once per width (``HeadLoss.shard_columns``), every rank at the same call."""
    import torch.distributed as dist
    world, rank = group_info(group)
    widths = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(widths, torch.tensor([width], dtype=torch.int64, device=device), group=group)
    widths = widths.tolist()
    if 0 in widths:   # (every rank raises here alike: none is left waiting in a later collective)
        raise ValueError(f"logits: vocab-parallel shards need at least one column each, but rank "
                         f"{widths.index(0)}'s has none (the shards' widths: {widths})")
    return sum(widths[:rank]), sum(widths)


def gather(out: torch.Tensor, part: torch.Tensor, group: Any) -> None:
    """Every rank's ``part``, one after the other, into ``out``."""
    import torch.distributed as dist
    dist.all_gather_into_tensor(out, part, group=group)


def all_reduce(t: torch.Tensor, group: Any, op: str = "sum") -> None:
    import torch.distributed as dist
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)


def group_name(group: Any) -> str | None:
    """A process group as a name, for torch.library ops (which take no group objects)."""
    return None if group is None else group.group_name


def resolve(name: str | None) -> Any:
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


class Exchange:
    """An in-kernel exchange of packed row stats between the GPUs of a vocab-parallel group that map
    each other's memory (torch's symmetric memory, over NVLink): the kernel writes its rows' stats
    into every rank's buffer and waits for theirs, so a head without an exact read runs in one
    launch and its rows are still in L2 for the gradient. (The all-gather between two launches
    reads every row from HBM a second time.)

    One buffer per group, in two halves that launches alternate between. Each half holds int32 flags
    first, [world] for the launch then [world, rows] for its rows, then [world, rows, columns] fp32
    stats; a flag only ever holds the number of the launch that wrote it, so nothing is reset. Every
    launch's program 0 exchanges a launch flag with every rank, whatever its rows: a rank that has
    finished launch k + 1 knows every rank started it, so finished launch k, whose half launch k + 2
    then reuses."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device
        self.world = group_info(group)[0]
        self.launches = 0
        self.rows = self.columns = 0  # what a half holds
        self._keep: list = []         # every buffer made: a peer's kernel may still write to an old one
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None   # each half's stats, here
        self.peers: tuple[torch.Tensor, torch.Tensor] | None = None

    def next(self, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For one launch over ``rows`` rows: (the launch's half of this rank's stats, which the merge
        reads as [world, rows, columns]; every rank's addresses of that half's stats then of its
        flags; the launch's number)."""
        if rows > self.rows or columns > self.columns:
            self._grow(max(rows, 2 * self.rows), max(columns, self.columns))
        self.launches += 1
        half = self.launches % 2
        return self.stats[half], self.peers[half], self.launches

    def _grow(self, rows: int, columns: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem
        flags = self.world * (1 + rows)
        half_size = flags + self.world * rows * columns
        buffer = symm_mem.empty(2 * half_size, dtype=torch.float32, device=self.device)
        buffer.zero_()                  # no flag may hold a launch's number before that launch
        torch.cuda.synchronize(self.device)
        handle = symm_mem.rendezvous(buffer, self.group)   # collective: every rank grows at this launch
        self._keep.append((buffer, handle))
        self.rows, self.columns = rows, columns
        self.stats = tuple(buffer[half * half_size + flags:(half + 1) * half_size] for half in (0, 1))
        self.peers = tuple(
            torch.tensor([p + 4 * (half * half_size + flags) for p in handle.buffer_ptrs]
                         + [p + 4 * half * half_size for p in handle.buffer_ptrs], dtype=torch.int64,
                         device=self.device)
            for half in (0, 1))


_EXCHANGES: dict[tuple, Exchange | None] = {}


def exchange(group: Any, device: torch.device) -> Exchange | None:
    """The group's in-kernel exchange, or None where there is none (not CUDA, GPUs that do not map
    each other's memory, ``LOSSCODEGEN_EXCHANGE=0``); never inside a CUDA graph capture, whose
    replays would repeat a launch's number."""
    if group is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    key = (group, device)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = Exchange(group, device) if _can_exchange(group, device) else None
    return _EXCHANGES[key]


def _can_exchange(group: Any, device: torch.device) -> bool:
    """Every rank of ``group`` on one host (its GPUs map each other's memory through symmetric
    memory; across hosts the all-gather stays), able to make a symmetric buffer with its peers (a
    trial one), and ``LOSSCODEGEN_EXCHANGE`` not 0. Decided once a group, by all ranks together, so
    alike on every rank (one taking the other path would leave the rest waiting)."""
    import socket
    import warnings
    import zlib

    import torch.distributed as dist
    able = os.environ.get("LOSSCODEGEN_EXCHANGE", "1") != "0"
    if able:
        try:
            from torch.distributed import _symmetric_memory as symm_mem
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # (deprecated where it is no longer needed)
                if hasattr(symm_mem, "enable_symm_mem_for_group"):
                    symm_mem.enable_symm_mem_for_group(group.group_name)
            trial = symm_mem.empty(1, dtype=torch.float32, device=device)
            symm_mem.rendezvous(trial, group)
        except Exception:   # an older torch, GPUs without peer access: the all-gather it is
            able = False
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode()), int(able)], dtype=torch.int64,
                        device=device)
    every = torch.empty(group_info(group)[0] * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    hosts, ok = every.view(-1, 2).unbind(1)
    return bool((hosts == hosts[0]).all() and ok.all())
