"""Issue 47, measured before it is built: cross-entropy forward + gradient in one launch that reads each
logit from HBM once, the row slice held in shared memory, loaded by asynchronous copies with the next
rows' slices in flight, written in Triton's Gluon dialect (``triton.experimental.gluon``).

``bench/row_on_chip.py`` held the slice in registers and was bound by the bytes it could keep in flight
a multiprocessor (docs/decisions.md, "The row on the chip"). Here each program of a persistent grid

1. issues ``cp.async`` copies (16 bytes a thread an instruction, Ampere-style ``async_copy``: no
   registers hold the data) of its slice of row ``r + (NBUF-1)*groups`` into one of NBUF shared-memory
   buffers, so NBUF-1 rows' slices are in flight while it works on row r;
2. waits for row r's copies, computes the slice's max, then its sum of exp2((x - max)*log2 e), each a
   sweep over the slice in shared memory (chunks of CHUNK columns: few registers, many programs a
   multiprocessor);
3. exchanges (max, sum) with the other G-1 programs of its row through global memory behind a per-row
   counter (release ``atomic_add``, acquire spin), as row_on_chip.py does;
4. writes the gradient ``(softmax - onehot) / n_valid`` from the same shared-memory slice (a third sweep),
   and the member holding the label's column writes the row's loss.

Ignored rows (label -100) are neither copied nor reduced: their gradient is written as zeros.

    python bench/gluon_row.py --compile-only      # no GPU: compile every config for sm_90a, print
                                                  # registers / shared memory / spills (Triton 3.6 and 3.9)
    python bench/gluon_row.py [--out DIR]         # one CUDA GPU: check against float64, then time beside
                                                  # lcg.HeadLoss(lcg.CrossEntropy()) and a D2D copy

Imports torch, triton, losscodegen, bench/row_on_chip.py and bench/bench.py (an experiment, not part of
the package). Clusters (``nvidia.hopper.cluster``, distributed shared memory) are Triton 3.9-only and the
GPU image has 3.6: this prototype exchanges through global memory on both.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gl_builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import row_on_chip as roc   # noqa: E402  (the float64 reference, the error metrics, residency)

IGNORE = -100
MAX_SPIN = roc.MAX_SPIN

# Gluon's API moves between releases (docs/decisions.md, "Gluon in Triton 3.6 and 3.9"): the two names
# that differ for this kernel, resolved once. Both are Gluon builtins, which a kernel may read as globals.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier                    # 3.6 | 3.9
_async_copy = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared      # 3.9 | 3.6


@_gl_builtin
def _reinterpret(desc, dtype, shape, layout, _semantic=None):
    """``desc`` viewed with another shape and layout: ``_reinterpret`` in 3.6, ``reinterpret`` in 3.9."""
    view = getattr(desc, "reinterpret", None) or desc._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def _issue_slice(bufs, slot, x_ptr, x_stride, row, label, n_rows, V, base, offs2,
                 CHUNK: gl.constexpr, N_CHUNKS: gl.constexpr):
    """Asynchronous copies of columns [base, base + CHUNK*N_CHUNKS) of ``row`` into buffer ``slot`` of
    ``bufs`` ([NBUF, N_CHUNKS, CHUNK]), as one operation and one commit group (always one, even empty: the
    wait counts groups). One operation, not one a chunk: Triton's shared-memory barrier pass puts a
    bar.sync between any two copies into one allocation. ``offs2``: [N_CHUNKS, CHUNK] column offsets.
    Nothing is read for a row past the end or an ignored one (copies masked off); columns past V are
    not read either (their shared memory is left as is and masked to -inf where it is read)."""
    lim = gl.where((row < n_rows) & (label != -100), V - base, 0)
    src = x_ptr + row.to(gl.int64) * x_stride + base
    _async_copy(bufs.index(slot), src + offs2, offs2 < lim)
    cp.commit_group()


@gluon.jit
def _label(y_ptr, row, n_rows):
    """The row's label, IGNORE past the last row (such a row is never copied nor written)."""
    return gl.load(y_ptr + row, mask=row < n_rows, other=-100).to(gl.int32)


