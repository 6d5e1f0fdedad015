"""Collectives: vocab-parallel heads exchange their packed row statistics, and segment terms sum
their segments over a sequence-parallel group. One round each, whatever the terms."""
from __future__ import annotations

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
