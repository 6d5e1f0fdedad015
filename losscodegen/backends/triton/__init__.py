"""The Triton backend: the kernel file rendered from ``templates/head_loss.py.j2`` (render.py), its
kernels launched with little host work (dispatch.py), the prologue and the upstream scale
(helpers.py), and the tiles (tiles.py: the shipped ``tiles.json``, the user's measurements from
tune.py, the rule)."""
from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ...interface import holds_row_slices
from ...resources import TEMPLATES
from .. import SHARED_TEMPLATES
from . import helpers, tiles
from . import render as renderer
from .dispatch import Kernel
from .slices import SliceKernel


class Triton:
    name = "triton"
    sources = (Path(renderer.__file__), TEMPLATES / renderer.TEMPLATE, *(TEMPLATES / n for n in renderer.PHASES),
               *(TEMPLATES / n for n in SHARED_TEMPLATES))
    exchange = True         # GPUs that map each other's memory exchange stats in-kernel
    render = staticmethod(renderer.render)
    scale_rows = staticmethod(helpers.scale_rows)
    describe_costs = staticmethod(renderer.describe_costs)

    def check_device(self, device: torch.device) -> None:
        # (read at each call: a script may compile for the GPU without one, bench/sm90_compile.py)
        if device.type == "cpu" and not helpers.INTERPRETED:
            raise ValueError("the inputs are CPU tensors, which losscodegen's kernels take only in "
                             "Triton's interpreter: set TRITON_INTERPRET=1 in the environment before "
                             "importing triton or losscodegen (or pass CUDA tensors, or build the head "
                             "with backend=\"torch\", which runs on any device)")

    def config(self, head: Any, k: Any, V: int, dtype: torch.dtype, device: torch.device, *,
               sharded: bool = False) -> tiles.Config:
        if not sharded and head.tile_override is None and _tune_first_use(device) \
                and tiles.measured(k, V, dtype, device) is None:
            _measure_once(head, V, dtype, device)
        return tiles.choose(head, k, V, dtype, device, sharded=sharded)

    def describe_config(self, plan: Any) -> str:
        slices = ("the file also has the row-slices kernel (each element read from HBM once: the row split over "
                  "programs holding it in shared memory), which runs only where the tile table holds a Slices "
                  "configuration measured faster on that GPU (python -m losscodegen tune), for a call with its "
                  "gradient in one launch" if holds_row_slices(plan) else
                  "no row-slices kernel (segment statistics, top-k entries, a teacher's gradient, the row's "
                  "argmax or a compensated sum: interface.holds_row_slices)")
        return (f"tile for a large vocabulary, by rule: {tiles.rule(plan.state)} (on a GPU a measured table may "
                f"choose another: losscodegen/backends/triton/tiles.py); {slices}")

    def kernel(self, fn: Any, fixed: list[Any], constexprs: dict[str, Any],
               options: dict[str, Any]) -> Kernel | SliceKernel:
        # (the row-slices kernel is the one that takes G, its programs a row)
        return (SliceKernel if "G" in constexprs else Kernel)(fn, *fixed, **constexprs, **options)

    # a configuration of the row-slices kernel (tiles.Slices), for the fuzzer to force
    row_slices = staticmethod(tiles.Slices)

    def prologue(self, count: bool) -> Kernel:
        return helpers.PROLOGUES[count]

    @property
    def portable(self) -> ModuleType:
        """``python -m losscodegen build``: the kernels compiled for GPUs this machine need not have
        (portable.py; it drives heads, so it is imported only to build)."""
        from . import portable
        return portable

    def tune(self, heads: list[Any], vocabs: list[int], device: torch.device, rows: int,
             out: Path | None) -> None:
        from .tune import tune    # (it drives heads: above the runtime, imported only to measure)
        tune(heads, vocabs, device, rows, out)


# the tiles measured (or tried) on first use in this process: each key once, a failure not retried
_FIRST_USE: set[str] = set()


def _tune_first_use(device: torch.device) -> bool:
    """Whether a call may measure its tile (``LOSSCODEGEN_TUNE=first-use``; never while a CUDA graph
    is captured or torch.compile traces, where launching other work would break them)."""
    value = os.environ.get("LOSSCODEGEN_TUNE", "")
    if value not in ("", "first-use"):
        raise ValueError(f"LOSSCODEGEN_TUNE must be 'first-use' or unset, got {value!r}")
    return (value == "first-use" and device.type == "cuda" and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


def _measure_once(head: Any, V: int, dtype: torch.dtype, device: torch.device) -> None:
    """Time tune's candidates for ``head``'s plan state at V (a copy of the head on random inputs:
    the call's own head and inputs are left alone) and keep the fastest in the user's table."""
    from .tune import measure    # (it drives heads: above the runtime, imported only to measure)
    name = tiles.key(device, head.kernel.SPEC, V, dtype.itemsize)
    if name in _FIRST_USE:
        return
    _FIRST_USE.add(name)
    try:
        # (the call may be inside an autograd Function's forward, where grad mode is off)
        with torch.inference_mode(False), torch.enable_grad():
            times = measure(copy.deepcopy(head), V, dtype, device)
    except Exception as e:     # a measurement that fails leaves the call its rule's tile, said once
        warnings.warn(f"LOSSCODEGEN_TUNE=first-use: measuring {name} failed ({type(e).__name__}: {e}); "
                      "the rule's tile is used", stacklevel=2)
        return
    tiles.TABLE.put(name, min(times, key=times.get))


BACKEND = Triton()