@gluon.jit
def _slice_stats(chunks, first, offs, lim, CHUNK: gl.constexpr, N_CHUNKS: gl.constexpr, layout: gl.constexpr,
                 MASKED: gl.constexpr):
    """(max, sum of exp(x - max)) of the slice in chunks first ... first + N_CHUNKS - 1: two sweeps of
    shared memory, elementwise accumulators, one reduction each. The max in the logits' dtype (bf16: two
    columns an instruction); columns past the row's end (MASKED: the last member's slice) are -inf."""
    LOG2E: gl.constexpr = 1.4426950408889634
    mv = gl.full([CHUNK], float("-inf"), chunks.dtype, layout)
    for c in range(N_CHUNKS):
        x = chunks.index(first + c).load(layout)
        if MASKED:
            x = gl.where(c * CHUNK + offs < lim, x, float("-inf"))
        mv = gl.maximum(mv, x).to(chunks.dtype)   # (3.6 computes a bf16 max in fp32; exact either way)
    m = gl.max(mv.to(gl.float32), axis=0)
    m_log2e = gl.where(m == float("-inf"), 0.0, m) * LOG2E    # an empty slice: no NaN
    sv = gl.zeros([CHUNK], gl.float32, layout)
    for c in range(N_CHUNKS):
        e = gl.exp2(chunks.index(first + c).load(layout).to(gl.float32) * LOG2E - m_log2e)
        if MASKED:
            e = gl.where(c * CHUNK + offs < lim, e, 0.0)
        sv += e
    return m, gl.sum(sv, axis=0)


@gluon.jit
def _slice_grad(chunks, first, offs, lim, grad_row, shift, CHUNK: gl.constexpr, N_CHUNKS: gl.constexpr,
                layout: gl.constexpr, MASKED: gl.constexpr):
    """The dense part of the slice's gradient, exp2(x*log2 e - shift) = softmax / n_valid (``shift``
    holds the row's log-sum-exp and the scale), from shared memory; the label's column is fixed after."""
    LOG2E: gl.constexpr = 1.4426950408889634
    for c in range(N_CHUNKS):
        cols = c * CHUNK + offs
        x = chunks.index(first + c).load(layout).to(gl.float32)
        dz = gl.exp2(x * LOG2E - shift).to(grad_row.dtype.element_ty)
        if MASKED:
            gl.store(grad_row + cols, dz, mask=cols < lim, cache_modifier=".cs")
        else:
            gl.store(grad_row + cols, dz, cache_modifier=".cs")


