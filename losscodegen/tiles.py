"""Launch configurations by measurement: ``(BLOCK_V, num_warps, split)`` for a call.

The best tile depends on what a program keeps and loads per element (the plan's ``STATE``: the
streams of the first read, its running sums, the sums of an exact read), on the vocabulary a rank
holds and on the width of the logits; ``split`` runs a call's reads as separate launches (stats,
exact, rows and gradient) when that is faster than one launch holding them all. Where a
configuration comes from, in order:

1. the table measured on an H100 that ships with the package (``tiles.json``, written by
   ``python tests/gpu_bench.py --tune``), and the user's measurements
   (``$LOSSCODEGEN_CACHE/tiles.json``), keyed by GPU, state, vocabulary bucket and width;
2. on a GPU, a measurement at first use: every candidate is timed, replayed from a CUDA graph, on
   random inputs of the call's vocabulary (a few seconds, once; ``LOSSCODEGEN_TUNE=0`` turns it
   off) and the fastest is kept;
3. otherwise (Triton's interpreter, a CUDA graph being captured, tuning off) the plan's rule
   (``TILE``: the best of the H100 sweep at 128256 for the nearest state).

A vocab-parallel call takes ``SHARDED``, by the streams of its first read (it is not measured at
first use: that would time collectives, whose ranks must run in step). Small tiles win there for
every state (many rows in flight hide the exchange's latency): on 2 H200s at 8192 x 128256, CE 0.785
ms at (4096, 8) against 1.149 at (32768, 32). With a teacher stream, 4 warps beat 8 on 2 and on 4
H200s (the FKL mix 1.29 against 1.40 ms on 2, 0.77 against 0.90 on 4; JSD 1.92 against 2.11, 1.04
against 1.13); with the logits alone, 8 beat 4 (CE 0.775 against 0.804 on 2, 0.497 against 0.512
on 4).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from . import load


def pow2(n: int) -> int:
    """The least power of two >= n (``triton.next_power_of_2`` costs microseconds a call, on the hot
    path of a call)."""
    return 1 << max(n - 1, 0).bit_length()


CANDIDATES = ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32))
SHARDED = {"x": (4096, 8), "xt": (4096, 4)}   # by the first read's streams
SHIPPED = Path(__file__).resolve().parent / "tiles.json"
_MEASURE_ROWS = 2048


@dataclass(frozen=True)
class Config:
    block_v: int
    num_warps: int
    split: bool = False

    def launch(self, V: int, element_size: int) -> dict:
        """Kernel options for a vocabulary of V (per rank) and logits of ``element_size`` bytes: the
        tile keeps its bytes for wider logits, and shrinks with its warps to a small vocabulary."""
        block_v = self.block_v * 2 // max(element_size, 2)
        block = min(pow2(V), block_v)
        return dict(BLOCK_V=block, num_warps=max(4, self.num_warps * block // block_v))


def key(device: torch.device, k: ModuleType, V: int, element_size: int) -> str:
    streams, online, exact = k.STATE
    bucket = max(pow2(V), 4096)
    return f"{torch.cuda.get_device_name(device)}|{streams}/{online}/{exact}|{bucket}|{element_size}"


class _Table:
    """The shipped table and the user's measurements (which win), read once."""

    def __init__(self) -> None:
        self._entries: dict[str, list] | None = None

    def _path(self) -> Path:
        return load.cache_dir() / "tiles.json"

    def get(self, name: str) -> Config | None:
        if self._entries is None:
            self._entries = {}
            for path in (SHIPPED, self._path()):
                if path.exists():
                    self._entries.update(json.loads(path.read_text()))
        entry = self._entries.get(name)
        return None if entry is None else Config(*entry)

    def put(self, name: str, config: Config) -> None:
        self.get(name)
        self._entries[name] = [config.block_v, config.num_warps, config.split]
        path = self._path()
        mine = json.loads(path.read_text()) if path.exists() else {}
        mine[name] = self._entries[name]
        load.write_atomic(path, json.dumps(mine, indent=1, sort_keys=True) + "\n")


TABLE = _Table()
_forced: Config | None = None   # set while measuring


def forced() -> Config | None:
    """The configuration being measured, which every call takes meanwhile (and nobody keeps)."""
    return _forced


def choose(head, k: ModuleType, V: int, dtype: torch.dtype, device: torch.device, *,
           sharded: bool = False) -> Config:
    """The configuration for a call of ``head`` over V vocabulary columns a rank of ``dtype`` logits."""
    if _forced is not None:
        return _forced
    if sharded:
        return Config(*SHARDED[k.STATE[0]])
    rule = Config(*k.TILE)
    if device.type != "cuda":
        return rule
    name = key(device, k, V, dtype.itemsize)
    found = TABLE.get(name)
    if found is not None:
        return found
    if os.environ.get("LOSSCODEGEN_TUNE", "1") == "0" or torch.cuda.is_current_stream_capturing():
        return rule
    best = measure(head, V, dtype, device)
    TABLE.put(name, best)
    return best


def candidates(k: ModuleType, V: int) -> list[Config]:
    """The configurations worth timing for a vocabulary of V: tiles no wider than it needs, each
    also split into a launch a read where the head has an exact read."""
    top = max(pow2(V), CANDIDATES[0][0])
    tiles = [t for t in CANDIDATES if t[0] <= top]
    return [Config(b, w, split) for b, w in tiles for split in ((False, True) if k.HAS_EXACT else (False,))]


def measure(head, V: int, dtype: torch.dtype, device: torch.device, rows: int = _MEASURE_ROWS,
            reps: int = 20) -> Config:
    """Time forward + backward calls of ``head`` on random inputs with each candidate; the fastest.
    Each candidate's call is captured in a CUDA graph and replayed ``reps`` times: a call at this
    size has about as much host work as GPU work, and timed eagerly the host's noise chose the tile
    (one GPU's GSPO at 8192 x 128256 took 1.58 ms after one first-use measurement, 1.96 after
    another). It may run inside another call's forward, where autograd is off: it turns it on for
    its own calls."""
    from .testing import random_inputs
    global _forced
    logits, labels, inputs = random_inputs(head, rows, V, dtype, device)
    x = logits.requires_grad_()

    def step():
        x.grad = None
        head(x, labels, **inputs).loss.backward()
    times = {}
    side = torch.cuda.Stream(device)
    try:
        with torch.enable_grad():
            for config in candidates(head.kernel, V):
                _forced = config
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    step()              # compiles, outside the capture
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # (thread_local: another thread's CUDA calls meanwhile, a data loader pinning memory,
                # do not break the capture)
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    step()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                graph.replay()
                start.record()
                for _ in range(reps):
                    graph.replay()
                end.record()
                torch.cuda.synchronize(device)
                times[config] = start.elapsed_time(end) / reps
                del graph
    finally:
        _forced = None
        x.grad = None
    return min(times, key=times.get)
