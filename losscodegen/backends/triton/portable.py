"""``python -m losscodegen build``: every kernel a head launches, compiled for GPUs this machine
does not have (no GPU needed), and what each compiled to (registers, spills, shared memory).

The interpreter that runs the tests on a CPU accepts code that a GPU's compiler refuses, and a
kernel that compiles for one GPU may not for another (an intrinsic one vendor's library lacks). Here
each head is called on CPU tensors as a user calls it (one device with its gradient, values only,
``reduction="none"``, split launches where the plan has an exact read, vocab-parallel by all-gather
and by in-kernel exchange, teacher logits that require grad), and each launch is compiled by Triton
for the target instead of being run: exactly the kernels, constexprs and argument types the runtime
launches. The tile is the one a GPU of the target gets without an entry in the tile table (tiles.py:
the rule, fit to the target's warp), at a large vocabulary (128256 columns of bf16 logits by default).

A compiled kernel is a problem where it cannot be launched there: a block of more threads than the
target's (1024), or more shared memory than a block may have. Spills are reported, not refused.

Targets whose compilers ship inside Triton's wheel (no GPU, no CUDA or ROCm install): NVIDIA's
through Triton's own ptxas, AMD's through its LLVM and linker. Nothing here runs a kernel.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

from ... import backends, collectives
from ...head import HeadLoss
from ...testing import random_inputs
from . import dispatch, helpers, tiles


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU architecture Triton compiles for: ``backend`` and ``arch`` as Triton's ``GPUTarget``
    takes them, the threads of its warp, and the most shared memory (LDS on AMD) a block may use."""
    name: str
    backend: str
    arch: int | str
    warp_size: int
    shared_bytes: int
    gpus: str

    def gpu_target(self) -> GPUTarget:
        return GPUTarget(self.backend, self.arch, self.warp_size)