@gluon.jit
def _ce_smem_row(x_ptr, x_stride, grad_ptr, grad_stride, y_ptr, n_valid_ptr, loss_rows_ptr,
                 scratch_ptr, count_ptr, err_ptr, n_rows, V, max_spin,
                 G: gl.constexpr, G_P2: gl.constexpr, SLICE: gl.constexpr, CHUNK: gl.constexpr,
                 NBUF: gl.constexpr):
    """Programs in groups of G; group g takes rows g, g + groups, ... (every member the same rows in the
    same order: the barrier relies on it, as in row_on_chip.py). Member k holds columns
    [k*SLICE, (k+1)*SLICE) of each of its rows in shared memory."""
    LOG2E: gl.constexpr = 1.4426950408889634
    N_CHUNKS: gl.constexpr = SLICE // CHUNK
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = CHUNK // (32 * NW)
    # a thread's VEC consecutive columns: 16-byte copies and shared loads for bf16 at VEC = 8
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    layout2: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [1, NW], [1, 0])   # a slice's copy
    small: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    smem_layout2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    pid = gl.program_id(0)
    n_groups = gl.num_programs(0) // G
    group = pid // G
    member = pid % G
    base = member * SLICE
    lim = V - base                                   # this member's columns in the row (may exceed SLICE)
    full_slice = lim >= SLICE                        # every member but the last: no masks
    offs = gl.arange(0, CHUNK, layout=layout)
    offs2 = (gl.arange(0, N_CHUNKS, layout=gl.SliceLayout(1, layout2))[:, None] * CHUNK
             + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout2))[None, :])
    # NBUF buffers of N_CHUNKS chunks: chunk c of buffer b is chunks.index(b * N_CHUNKS + c), so that
    # the sweeps are loops over c (few registers, many programs a multiprocessor); the copies write the
    # same memory viewed as bufs[NBUF, N_CHUNKS, CHUNK], a buffer an operation. (Shapes are powers of 2.)
    chunks = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NBUF * N_CHUNKS, CHUNK], smem_layout)
    bufs = _reinterpret(chunks, x_ptr.dtype.element_ty, [NBUF, N_CHUNKS, CHUNK], smem_layout2)
    n_valid = gl.maximum(gl.load(n_valid_ptr).to(gl.float32), 1.0)
    grad_scale = 1.0 / n_valid            # the mean over the valid rows
    log2_n_valid = gl.log2(n_valid)
    spins_left = max_spin

    # Prologue: the first NBUF-1 rows' slices in flight, and the label of the next row to issue.
    for ahead in gl.static_range(NBUF - 1):
        row_a = group + ahead * n_groups
        _issue_slice(bufs, ahead, x_ptr, x_stride, row_a, _label(y_ptr, row_a, n_rows), n_rows, V, base,
                     offs2, CHUNK, N_CHUNKS)
    y_issue = _label(y_ptr, group + (NBUF - 1) * n_groups, n_rows)

    i = 0
    for r in range(group, n_rows, n_groups):
        row = r.to(gl.int64)
        # Every thread is done reading the buffer of row r - groups (the previous iteration's gradient
        # sweep), which the copies below overwrite.
        _cta_barrier()
        row_issue = r + (NBUF - 1) * n_groups
        _issue_slice(bufs, (i + NBUF - 1) % NBUF, x_ptr, x_stride, row_issue, y_issue, n_rows, V,
                     base, offs2, CHUNK, N_CHUNKS)
        y_issue = _label(y_ptr, row_issue + n_groups, n_rows)   # for the next iteration: its latency hidden
        y = _label(y_ptr, r, n_rows)
        # the member whose slice holds the label's column reads that logit (one scalar, from L2)
        owns_y = (y >= base) & (y < base + SLICE)
        z_y = gl.load(x_ptr + row * x_stride + y, mask=owns_y, other=0.0).to(gl.float32)
        cp.wait_group(NBUF - 1)      # this thread's copies of row r have landed ...
        _cta_barrier()               # ... and every thread's
        first = (i % NBUF) * N_CHUNKS   # this row's first chunk
        grad_row = grad_ptr + row * grad_stride + base
        if y != -100:
            if full_slice:
                m, s = _slice_stats(chunks, first, offs, lim, CHUNK, N_CHUNKS, layout, False)
            else:
                m, s = _slice_stats(chunks, first, offs, lim, CHUNK, N_CHUNKS, layout, True)
            if G == 1:
                big_m = gl.where(m == float("-inf"), 0.0, m)
                big_s = s
            else:
                # Exchange through global memory: partials out, then the row's counter. The barrier
                # orders every thread's work before the one release (cumulative in PTX); the acquire on
                # the count orders the partials' loads after every member's arrival. NBUF-1 rows'
                # copies stay in flight throughout.
                part = scratch_ptr + row * (2 * G)
                gl.store(part + 2 * member, m)
                gl.store(part + 2 * member + 1, s)
                _cta_barrier()
                gl.atomic_add(count_ptr + row, 1, sem="release")
                seen = gl.atomic_add(count_ptr + row, 0, sem="acquire")
                while (seen < G) & (spins_left > 0):
                    seen = gl.atomic_add(count_ptr + row, 0, sem="acquire")
                    spins_left -= 1
                if seen < G:
                    gl.atomic_xchg(err_ptr, 1)   # a member never arrived: results are wrong, say so
                mem = gl.arange(0, G_P2, layout=small)
                ms = gl.load(part + 2 * mem, mask=mem < G, other=float("-inf"), cache_modifier=".cg")
                ss = gl.load(part + 2 * mem + 1, mask=mem < G, other=0.0, cache_modifier=".cg")
                big_m = gl.max(ms, axis=0)
                big_m = gl.where(big_m == float("-inf"), 0.0, big_m)
                big_s = gl.sum(ss * gl.exp2(ms * LOG2E - big_m * LOG2E), axis=0)
            log2_s = gl.log2(big_s)
            # dL/dz = softmax / n_valid - onehot / n_valid: the dense part from the same shared memory
            # (no second HBM read), 1/n_valid folded into the exponent
            shift = big_m * LOG2E + log2_s + log2_n_valid
            if full_slice:
                _slice_grad(chunks, first, offs, lim, grad_row, shift, CHUNK, N_CHUNKS, layout, False)
            else:
                _slice_grad(chunks, first, offs, lim, grad_row, shift, CHUNK, N_CHUNKS, layout, True)
            # The label's column: its dense value minus 1/n_valid, rounded once, stored after the barrier
            # (which orders it after the sweep's store of the same element); and the row's loss.
            _cta_barrier()
            if owns_y:
                p_y = gl.exp2(z_y * LOG2E - shift)
                gl.store(grad_ptr + row * grad_stride + y, (p_y - grad_scale).to(grad_ptr.dtype.element_ty))
                gl.store(loss_rows_ptr + row, big_m + log2_s / LOG2E - z_y)
        else:
            if member == 0:
                gl.store(loss_rows_ptr + row, 0.0)
            zero = gl.zeros([CHUNK], grad_ptr.dtype.element_ty, layout)
            for c in range(N_CHUNKS):
                cols = c * CHUNK + offs
                gl.store(grad_row + cols, zero, mask=cols < lim, cache_modifier=".cs")
        i += 1
    cp.wait_group(0)   # (the copies issued for rows past the end are all empty)


