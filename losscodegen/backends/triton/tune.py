"""``python -m losscodegen tune``: measure the launch configuration of heads on this GPU and keep
the fastest in the table the runtime reads (tiles.py). Opt-in, never inside a user's
call: a measurement takes seconds, and timed in someone's training step it would also time their
other work. Nothing in the runtime imports this module (it drives heads, so it sits above them)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import tiles
from ...interface import FileSpec
from ...head import HeadLoss
from ...testing import random_inputs

CANDIDATES = ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32))


# the row-slices kernel's (columns a slice, warps), where the head's file has it and the GPU copies
# asynchronously (compute capability 8.0 on): 2 to 16 programs a row at 32K-256K columns
SLICES = ((16384, 8), (8192, 8), (8192, 4), (4096, 4))


def candidates(spec: FileSpec, V: int, slices: bool = False) -> list[tiles.Config | tiles.Slices]:
    """The configurations worth timing for a vocabulary of V: tiles no wider than it needs, each
    also split into a launch a read where the head has an exact read; with ``slices``, the row-slices
    kernel's too."""
    top = max(tiles.pow2(V), CANDIDATES[0][0])
    return [tiles.Config(b, w, split) for b, w in CANDIDATES if b <= top
            for split in ((False, True) if spec.has_exact else (False,))] + \
        [tiles.Slices(c, w) for c, w in SLICES if slices and c < V]


def register_caps(warps: int, regs: int, regs_per_sm: int = 65536, n: int = 2) -> list[int]:
    """The register caps worth timing for a kernel of ``warps`` warps that ptxas gave ``regs`` a
    thread: the ``n`` largest below it that each let one more program onto a multiprocessor
    (registers go to a thread 8 at a time), none below 64. Left alone, ptxas may take registers
    that cost a program a multiprocessor: GRPO + entropy + clip's 8-warp tile took 102 on the H200,
    2 programs where 80 fit 3 and ran 7% faster. Below 64 the heads measured spill heavily (the
    forward KL's 16-warp tile capped at 64: 108 spilled registers, 3.6x slower)."""
    steps = sorted({regs_per_sm // (k * 32 * warps) // 8 * 8 for k in range(1, 2048 // (32 * warps) + 1)},
                   reverse=True)
    return [cap for cap in steps if 64 <= cap < regs][:n]


# what ptxas gave a configuration's binaries (the most of them), by GPU, kernel, dtype and launch
# options: a binary compiled at another vocabulary is not compiled again, and its registers are read here
_REGISTERS: dict[tuple, int] = {}


def compiled_registers(head: HeadLoss, device: torch.device) -> dict[str, int]:
    """Registers a thread of each binary compiled so far for ``head``'s kernel on ``device``, by
    Triton's cache key (the JIT function's cache of that device: the same in Triton 3.6 and 3.9; its
    key has no device, so another device's binaries are not read)."""
    fn = getattr(head.kernel, f"head_loss_{head.kernel.KEY}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = {}
    if index in fn.device_caches:
        for key, binary in fn.device_caches[index][0].items():
            getattr(binary, "_init_handles", lambda: None)()     # (n_regs is read when the binary loads)
            found[key] = binary.n_regs
    return found


def measure(head: HeadLoss, V: int, dtype: torch.dtype, device: torch.device, rows: int = 2048,
            reps: int = 20) -> dict[tiles.Config, float]:
    """Time forward + backward calls of ``head`` on random inputs with each candidate (ms), and
    each candidate again under the register caps that would fit one or two more of its programs on
    a multiprocessor (``register_caps`` of what ptxas gave it). Each call is captured in a CUDA
    graph and replayed ``reps`` times: a call at this size has about as much host work as GPU
    work, and timed eagerly the host's noise chose the tile (one GPU's GSPO at 8192 x 128256 took
    1.58 ms after one measurement, 1.96 after another)."""
    logits, labels, inputs = random_inputs(head, rows, V, dtype, device)
    x = logits.requires_grad_()
    regs_per_sm = getattr(torch.cuda.get_device_properties(device), "regs_per_multiprocessor", 65536)

    def step():
        x.grad = None
        head(x, labels, **inputs).loss.backward()
    times = {}
    side = torch.cuda.Stream(device)
    # (the row-slices kernel where the file has it, the GPU copies asynchronously, and these inputs'
    # rows are ones its copies read: else the call would time its fallback under its name)
    slices = hasattr(head.kernel, f"head_loss_slices_{head.kernel.KEY}") and V % 16 == 0 \
        and torch.cuda.get_device_capability(device)[0] >= 8
    todo = candidates(head.kernel.SPEC, V, slices)
    try:
        while todo:
            config = todo.pop(0)
            head.tile_override = config         # (layouts made meanwhile are not kept)
            if isinstance(config, tiles.Slices):
                # the row-slices kernel, where it launches and replays in a CUDA graph (a call may be
                # captured in one: a configuration that could not is not chosen); else not timed
                try:
                    step()
                    times[config] = _timed(step, reps, device)
                except (RuntimeError, ValueError) as e:
                    torch.cuda.synchronize(device)    # (an error the device keeps is not this candidate's alone)
                    print(f"head_loss_slices_{head.kernel.KEY}, {config}: not timed ({type(e).__name__}: {e})",
                          flush=True)
                continue
            compiled = compiled_registers(head, device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step()                          # compiles, outside the capture
            torch.cuda.current_stream(device).wait_stream(side)
            if isinstance(config, tiles.Config) and config.maxnreg is None:
                # the binaries this configuration compiled (every launch of a split call its own)
                options = config.launch(V, dtype.itemsize)
                binary = (torch.cuda.get_device_name(device), head.kernel.KEY, dtype, config.split,
                          tuple(sorted(options.items())))
                regs = [n for key, n in compiled_registers(head, device).items() if key not in compiled]
                if regs:
                    _REGISTERS[binary] = max(regs)
                if binary in _REGISTERS:
                    todo += [tiles.Config(config.block_v, config.num_warps, config.split, cap)
                             for cap in register_caps(options["num_warps"], _REGISTERS[binary], regs_per_sm)]
                else:
                    # (compiled before this process's tuner ran: its registers are not known here)
                    print(f"head_loss_{head.kernel.KEY}, {config}: compiled before the tuner ran, no register "
                          "cap timed", flush=True)
            times[config] = _timed(step, reps, device)
    finally:
        head.tile_override = None
        x.grad = None
    return times


def _timed(step, reps: int, device: torch.device) -> float:
    """ms a call of ``step`` takes, replayed from a CUDA graph of it."""
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
    return start.elapsed_time(end) / reps


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
        measured = [measure(head, V, torch.bfloat16, device, rows=rows) for head, V in members]
        # a register cap is tried where it fits another program of that head's kernel: the entry
        # is chosen among the configurations every head of the state was timed with
        common = set.intersection(*(set(times) for times in measured))
        for times in measured:
            best = min(times.values())
            for config in common:
                worst[config] = max(worst.get(config, 0.0), times[config] / best)
        found[name] = min(worst, key=worst.get)
        print(f"{name}: {found[name]} ({len(members)} heads)", flush=True)
        if out is None:
            tiles.TABLE.put(name, found[name])
    if out is not None:
        out.write_text(json.dumps({n: c.entry() for n, c in sorted(found.items())},
                                  indent=1) + "\n")
    return found
