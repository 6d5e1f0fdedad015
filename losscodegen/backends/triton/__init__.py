"""The Triton backend: the kernel file rendered from ``templates/head_loss.py.j2`` (render.py), its
kernels launched with little host work (dispatch.py), the prologue and the upstream scale
(helpers.py), and the tiles (tiles.py: the shipped ``tiles.json``, the user's measurements from
tune.py, the rule)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...resources import TEMPLATES
from .. import SHARED_TEMPLATES
from . import helpers, tiles
from . import render as renderer
from .dispatch import Kernel


class Triton:
    name = "triton"
    sources = (Path(renderer.__file__), TEMPLATES / renderer.TEMPLATE, *(TEMPLATES / n for n in renderer.PHASES),
               *(TEMPLATES / n for n in SHARED_TEMPLATES))
    exchange = True         # GPUs that map each other's memory exchange stats in-kernel
    render = staticmethod(renderer.render)
    config = staticmethod(tiles.choose)
    scale_rows = staticmethod(helpers.scale_rows)
    describe_costs = staticmethod(renderer.describe_costs)

    def check_device(self, device: torch.device) -> None:
        # (read at each call: a script may compile for the GPU without one, bench/sm90_compile.py)
        if device.type == "cpu" and not helpers.INTERPRETED:
            raise ValueError("the inputs are CPU tensors, which losscodegen's kernels take only in "
                             "Triton's interpreter: set TRITON_INTERPRET=1 in the environment before "
                             "importing triton or losscodegen (or pass CUDA tensors, or build the head "
                             "with backend=\"torch\", which runs on any device)")

    def describe_config(self, state: tuple[str, int, int]) -> str:
        return (f"tile for a large vocabulary, by rule: {tiles.rule(state)} (on a GPU a measured table may "
                "choose another: losscodegen/backends/triton/tiles.py)")

    def kernel(self, fn: Any, fixed: list[Any], constexprs: dict[str, Any], options: dict[str, Any]) -> Kernel:
        return Kernel(fn, *fixed, **constexprs, **options)

    def prologue(self, count: bool) -> Kernel:
        return helpers.PROLOGUES[count]

    def tune(self, heads: list[Any], vocabs: list[int], device: torch.device, rows: int,
             out: Path | None) -> None:
        from .tune import tune    # (it drives heads: above the runtime, imported only to measure)
        tune(heads, vocabs, device, rows, out)


BACKEND = Triton()