@dataclass(frozen=True)
class Config:
    """G programs a row, each holding ``slice`` columns (a multiple of ``chunk``) in ``nbuf`` shared
    buffers (nbuf - 1 rows ahead in flight), ``num_warps`` warps; ``chunk`` = 8 bf16 (16 bytes) a thread
    times the threads, or a multiple."""
    G: int
    slice: int
    chunk: int
    nbuf: int
    num_warps: int

    @staticmethod
    def for_slice(V: int, slice_cols: int, num_warps: int, nbuf: int, chunk: int | None = None) -> "Config":
        chunk = chunk or 8 * 32 * num_warps
        G = triton.cdiv(V, slice_cols)
        sl = max(triton.next_power_of_2(triton.cdiv(V, G)), chunk)   # (Gluon's shapes: powers of 2)
        return Config(G, sl, chunk, nbuf, num_warps)

    @property
    def name(self) -> str:
        return f"G={self.G} slice={self.slice} chunk={self.chunk} nbuf={self.nbuf} warps={self.num_warps}"


def _constexprs(cfg: Config) -> dict:
    return dict(G=cfg.G, G_P2=max(triton.next_power_of_2(cfg.G), 1), SLICE=cfg.slice, CHUNK=cfg.chunk,
                NBUF=cfg.nbuf, num_warps=cfg.num_warps)


def _arguments(x: torch.Tensor, y: torch.Tensor, cfg: Config, grad: torch.Tensor | None = None
               ) -> tuple[tuple, tuple]:
    """The kernel's arguments for a call, and (gradient, per-row losses, valid rows, error flag)."""
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 16 or x.shape[1] % 16:
        raise ValueError("x: contiguous bf16 rows of a multiple of 16 columns (16-byte async copies)")
    R, V = x.shape
    grad = torch.empty_like(x) if grad is None else grad
    loss_rows = torch.empty(R, device=x.device, dtype=torch.float32)
    n_valid = (y != IGNORE).sum(dtype=torch.int32)
    ws = torch.zeros(R + 1, device=x.device, dtype=torch.int32)   # counters, then the flag
    scratch = torch.empty(R * cfg.G * 2, device=x.device, dtype=torch.float32)
    err = ws[-1:]
    args = (x, x.stride(0), grad, grad.stride(0), y, n_valid, loss_rows, scratch, ws, err, R, V, MAX_SPIN)
    return args, (grad, loss_rows, n_valid, err)


_RESIDENT: dict = {}