# (shared memory a block may use: NVIDIA's programming guide, its table of compute capabilities; AMD's
# CDNA3 and CDNA4 ISA guides: 64 KB of LDS a compute unit on MI300, 160 KB on MI355)
TARGETS = {t.name: t for t in (
    Target("sm_90a", "cuda", 90, 32, 227 * 1024, "H100, H200, GH200"),
    Target("sm_100a", "cuda", 100, 32, 227 * 1024, "B200, GB200"),
    Target("sm_120a", "cuda", 120, 32, 99 * 1024, "RTX 50 series, RTX PRO 6000 Blackwell"),
    Target("gfx942", "hip", "gfx942", 64, 64 * 1024, "MI300X, MI300A, MI325X"),
    Target("gfx950", "hip", "gfx950", 64, 160 * 1024, "MI350X, MI355X"),
)}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One kernel variant compiled for a target: its name and the phases it runs (``[STATS+ROWS+GRAD]``),
    its tile, and what it compiled to; ``problem`` says why it cannot be launched there (None: it can)."""
    target: str
    head: str
    kernel: str
    block_v: int | None
    num_warps: int
    registers: int | None       # a thread's (VGPRs on AMD); None where the binary does not say
    spilled: int | None         # bytes of local memory a thread (NVIDIA), spilled VGPRs + SGPRs (AMD)
    shared: int                 # bytes of shared memory a block
    problem: str | None = None

    def line(self) -> str:
        tile = f"BLOCK_V={self.block_v} " if self.block_v else ""
        used = (f"registers {self.registers}, spilled {self.spilled}, " if self.registers is not None else "")
        what = f"{used}shared {self.shared} B" if self.problem is None else f"FAILED: {self.problem}"
        return f"{self.target:8s} {self.kernel:44s} {tile}num_warps={self.num_warps}: {what}"


def parse_targets(text: str) -> list[Target]:
    """``"sm_90a,gfx942"`` (or ``"all"``) as targets; an unknown name is a ValueError naming the known."""
    names = list(TARGETS) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"--targets: unknown target(s) {unknown or [text]}; known: {', '.join(TARGETS)} (or all)")
    return [TARGETS[n] for n in names]


# the calls each head is driven through (``_drive``), by name
CALLS = ("grad", "values", "rows", "split", "sharded", "exchange", "teacher", "slices")


def build(heads: list[tuple[str, HeadLoss]], targets: list[Target], *, vocab: int = 128256,
          calls: tuple[str, ...] = CALLS, on_compiled: Callable[[Compiled], None] | None = None) -> list[Compiled]:
    """Every kernel variant that ``heads`` (each with the line that names it) launch in ``calls``
    (some of ``CALLS``: all by default) on bf16 logits, compiled for each target, in this process
    (which must not run kernels in Triton's interpreter: TRITON_INTERPRET unset before triton was
    imported). ``on_compiled`` sees each result as it comes. A head with class weights is called at
    their length instead of ``vocab``. While it runs, Triton's launches, the backend's choice and the
    tile's warp are patched (restored after): a build is a process's only work."""
    if not calls or set(calls) - set(CALLS):
        raise ValueError(f"calls must be some of {CALLS}, got {calls!r}")
    if helpers.INTERPRETED:
        raise RuntimeError("the kernels were defined for Triton's interpreter (TRITON_INTERPRET=1): "
                           "a build compiles them for GPUs, in a process without TRITON_INTERPRET")
    import torch.distributed as dist
    results: list[Compiled] = []
    owned = not dist.is_initialized()
    if owned:
        init = Path(tempfile.mkdtemp(prefix="losscodegen-build-")) / "init"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("build runs its vocab-parallel calls on a group of one process: call it "
                           "where no process group of several ranks is initialised")
    try:
        for target in targets:
            seen: set[str] = set()

            def record(item: Compiled) -> None:
                # (a variant already compiled for this target, by another head's call or another call:
                # the same binary, reported once; the head kernels' names are their heads')
                variant = f"{item.kernel} {item.block_v} {item.num_warps}"
                if variant in seen:
                    return
                seen.add(variant)
                results.append(item)
                if on_compiled is not None:
                    on_compiled(item)
            with _compiling(target, record) as current:
                for line, head in heads:
                    current["head"] = line
                    # (a copy resolves its backend again, under _compiling's resolve: Triton, which
                    # "auto" picks only where it can run, and here it compiles without running)
                    # (the row-slices kernel is Gluon for NVIDIA's asynchronous copies: its CUDA targets only)
                    _drive(copy.deepcopy(head), vocab, dist.group.WORLD,
                           calls if target.backend == "cuda" else tuple(c for c in calls if c != "slices"))
    finally:
        if owned:
            dist.destroy_process_group()
    return results


class _NoExchange:
    """Stands in for symmetric memory (which needs GPUs): the exchanging launch is compiled, never run."""

    def next(self, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return torch.zeros(rows * columns), torch.zeros(2, dtype=torch.int64), 1


def _drive(head: HeadLoss, vocab: int, group: Any, calls: tuple[str, ...]) -> None:
    """Call ``head`` as the runtime is called, on CPU tensors of ``vocab`` bf16 logits (8 rows)."""
    weights = [b for n, b in head.named_buffers() if n.startswith("class_weight_")]
    V = weights[0].numel() if weights else vocab
    logits, labels, inputs = random_inputs(head, rows=8, vocab=V)
    x = logits.to(torch.bfloat16).requires_grad_()
    inputs = {k: (v.to(torch.bfloat16) if k == "teacher_logits" else v) for k, v in inputs.items()}

    def call(**kw: Any) -> Any:
        return head(x, labels, **inputs, **kw)
    if "grad" in calls:
        call().loss.backward()                          # one device, the gradient in the same launch
    if "values" in calls:
        with torch.no_grad():
            call()
    if "rows" in calls:
        with contextlib.suppress(ValueError):           # (segment terms refuse it)
            call(reduction="none").loss.sum().backward()    # per-row values; the gradient in backward
    if "split" in calls and head.kernel.SPEC.has_exact:
        head.tile_override = dataclasses.replace(tiles.rule(head.kernel.SPEC.state), split=True)
        try:
            call().loss.backward()                      # a launch a read
        finally:
            head.tile_override = None
    if "sharded" in calls:
        call(process_group=group).loss.backward()       # vocab-parallel: stats, all-gather, the rest
    if "exchange" in calls:
        with mock.patch.object(collectives, "exchange", lambda group, device: _NoExchange()):
            call(process_group=group).loss.backward()   # ... exchanging the stats in-kernel
    if "slices" in calls and hasattr(head.kernel, f"head_loss_slices_{head.kernel.KEY}"):
        head.tile_override = tiles.Slices(16384, 8)     # the row-slices kernel (its CUDA targets)
        try:
            call().loss.backward()
        finally:
            head.tile_override = None
    if "teacher" in calls and "teacher_logits" in inputs:
        # teacher logits that require grad: the head's other kernel, which writes their gradient too
        teacher = inputs["teacher_logits"].detach().requires_grad_()
        head(x, labels, **{**inputs, "teacher_logits": teacher}).loss.backward()


@contextlib.contextmanager
def _compiling(target: Target, record: Callable[[Compiled], None]) -> Iterator[dict]:
    """Within: each Triton launch compiled for ``target`` and recorded, never run; heads copied here
    resolve "auto" to Triton; tiles fit ``target``'s warp; the Triton backend takes CPU tensors."""
    backend = make_backend(target.gpu_target())
    current = {"head": ""}

    def run(fn: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        flags = "+".join(k for k, v in kwargs.items() if v is True)
        name = f"{fn.__name__} [{flags}]" if flags else fn.__name__
        warps = options.num_warps
        try:
            source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, signature, constexprs, attrs)
            compiled = triton_compile(source, target=target.gpu_target(),
                                      options=options.__dict__)
        except Exception as e:     # (Triton's CompilationError, or its backend's: reported, the build goes on)
            record(Compiled(target.name, current["head"], name, kwargs.get("BLOCK_V"), warps, None, None, 0,
                            _reason(e)))
            return
        registers, spilled = _usage(target, compiled)
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        problem = None
        if warps * target.warp_size > tiles.MAX_THREADS:
            problem = (f"{warps} warps of {target.warp_size} threads: a block of {warps * target.warp_size} "
                       f"threads, more than the {tiles.MAX_THREADS} a block may have")
        elif shared > target.shared_bytes:
            problem = f"{shared} B of shared memory a block, more than the {target.shared_bytes} it may have"
        record(Compiled(target.name, current["head"], name, kwargs.get("BLOCK_V"), warps, registers, spilled,
                        shared, problem))

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(JITFunction, "run", run))
        stack.enter_context(mock.patch.object(dispatch.Kernel, "__call__", dispatch.Kernel.jit))
        stack.enter_context(mock.patch.object(helpers, "INTERPRETED", True))
        stack.enter_context(mock.patch.object(backends, "resolve", lambda name: "triton" if name == "auto" else name))
        stack.enter_context(mock.patch.object(tiles, "lanes", lambda device: target.warp_size))
        yield current


