"""Launching the row-slices kernel (issue 47; templates/gluon/_slices.j2): a persistent grid of the
programs that fit on the GPU at once, in groups of G a row, and the launch's buffer of their counts
and exchanged stats.

Every program of a group waits for the others at each row, so all must be resident at once: the grid
is what the compiled kernel's registers and shared memory let each multiprocessor hold, and the launch
is cooperative (the driver refuses a grid that could not all be resident, rather than hanging)."""
from __future__ import annotations

from typing import Any

import torch

from .. import _interpreting as interpreting
from .dispatch import Kernel, _spec


def resident_per_sm(n_regs: int, shared: int, num_warps: int, props: Any) -> int:
    """Programs of a kernel a multiprocessor holds at once: the least that its registers (a warp's
    allocated 256 at a time), its shared memory (and the 1 KB the driver reserves a block) and its
    threads allow (CUDA's occupancy rules for compute capability 9.x)."""
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = props.regs_per_multiprocessor // (warp_regs * num_warps)
    by_shared = props.shared_memory_per_multiprocessor // (shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return min(by_regs, by_shared, by_threads, 32)


class SliceKernel:
    """The row-slices kernel of a head's file with its fixed arguments and constexprs bound (``G``
    among them), launched as the head kernel is: ``(rows of the launch, *its arguments)``."""

    def __init__(self, fn: Any, *fixed: Any, **constexprs: Any) -> None:
        self.kernel = Kernel(fn, *fixed, **constexprs)
        names = fn.arg_names
        self.G = constexprs["G"]
        # (the file's packed stats and exact sums: its COLUMNS and EXACT)
        module = fn.fn.__globals__
        self.width = 2 + self.G * (len(module["COLUMNS"]) + len(module["EXACT"]))
        self.at_buffer = names.index("gathered_ptr")
        self._groups: dict[tuple, int] = {}

    def __call__(self, grid: int, *args: Any) -> None:
        x = args[0]
        if x.device.type != "cuda" and interpreting():
            raise ValueError("the row-slices kernel (a Slices configuration) runs on a GPU only: Triton's "
                             "interpreter does not run Gluon")
        args = list(args)
        # each row's two counts (zeroed: the programs count their arrivals), then the exchanged stats
        args[self.at_buffer] = torch.zeros(self.width * grid, device=x.device)
        if x.device.type != "cuda":      # (compiled, not run: python -m losscodegen build)
            self.kernel(self.G, *args)
            return
        # (a group at least: its last program writes the outputs, whatever the rows)
        key = (x.device, *map(_spec, args))
        groups = self._groups.get(key) or self._fit(args, x.device)
        while True:
            try:
                self.kernel(self.G * max(min(groups, grid), 1), *args)
                break
            except RuntimeError as e:
                # (a grid the driver finds larger than fits at once, where the occupancy rules above
                # counted more: half of it, until it fits)
                if "cooperative" not in str(e).lower() or groups == 1:
                    raise
                groups = min(groups, grid) // 2
        # (kept as launched: a grid clipped to fewer rows than groups was not tried at full size, and a
        # later call with more rows that the driver refuses halves it again)
        self._groups[key] = groups

    def _fit(self, args: list, device: torch.device) -> int:
        """Groups of G programs all resident at once on ``device`` for these arguments' kernel, by
        CUDA's occupancy rules from what the kernel compiled to."""
        k = self.kernel
        compiled = k.fn.warmup(*args, *k.fixed, grid=(1,), **k.constexprs)
        compiled._init_handles()       # (n_regs is read when the binary loads)
        props = torch.cuda.get_device_properties(device)
        per_sm = resident_per_sm(compiled.n_regs, compiled.metadata.shared, k.constexprs["num_warps"], props)
        groups = per_sm * props.multi_processor_count // self.G
        if groups == 0:
            raise ValueError(f"the row-slices kernel's {self.G} programs a row do not fit on {device} at once "
                             f"({compiled.n_regs} registers a thread, {compiled.metadata.shared} B of shared "
                             "memory a program): take a Slices configuration of wider slices or no Slices")
        return groups