def resident_programs(cfg: Config, x: torch.Tensor) -> tuple[int, dict]:
    """Programs of this config resident at once on x's GPU (a multiple of G), and the compiled kernel's
    registers / spills / shared memory: the deadlock argument is row_on_chip.resident_programs'. The
    count a multiprocessor is row_on_chip's estimate from the kernel's resources, or the driver's
    occupancy answer where that is lower (with the carveout asked at its largest for shared memory)."""
    key = (cfg, tuple(x.shape), x.device)
    if key not in _RESIDENT:
        y = torch.zeros(x.shape[0], device=x.device, dtype=torch.int64)
        args, _ = _arguments(x, y, cfg)
        k = _ce_smem_row.warmup(*args, grid=(1,), **_constexprs(cfg))
        per_sm, info = roc.blocks_per_sm(k, cfg.num_warps, x.device)
        info["occupancy_api"] = _driver_occupancy(k, cfg.num_warps)
        if info["occupancy_api"] is not None:
            per_sm = min(per_sm, info["occupancy_api"])
        n_sm = torch.cuda.get_device_properties(x.device).multi_processor_count
        _RESIDENT[key] = (per_sm * n_sm // cfg.G * cfg.G, info)
    return _RESIDENT[key]


def _driver_occupancy(k, num_warps: int) -> int | None:
    """cuOccupancyMaxActiveBlocksPerMultiprocessor for the loaded kernel (Triton's shared memory is all
    dynamic), after asking for the largest shared-memory carveout; None where cuda-python fails."""
    try:
        from cuda.bindings import driver as cu
        f = cu.CUfunction(k.function)
        cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, 32 * num_warps, k.metadata.shared)
        return int(n) if err == cu.CUresult.CUDA_SUCCESS else None
    except Exception as exc:   # (cuda-python missing or another version: the estimate alone decides)
        print(f"  occupancy API not used: {type(exc).__name__}: {exc}", flush=True)
        return None


def ce_gluon_row(x: torch.Tensor, y: torch.Tensor, cfg: Config, *, grad: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over the valid rows, dlogits in bf16, error flag): one launch, and the same
    small torch work around it as row_on_chip.ce_row_on_chip (its doc says what that includes).
    ``grad``: the buffer to write the gradient into (the check's, poisoned), else a new one."""
    programs = min(resident_programs(cfg, x)[0], x.shape[0] * cfg.G)
    if programs < cfg.G:
        raise ValueError(f"{cfg.name}: fewer resident programs than a row's group")
    args, (grad, loss_rows, n_valid, err) = _arguments(x, y, cfg, grad)
    _ce_smem_row[(programs,)](*args, **_constexprs(cfg))
    return loss_rows.sum() / n_valid.clamp_min(1), grad, err


def configs(V: int, quick: bool = False) -> list[Config]:
    """Slices of 4096 / 8192 columns at 4 warps and 16384 at 8 (1 chunk of 1024 or 2048 columns a sweep
    step), with 1 and (two configs) 3 rows ahead in flight (2 and 4 buffers: shapes are powers of 2)."""
    out = []
    for sl, warps, nbufs in ((8192, 4, (2, 4)), (4096, 4, (2, 4)), (16384, 8, (2,))):
        for nbuf in (nbufs[:1] if quick else nbufs):
            out.append(Config.for_slice(V, min(sl, triton.cdiv(V, 1024) * 1024), warps, nbuf))
    return list(dict.fromkeys(out))


# ---- compile without a GPU ---------------------------------------------------------------------

def compile_sm90(cfg: Config, V: int, R: int = 64) -> dict:
    """Compile the kernel for sm_90a on this machine (no GPU needed: Triton's own ptxas) and return its
    resources: what ptxas and the Gluon front end refuse shows here, under the installed Triton."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    x = torch.empty(R, V, dtype=torch.bfloat16)
    y = torch.zeros(R, dtype=torch.int64)
    args, _ = _arguments(x, y, cfg)
    kw = _constexprs(cfg)
    fn = _ce_smem_row
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
    k = triton_compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    ptx = k.asm["ptx"]
    return dict(triton=triton.__version__, config=cfg.name, V=V, n_regs=_ptxas_regs(k), shared=k.metadata.shared,
                cp_async=ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global"),
                cp_async_16B=len([ln for ln in ptx.splitlines() if "cp.async" in ln and "0x10" in ln]),
                local_ld_st=ptx.count("ld.local") + ptx.count("st.local"), bar_sync=ptx.count("bar.sync"))


def _ptxas_regs(k) -> int | None:
    """Registers a thread in the cubin (n_regs is only read when a GPU loads it): from cuobjdump."""
    import re
    import subprocess
    import tempfile
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", out)
    return int(found.group(1)) if found else None


def compile_only() -> None:
    failed = 0
    for V in (2000, 128256, 262144):
        for cfg in configs(V):
            try:
                print(json.dumps(compile_sm90(cfg, V)), flush=True)
            except Exception as exc:   # reported, and the exit status says so
                failed += 1
                print(f"FAIL triton {triton.__version__} V={V} {cfg.name}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1 if failed else 0)


# ---- on the GPU --------------------------------------------------------------------------------

def check_inputs(R: int, V: int, seed: int, boundaries: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random inputs as the benchmark draws them (randn * 2 logits, a random 5% of rows ignored),
    with labels also at the first and last column and at the given slice boundaries."""
    import bench as bb
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(R, V, device="cuda", generator=g) * 2).bfloat16()
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    bb.IGNORED["random5"](y, g)
    for at, label in enumerate((0, V - 1) + tuple(b for b in boundaries if 0 <= b < V)):
        if at < R:
            y[at] = label
    return x, y