def _reason(error: BaseException) -> str:
    """The innermost cause of a compilation error, and the source line it stopped at."""
    line = ""
    while True:
        node, src = getattr(error, "node", None), getattr(error, "src", None)
        if src and hasattr(node, "lineno"):
            line = src.split("\n")[node.lineno - 1].strip()
        if error.__cause__ is None:
            break
        error = error.__cause__
    message = getattr(error, "error_message", None) or str(error) or type(error).__name__
    first = message.strip().splitlines()[0]
    return f"{first} (at `{line}`)" if line else first


def _usage(target: Target, compiled: Any) -> tuple[int | None, int | None]:
    """(registers a thread, spilled): from the AMD binary's metadata, or from the NVIDIA binary by
    the cuobjdump that ships with Triton's ptxas (None, None where neither can say)."""
    if target.backend == "hip":
        text = compiled.asm.get("amdgcn", "")

        def field(name: str) -> int:
            found = re.search(rf"\.{name}:\s*(\d+)", text)
            return int(found.group(1)) if found else 0
        if ".vgpr_count" not in text:
            return None, None
        return field("vgpr_count"), field("vgpr_spill_count") + field("sgpr_spill_count")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() or "cubin" not in compiled.asm:
        return None, None
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (None, None)


def summary(results: list[Compiled], targets: list[Target]) -> list[str]:
    """A line a target: how many kernel variants compiled and can launch there, the most registers,
    spills and shared memory among them, and the failures."""
    lines = []
    for target in targets:
        mine = [r for r in results if r.target == target.name]
        bad = [r for r in mine if r.problem is not None]
        good = [r for r in mine if r.problem is None]
        regs = [r.registers for r in good if r.registers is not None]
        spills = [r for r in good if r.spilled]
        most_shared = max((r.shared for r in good), default=0)
        lines.append(f"{target.name} ({target.gpus}): {len(good)} of {len(mine)} kernel variants compile and fit"
                     + (f"; registers up to {max(regs)}" if regs else "")
                     + f"; {len(spills)} spill" + f"; shared memory up to {most_shared} B of {target.shared_bytes}"
                     + (f"; FAILED: {len(bad)}, e.g. {bad[0].kernel} of {bad[0].head}: {bad[0].problem}" if bad else ""))
    return lines
