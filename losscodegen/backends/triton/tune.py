"""``python -m losscodegen tune``: measure the launch configuration of heads on this GPU and keep
the fastest in the table the runtime reads (tiles.py). Opt-in, never inside a user's
call: a measurement takes seconds, and timed in someone's training step it would also time their
other work. Nothing in the runtime imports this module (it drives heads, so it sits above them)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import tiles
from ...emit import FileSpec
from ...head import HeadLoss
from ...testing import random_inputs

CANDIDATES = ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32))


def candidates(spec: FileSpec, V: int) -> list[tiles.Config]:
    """The configurations worth timing for a vocabulary of V: tiles no wider than it needs, each
    also split into a launch a read where the head has an exact read."""
    top = max(tiles.pow2(V), CANDIDATES[0][0])
    return [tiles.Config(b, w, split) for b, w in CANDIDATES if b <= top
            for split in ((False, True) if spec.has_exact else (False,))]


def measure(head: HeadLoss, V: int, dtype: torch.dtype, device: torch.device, rows: int = 2048,
            reps: int = 20) -> dict[tiles.Config, float]:
    """Time forward + backward calls of ``head`` on random inputs with each candidate (ms). Each
    candidate's call is captured in a CUDA graph and replayed ``reps`` times: a call at this
    size has about as much host work as GPU work, and timed eagerly the host's noise chose the tile
    (one GPU's GSPO at 8192 x 128256 took 1.58 ms after one measurement, 1.96 after another)."""
    logits, labels, inputs = random_inputs(head, rows, V, dtype, device)
    x = logits.requires_grad_()

    def step():
        x.grad = None
        head(x, labels, **inputs).loss.backward()
    times = {}
    side = torch.cuda.Stream(device)
    try:
        for config in candidates(head.kernel.SPEC, V):
            head.tile_override = config         # (layouts made meanwhile are not kept)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step()                          # compiles, outside the capture
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # (thread_local: another thread's CUDA calls meanwhile do not break the capture)
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
        head.tile_override = None
        x.grad = None
    return times


def tune(heads: list[HeadLoss], vocabs: list[int], device: torch.device, rows: int,
         out: Path | None = None) -> dict[str, tiles.Config]:
    """The fastest configuration of each head's plan state at each vocabulary (bf16 logits), kept in
    the user's table (or written to ``out``, the form shipped as losscodegen/backends/triton/tiles.json)."""
    # heads of one plan state share its entry: the configuration whose slowest head, against that
    # head's own best, is the least slow (one head's best can be another's worst; with a sum of
    # times, on the H100, a head slow at GRPO + entropy's best tile chose 8192/8 for all: GRPO 1.86
    # ms against 1.63 at its own 32768/32)
    groups: dict[str, list[tuple[HeadLoss, int]]] = {}
    for head in heads:
        for V in vocabs:
            groups.setdefault(tiles.key(device, head.kernel.SPEC, V, 2), []).append((head, V))
    found: dict[str, tiles.Config] = {}
    for name, members in groups.items():
        worst: dict[tiles.Config, float] = {}
        for head, V in members:
            times = measure(head, V, torch.bfloat16, device, rows=rows)
            best = min(times.values())
            for config, ms in times.items():
                worst[config] = max(worst.get(config, 0.0), ms / best)
        found[name] = min(worst, key=worst.get)
        print(f"{name}: {found[name]} ({len(members)} heads)", flush=True)
        if out is None:
            tiles.TABLE.put(name, found[name])
    if out is not None:
        out.write_text(json.dumps({n: c.entry() for n, c in sorted(found.items())},
                                  indent=1) + "\n")
    return found