def check(x: torch.Tensor, y: torch.Tensor, cfg: Config, ref) -> dict:
    """The prototype against the float64 reference ``ref`` (row_on_chip.reference(x, y)), its gradient
    buffer poisoned with NaN first so that an unwritten element fails; ``why`` None where the errors
    are bf16's rounding. A failure to compile or launch is reported, not raised."""
    try:
        res = resident_programs(cfg, x)
        grad = torch.full_like(x, float("nan"))
        loss, grad, err = ce_gluon_row(x, y, cfg, grad=grad)
        torch.cuda.synchronize()
        e = roc.errors(loss, grad, y, ref)
        why = roc.acceptable(e, x.dtype) or ("error flag set (a barrier timed out)" if int(err) else None)
    except Exception as exc:
        res, e, why = (None, {}), {}, f"{type(exc).__name__}: {str(exc)[:300]}"
    return dict(kind="check", shape="x".join(map(str, x.shape)), config=cfg.name, programs=res[0], **res[1], **e,
                ok=why is None, why=why)


def main(out_dir: str | None, quick: bool, shapes: list[tuple[int, int]]) -> None:
    import losscodegen as lcg
    import bench as bb
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU (--compile-only runs without one)"
    bb.ignored = "random5"
    records = []

    def emit(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if out_dir:   # as they come: a run stopped at its time limit keeps what it measured
            with open(os.path.join(out_dir, "gluon_row.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")

    props = torch.cuda.get_device_properties(0)
    emit(dict(kind="device", name=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
              sms=props.multi_processor_count))
    bandwidth = bb.copy_bandwidth()
    emit(dict(kind="copy", bytes_per_s=bandwidth))

    # Correctness first: small shapes (a partial last slice, G = 1 .. 17, labels on slice boundaries),
    # each on two draws (an error that moves between draws beyond rounding is a race), then the
    # benchmark's shapes at up to 4096 rows, every config timed below.
    for R, V in ((37, 2000), (64, 4096), (300, 16384 + 1024)):
        for seed in (1, 2):
            xc, yc = check_inputs(R, V, seed=R + V + seed, boundaries=(1023, 1024, 2047, 2048))
            ref = roc.reference(xc, yc)
            for cfg in (Config.for_slice(V, 1024, 4, 2), Config.for_slice(V, 1024, 4, 4),
                        Config.for_slice(V, 2048, 8, 2), Config.for_slice(V, 4096, 4, 2)):
                emit(check(xc, yc, cfg, ref))
    head = lcg.HeadLoss(lcg.CrossEntropy())
    for R, V in shapes:
        cfgs = configs(V, quick)
        xc, yc = check_inputs(min(R, 4096), V, seed=V, boundaries=tuple(c.slice * k for c in cfgs for k in (1, 2)))
        ref = roc.reference(xc, yc)
        ok = []
        for cfg in cfgs:
            rec = check(xc, yc, cfg, ref)
            emit(rec)
            if rec["ok"]:
                ok.append(cfg)
        del xc, yc, ref
        torch.cuda.empty_cache()

        # Timing, as row_on_chip.py: forward + backward of the default call (x.grad = None,
        # head(x, y).loss.backward()) against one prototype call, interleaved rounds, min of medians.
        x, y, _ = bb.logit_inputs(R, V, ())
        x.requires_grad_()

        def ours():
            x.grad = None
            head(x, y).loss.backward()
        xd = x.detach()
        impls = [("losscodegen", "default", ours)]
        impls += [("gluon-row", cfg.name, lambda cfg=cfg: ce_gluon_row(xd, y, cfg)) for cfg in ok]
        best = {}
        for _ in range(2 if quick else 3):
            for impl, config, fn in impls:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                best[(impl, config)] = min(ms, best.get((impl, config), float("inf")))
        for impl, config, fn in impls:
            if impl == "gluon-row" and int(fn()[2]):
                print(f"  {config}: the error flag was set during timing (a barrier timed out)")
        if ok:
            # the best config's launch alone (and the counters' memset it needs), without the small torch
            # work around it (valid-row count, loss sum): what the kernel itself takes
            cfg = min(ok, key=lambda c: best[("gluon-row", c.name)])
            args, (_, _, _, err) = _arguments(xd, y, cfg)
            ws, n = args[8], min(resident_programs(cfg, xd)[0], R * cfg.G)

            def kernel_only(cfg=cfg, args=args, ws=ws, n=n):
                ws.zero_()
                _ce_smem_row[(n,)](*args, **_constexprs(cfg))
            best[("gluon-row kernel", cfg.name)] = min(
                triton.testing.do_bench(kernel_only, warmup=25, rep=100, return_mode="median") for _ in range(2))
            del args, ws
        floor_ms = 4 * R * V / bandwidth * 1e3
        for (impl, config), ms in best.items():
            emit(dict(kind="time", shape=f"{R}x{V}", impl=impl, config=config, ms=round(ms, 4),
                      floor_ms=round(floor_ms, 4), fraction=round(floor_ms / ms, 3)))
        del impls, ours
        torch.cuda.empty_cache()

    print(f"\n{records[0]['name']}, triton {triton.__version__}, copy {bandwidth / 1e12:.2f} TB/s")
    print(f"{'shape':14} {'impl':17} {'config':48} {'ms':>8} {'floor ms':>8} {'of floor':>8} {'default/it':>10}")
    default = {r["shape"]: r["ms"] for r in records if r["kind"] == "time" and r["impl"] == "losscodegen"}
    for r in records:
        if r["kind"] == "time":
            print(f"{r['shape']:14} {r['impl']:17} {r['config']:48} {r['ms']:8.4f} {r['floor_ms']:8.4f} "
                  f"{r['fraction']:8.3f} {default[r['shape']] / r['ms']:10.3f}")
    print(f"\n{'check':12} {'config':48} {'grid':>5} {'regs':>4} {'smem':>6} {'a SM':>4} {'api':>4} {'loss rel':>8} "
          f"{'grad rel':>8}")
    for r in records:
        if r["kind"] == "check" and r["ok"] and r["shape"].split("x")[1] in {str(v) for _, v in shapes}:
            print(f"{r['shape']:12} {r['config']:48} {r['programs']:5} {r['n_regs']:4} {r['shared']:6} "
                  f"{r['per_sm']:4} {str(r['occupancy_api']):>4} {r['loss_rel']:8.1e} {r['grad_rel_norm']:8.1e}")
    bad = [r for r in records if r["kind"] == "check" and not r["ok"]]
    print(f"checks: {sum(r['kind'] == 'check' for r in records) - len(bad)} ok, {len(bad)} failed")
    for r in bad:
        print(f"  FAILED {r['shape']} {r['config']}: {r['why']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true", help="compile every config for sm_90a (no GPU)")
    p.add_argument("--quick", action="store_true", help="fewer configs and rounds")
    p.add_argument("--out", help="a folder for the JSON lines")
    p.add_argument("--shapes", default="8192x128256,4096x262144", help="rows x columns to check and time")
    a = p.parse_args()
    if a.compile_only:
        compile_only()
    else:
        main(a.out, a.quick, [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")])
