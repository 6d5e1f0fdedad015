"""The torch backend: the kernel file rendered from ``templates/head_loss_torch.py.j2`` (render.py),
a module of torch ops that computes what the Triton file's kernels compute, on any device torch
runs on and without Triton. Its launches are calls of the file's functions; the prologue and the
upstream scale are a few torch ops (``prologue``, ``scale_rows``).

Its files are generated at first use into the cache (``python -m losscodegen generate`` writes the
Triton backend's kernels for the package's generated/).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ...resources import TEMPLATES
from .. import SHARED_TEMPLATES
from . import render as renderer

# The vocabulary columns of a block (with launch.py's BLOCK_R rows a chunk, 256: temporaries of
# [256, 4096] fp32, 4 MiB each, whatever the rows and the vocabulary).
BLOCK_V = 4096


@dataclass(frozen=True)
class Config:
    """A call's launch configuration: the vocabulary block, and whether its reads run as a launch each."""

    block_v: int = BLOCK_V
    split: bool = False
    kernel = "head_loss"   # (the file's one head kernel)

    def launch(self, V: int, element_size: int) -> dict[str, Any]:
        return dict(BLOCK_V=max(1, min(V, self.block_v)))


class _Launch:
    """A function of a kernel file with its fixed arguments and constants bound: ``(grid, *args)``
    calls it over the launch's rows (the grid, one program a row in Triton's, is implied by them)."""

    def __init__(self, fn: Callable[..., None], fixed: list[Any], constexprs: dict[str, Any]) -> None:
        self.fn, self.fixed, self.constexprs = fn, tuple(fixed), constexprs

    def __call__(self, grid: int, *args: Any) -> None:
        self.fn(*args, *self.fixed, **self.constexprs)


def _prologue(count: bool) -> Callable[..., None]:
    def prologue(grid: int, ws: torch.Tensor, n_zero: int, labels: torch.Tensor | None,
                 mask: torch.Tensor | None, n_rows: int, ignore_index: int, count_slot: int) -> None:
        # zeroes what the kernel accumulates into (its first n_zero slots), then counts the valid
        # rows, the default divisor, into its slot (exact in fp32 below 2**24 rows)
        ws[:n_zero].zero_()
        if count:
            live = labels != ignore_index if labels is not None else torch.ones(n_rows, dtype=torch.bool,
                                                                                 device=ws.device)
            if mask is not None:
                live = live & mask
            ws[count_slot] = live.sum()
    return prologue


_PROLOGUES = {count: _prologue(count) for count in (False, True)}
_SCALE_ELEMENTS = 1 << 20   # elements of a chunk of rows that scale_rows converts to fp32 at once


def scale_rows(grad: torch.Tensor, upstream: torch.Tensor) -> None:
    """``grad`` [rows, V] times ``upstream`` (a scalar, or one value a row), in place, in fp32 a
    chunk of rows at a time."""
    g = upstream.float().reshape(-1, 1) if upstream.dim() else upstream.float()
    rows = max(1, _SCALE_ELEMENTS // max(grad.shape[1], 1))
    for lo in range(0, grad.shape[0], rows):
        part = grad[lo:lo + rows]
        part.copy_(part.float() * (g[lo:lo + rows] if g.dim() else g))


class Torch:
    name = "torch"
    sources = (Path(renderer.__file__), TEMPLATES / renderer.TEMPLATE, *(TEMPLATES / n for n in SHARED_TEMPLATES))
    exchange = False        # vocab shards' stats go through collectives (no in-kernel exchange)
    render = staticmethod(renderer.render)
    scale_rows = staticmethod(scale_rows)

    def check_device(self, device: torch.device) -> None:
        """Any device torch runs on."""

    def config(self, head: Any, k: Any, V: int, dtype: torch.dtype, device: torch.device, *,
               sharded: bool) -> Config:
        return head.tile_override if head.tile_override is not None else Config()

    def describe_config(self, plan: Any) -> str:
        return f"torch backend: blocks of {BLOCK_V} vocabulary columns, chunks of rows (launch.py's BLOCK_R)"

    def describe_costs(self, plan: Any) -> str:
        return "torch backend: the printed formulas as torch ops on [rows, block] tensors"

    def kernel(self, fn: Any, fixed: list[Any], constexprs: dict[str, Any], options: dict[str, Any]) -> _Launch:
        return _Launch(fn, fixed, constexprs)

    def prologue(self, count: bool) -> Callable[..., None]:
        return _PROLOGUES[count]

    def tune(self, heads: list[Any], vocabs: list[int], device: torch.device, rows: int,
             out: Path | None) -> None:
        raise SystemExit("the torch backend has no launch configurations to measure (tune is Triton's)")


BACKEND = Torch()
