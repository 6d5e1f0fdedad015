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

    One buffer per group, in two halves that calls alternate between: a rank starts writing call
    k + 1 into a peer's half only after every rank has started call k, so nobody still reads it.
    Each half holds [world, rows, columns] fp32 stats, then [world, rows] int32 flags; a flag holds
    the number of the call that wrote it, so nothing is reset between calls."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device
        self.calls = 0
        self.capacity = 0            # fp32 elements of one half
        self._keep: list = []        # every buffer made: a peer's kernel may still write to an old one
        self.buffer: torch.Tensor | None = None
        self.peers: tuple[torch.Tensor, torch.Tensor] | None = None

    def next(self, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For one launch over ``rows`` rows: (this rank's half, as the gathered stats; the peers'
        addresses of that half; the call's number)."""
        world = group_info(self.group)[0]
        need = world * rows * (columns + 1)
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))
        self.calls += 1
        half = self.calls % 2
        return self.buffer.narrow(0, half * self.capacity, self.capacity), self.peers[half], self.calls

    def _grow(self, capacity: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem
        buffer = symm_mem.empty(2 * capacity, dtype=torch.float32, device=self.device)
        buffer.zero_()                  # no stale flag may equal a call's number
        torch.cuda.synchronize(self.device)
        handle = symm_mem.rendezvous(buffer, self.group)   # collective: every rank grows at this call
        self._keep.append((buffer, handle))
        self.buffer, self.capacity = buffer, capacity
        self.peers = tuple(torch.tensor([p + half * capacity * 4 for p in handle.buffer_ptrs], dtype=torch.int64,
                                        device=self.device) for half in (0, 1))


_EXCHANGES: dict[tuple, Exchange | None] = {}


def exchange(group: Any, device: torch.device) -> Exchange | None:
    """The group's in-kernel exchange, or None where there is none (not CUDA, GPUs that do not map
    each other's memory, ``LOSSCODEGEN_EXCHANGE=0``); never inside a CUDA graph capture, whose
    replays would repeat a call's number."""
    if group is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    key = (group, device)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = Exchange(group, device) if _can_exchange(group, device) else None
    return _EXCHANGES[key]


def _can_exchange(group: Any, device: torch.device) -> bool:
    """Every rank of ``group`` on one host (its GPUs map each other's memory through symmetric
    memory; across hosts the all-gather stays), with symmetric memory in its torch and
    ``LOSSCODEGEN_EXCHANGE`` not 0. Decided once a group, by all ranks together, so alike on every
    rank (one taking the other path would wait forever)."""
    import socket

    import torch.distributed as dist
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401  (an older torch has none)
        able = os.environ.get("LOSSCODEGEN_EXCHANGE", "1") != "0"
    except ImportError:
        able = False
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, (socket.gethostname(), able), group=group)
    return len({host for host, _ in ranks}) == 1 and all(ok for _, ok in ranks)
