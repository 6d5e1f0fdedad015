"""Issue 35, measured before it is built: "the row on the chip". Cross-entropy forward + gradient in one
launch that reads each logits row from HBM once, held in registers between the row statistics (max, sum
of exponentials) and the gradient, against losscodegen's default call (which reads the row twice: once
for the statistics, then again, partly from L2, to write the gradient).

One kernel, ``_ce_row_on_chip``, in two variants (configurations of it, not two copies):

1. whole row in registers (G = 1): one program holds one row as a single block of SLICE = next_pow2(V)
   columns; one program per row (grid = rows), or a persistent grid looping over rows.
2. split V across co-resident programs (G > 1): programs in groups of G, each group on one row at a time,
   each member holding SLICE = next_pow2(ceil(V / G)) columns of it. Members publish their partial
   (max, sum exp(z - max)) to a global scratch [rows, G, 2], meet at a per-row barrier (an atomic counter
   and a spin), merge the G partials into the row's log-sum-exp, and write the gradient of their slice
   from the registers they loaded it into.

    python bench/row_on_chip.py [--quick] [--out rows.jsonl]     # on one CUDA GPU: check, then time
    TRITON_INTERPRET=1 python bench/row_on_chip.py --self-test      # on the CPU: the math, small sizes

Imports only torch, triton, losscodegen and the standard library (an experiment, not part of the package).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

IGNORE = -100
HBM_BYTES_PER_S = 4.8e12       # H200: the floor below counts one read + one write of the logits at this rate
# Spins a program may spend in all its barriers before it gives up and raises the error flag: a wrong
# residency assumption then ends the launch in seconds (each spin is one L2 atomic, ~1 us) instead of
# hanging the GPU. Lockstep groups wait a few spins a row.
MAX_SPIN = 1 << 22


@triton.jit
def _ce_row_on_chip(x_ptr, x_stride, grad_ptr, grad_stride, y_ptr, n_valid_ptr, loss_rows_ptr,
                    scratch_ptr, count_ptr, err_ptr, n_rows, V, max_spin,
                    G: tl.constexpr, G_P2: tl.constexpr, SLICE: tl.constexpr, PREFETCH: tl.constexpr,
                    PUBLISH: tl.constexpr, BARRIER: tl.constexpr, FINISH: tl.constexpr):
    """Programs in groups of G; group g takes rows g, g + n_groups, ... (every member the same rows, in
    the same order: the barrier below relies on it). Member k holds columns [k*SLICE, (k+1)*SLICE).

    PUBLISH / BARRIER / FINISH split the work for Triton's interpreter, which runs programs one after
    another (a spin there never ends): on the GPU all three are set (one launch); on the CPU a G > 1
    kernel runs as two launches, PUBLISH (partials to the scratch) then FINISH (merge and gradient).
    G = 1 needs none of the exchange: its one program has the whole row.
    """
    pid = tl.program_id(0)
    n_groups = tl.num_programs(0) // G
    group = pid // G
    member = pid % G
    cols = member * SLICE + tl.arange(0, SLICE)
    in_row = cols < V
    # mean over the valid rows, counted before the launch (on the device: no host sync)
    grad_scale = 1.0 / tl.maximum(tl.load(n_valid_ptr).to(tl.float32), 1.0)
    spins_left = max_spin
    # Double-buffering: the next row's slice is loaded one iteration ahead, so that its HBM read is in
    # flight during this row's statistics, barrier and gradient stores (twice the registers).
    if PREFETCH:
        x_next = tl.load(x_ptr + group.to(tl.int64) * x_stride + cols, mask=cols < tl.where(group < n_rows, V, 0),
                         other=0.0)
    for r in range(group, n_rows, n_groups):
        row = tl.cast(r, tl.int64)   # (the interpreter's range yields Python ints)
        if PREFETCH:
            x = x_next
            nxt = row + n_groups
            x_next = tl.load(x_ptr + nxt * x_stride + cols, mask=cols < tl.where(nxt < n_rows, V, 0), other=0.0)
        else:
            x = tl.load(x_ptr + row * x_stride + cols, mask=in_row, other=0.0)
        y = tl.load(y_ptr + row)
        grad_row = grad_ptr + row * grad_stride
        # every member reads the same label, so all agree to skip the barrier of an ignored row
        if y != -100:   # (IGNORE: a literal, a global would have to be a constexpr)
            # The statistics from the registers, as the generated kernels compute them: the max
            # subtracted, exp2 with log2(e) folded; padding columns are -inf (their exponential is 0).
            z = tl.where(in_row, x.to(tl.float32), float("-inf"))
            m = tl.max(z, 0)
            m_ref = tl.where(m == float("-inf"), 0.0, m)   # an empty slice (V small, G large): no NaN
            s = tl.sum(tl.exp2(1.4426950408889634 * (z - m_ref)), 0)
            if G == 1:
                big_m = m_ref
                big_s = s
            else:
                part = scratch_ptr + row * (2 * G)
                if PUBLISH:
                    tl.store(part + 2 * member, m)
                    tl.store(part + 2 * member + 1, s)
                if BARRIER:
                    # Every thread's scratch stores are issued before this program's arrival (bar.sync),
                    # and the arrival releases them (PTX release is cumulative over what the CTA ordered
                    # before it); the acquire on the count orders the scratch loads below after every
                    # member's arrival. The scalar atomics run on one thread, their result broadcast.
                    tl.debug_barrier()
                    tl.atomic_add(count_ptr + row, 1, sem="release")
                    seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
                    while (seen < G) & (spins_left > 0):
                        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
                        spins_left -= 1
                    if seen < G:
                        tl.atomic_xchg(err_ptr, 1)   # a member never arrived: results are wrong, say so
                    tl.debug_barrier()
                if FINISH:
                    # .cg: from L2, never a stale L1 line (the partials were written by other SMs)
                    k = tl.arange(0, G_P2)
                    ms = tl.load(part + 2 * k, mask=k < G, other=float("-inf"), cache_modifier=".cg")
                    ss = tl.load(part + 2 * k + 1, mask=k < G, other=0.0, cache_modifier=".cg")
                    big_m = tl.max(ms, 0)
                    big_m = tl.where(big_m == float("-inf"), 0.0, big_m)
                    big_s = tl.sum(ss * tl.exp2(1.4426950408889634 * (ms - big_m)), 0)
            if FINISH:
                log_s = tl.log(big_s)   # once a row: the accurate log costs nothing here
                # the loss: the member holding the label's column takes z_y from its registers
                owns_y = (y >= member * SLICE) & (y < member * SLICE + SLICE)
                if owns_y:
                    z_y = tl.sum(tl.where(cols == y, z, 0.0), 0)
                    tl.store(loss_rows_ptr + row, big_m + log_s - z_y)
                # dL/dz = (softmax - onehot) / n_valid, from the same registers (no second read). The
                # exponential is recomputed from z, as the generated gradient read does (2 exp2 an
                # element in all, like the default call): the comparison is about HBM reads. Keeping
                # the stats' exponentials instead would save one exp2 an element, in fp32 registers.
                p = tl.exp2(1.4426950408889634 * (z - big_m) - 1.4426950408889634 * log_s)
                dz = grad_scale * p - tl.where(cols == y, grad_scale, 0.0)
                tl.store(grad_row + cols, dz.to(grad_ptr.dtype.element_ty), mask=in_row, cache_modifier=".cs")
        else:
            if FINISH:
                # an ignored row: loss 0, gradient 0 (the default call writes zeros there too)
                if member == 0:
                    tl.store(loss_rows_ptr + row, 0.0)
                tl.store(grad_row + cols, tl.zeros([SLICE], tl.float32).to(grad_ptr.dtype.element_ty),
                         mask=in_row, cache_modifier=".cs")


@dataclass(frozen=True)
class Config:
    """G programs per row, each holding ``slice`` columns; ``persistent``: a grid of the programs that
    can be resident at once, each looping over rows (needed for G > 1: see ``resident_programs``),
    else one program per row (G = 1 only). ``maxnreg``: a cap on registers a thread (ptxas spills
    beyond it), so that more programs fit on a multiprocessor: left alone, ptxas takes up to 255 a
    thread where the block is small enough, and a 16-warp program of 32 columns a thread takes ~110,
    one program a multiprocessor."""
    G: int
    slice: int
    num_warps: int
    persistent: bool
    prefetch: bool = False
    maxnreg: int | None = None

    @staticmethod
    def for_slice(V: int, slice_cols: int, num_warps: int, *, persistent: bool = True, prefetch: bool = False,
                  maxnreg: int | None = None) -> "Config":
        """The config whose programs hold at most ``slice_cols`` columns (a power of two): G from V."""
        G = triton.cdiv(V, slice_cols)
        sl = triton.next_power_of_2(triton.cdiv(V, G))
        return Config(G, sl, num_warps, persistent or G > 1, prefetch, maxnreg)

    @property
    def name(self) -> str:
        kind = "whole-row" if self.G == 1 else f"split G={self.G}"
        grid = "persistent" if self.persistent else "grid=rows"
        return (f"{kind} slice={self.slice} warps={self.num_warps} {grid}{' prefetch' if self.prefetch else ''}"
                f"{f' maxnreg={self.maxnreg}' if self.maxnreg else ''}")


def _constexprs(cfg: Config) -> dict:
    """The constexprs and launch options of a config (maxnreg only where set: the interpreter and
    older Triton versions need not know it)."""
    out = dict(G=cfg.G, G_P2=triton.next_power_of_2(cfg.G), SLICE=cfg.slice, PREFETCH=cfg.prefetch,
               num_warps=cfg.num_warps)
    if cfg.maxnreg:
        out["maxnreg"] = cfg.maxnreg
    return out


def _arguments(x: torch.Tensor, y: torch.Tensor, cfg: Config) -> tuple[tuple, tuple]:
    """The kernel's arguments for a call, and (gradient, per-row losses, valid rows, error flag)."""
    R, V = x.shape
    grad = torch.empty_like(x)
    loss_rows = torch.empty(R, device=x.device, dtype=torch.float32)
    n_valid = (y != IGNORE).sum(dtype=torch.int32)
    split = cfg.G > 1
    ws = torch.zeros(R + 1 if split else 1, device=x.device, dtype=torch.int32)   # counters, then the flag
    scratch = torch.empty(R * cfg.G * 2 if split else 1, device=x.device, dtype=torch.float32)
    err = ws[-1:]
    args = (x, x.stride(0), grad, grad.stride(0), y, n_valid, loss_rows, scratch, ws, err, R, V, MAX_SPIN)
    return args, (grad, loss_rows, n_valid, err)


_RESIDENT: dict = {}


def resident_programs(cfg: Config, x: torch.Tensor) -> tuple[int, dict]:
    """How many programs of this config are resident at once on x's GPU (multiprocessors times the
    blocks one holds, by registers, threads and shared memory of the compiled kernel), and the
    kernel's n_regs / n_spills.

    The deadlock argument for G > 1: a member spins until all G members of its group have reached the
    same row. If every program of the grid is resident, each member is running, and members take the
    same rows in the same order, so each barrier is reached by all G and completes. A grid larger than
    what is resident would let a member wait for one that is not scheduled until it exits: a hang (the
    spin bound turns it into the error flag). Also assumed: nothing else occupies the GPU during the
    launch (another kernel's blocks would take residency; the CUDA stream orders ours after them)."""
    key = (cfg, tuple(x.shape), x.dtype, x.device)
    if key not in _RESIDENT:
        # compiled for the arguments of a real call (Triton specializes on their alignment and values)
        y = torch.zeros(x.shape[0], device=x.device, dtype=torch.int64)
        args, _ = _arguments(x, y, cfg)
        k = _ce_row_on_chip.warmup(*args, grid=(1,), PUBLISH=cfg.G > 1, BARRIER=cfg.G > 1, FINISH=True,
                                   **_constexprs(cfg))
        per_sm, info = blocks_per_sm(k, cfg.num_warps, x.device)
        n_sm = torch.cuda.get_device_properties(x.device).multi_processor_count
        _RESIDENT[key] = (per_sm * n_sm // cfg.G * cfg.G, info)
    return _RESIDENT[key]


def blocks_per_sm(k, num_warps: int, device: torch.device) -> tuple[int, dict]:
    """How many programs of the compiled kernel ``k`` (``num_warps`` warps each) one multiprocessor
    holds at once, by registers, threads and shared memory, and the kernel's n_regs / n_spills."""
    getattr(k, "_init_handles", lambda: None)()   # (n_regs and n_spills are read when the binary loads)
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    regs_warp = math.ceil(max(k.n_regs, 1) * 32 / 256) * 256   # allocated per warp, 256 at a time
    per_sm = min(regs_sm // (regs_warp * num_warps), threads_sm // (32 * num_warps), 32)
    shared = k.metadata.shared
    if shared:
        per_sm = min(per_sm, smem_sm // (shared + 1024))            # 1 KB a block for the system
    return per_sm, dict(n_regs=k.n_regs, n_spills=getattr(k, "n_spills", None), shared=shared, per_sm=per_sm)


def ce_row_on_chip(x: torch.Tensor, y: torch.Tensor, cfg: Config, *, programs: int | None = None,
                   two_launches: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over valid rows, dlogits in x's dtype, error flag) in one launch.

    Work per call, for a fair comparison with the default call (which allocates its gradient, counts
    the valid rows and reduces the rows' losses in its kernel): allocates the gradient and the per-row
    losses, counts the valid rows (one small torch kernel), zeroes the barrier counters and the flag
    (one memset), one launch, then the rows' losses summed by torch (two small kernels). It skips what
    the default call does besides: validation of labels (out-of-range labels are not flagged here),
    autograd's bookkeeping, weights, loss_mask, softcap, vocab-parallel. ``programs``: the grid (the
    CPU self-test picks it; on the GPU it is what is resident, or the rows). ``two_launches``: the
    interpreter's emulation of the barrier (see the kernel)."""
    R = x.shape[0]
    split = cfg.G > 1
    if programs is None:
        programs = resident_programs(cfg, x)[0] if cfg.persistent else R
        programs = min(programs, R * cfg.G)
    args, (grad, loss_rows, n_valid, err) = _arguments(x, y, cfg)
    if two_launches:
        _ce_row_on_chip[(programs,)](*args, PUBLISH=True, BARRIER=False, FINISH=False, **_constexprs(cfg))
        _ce_row_on_chip[(programs,)](*args, PUBLISH=False, BARRIER=False, FINISH=True, **_constexprs(cfg))
    else:
        _ce_row_on_chip[(programs,)](*args, PUBLISH=split, BARRIER=split, FINISH=True, **_constexprs(cfg))
    return loss_rows.sum() / n_valid.clamp_min(1), grad, err


def reference_blocks(x: torch.Tensor, y: torch.Tensor, row_losses, rows_at_once: int = 256) -> tuple[torch.Tensor, list]:
    """The float64 mean over the valid rows of ``row_losses(float64 rows, first row)`` (each row's
    loss) and, per block of rows, (its first row, its dlogits in float64), by autograd: in blocks so
    that a 4096 x 262144 check does not hold several [rows, V] float64 tensors at once."""
    valid = y != IGNORE
    n = valid.sum().clamp_min(1).double()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    grads = []
    for a in range(0, x.shape[0], rows_at_once):
        xb = x[a:a + rows_at_once].double().requires_grad_()
        lb = torch.where(valid[a:a + rows_at_once], row_losses(xb, a), 0.0).sum() / n
        (gb,) = torch.autograd.grad(lb, xb)
        total += lb.detach()
        grads.append((a, gb))
    return total, grads


def reference(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Cross-entropy's float64 loss and gradient blocks (reference_blocks)."""
    return reference_blocks(x, y, lambda xb, a: torch.nn.functional.cross_entropy(
        xb, y[a:a + xb.shape[0]], ignore_index=IGNORE, reduction="none"))


def errors(loss: torch.Tensor, grad: torch.Tensor, y: torch.Tensor, ref: tuple[torch.Tensor, list]) -> dict:
    """Relative errors against a float64 reference (reference_blocks' loss and gradient blocks): the
    loss's, the gradient's by norm and by max, and whether every ignored row's gradient is exactly 0."""
    ref_loss, ref_grads = ref
    diff2 = ref2 = 0.0
    diff_max = ref_max = 0.0
    for a, gb in ref_grads:
        mine = grad[a:a + gb.shape[0]].double()
        d = mine - gb
        diff2 += float((d * d).sum())
        ref2 += float((gb * gb).sum())
        diff_max = max(diff_max, float(d.abs().max()))
        ref_max = max(ref_max, float(gb.abs().max()))
    ignored_zero = bool((grad[y == IGNORE] == 0).all())
    return dict(loss_rel=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                grad_rel_norm=math.sqrt(diff2 / ref2), grad_rel_max=diff_max / ref_max,
                ignored_zero=ignored_zero, finite=bool(torch.isfinite(grad).all()))


def acceptable(e: dict, dtype: torch.dtype) -> str | None:
    """None if the errors are what rounding explains, else why not: the loss accumulated in fp32
    (1e-4 leaves room for fp32 sums over 262144 columns), the gradient rounded to its dtype."""
    grad_tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    if not e["finite"]:
        return "gradient not finite"
    if not e["ignored_zero"]:
        return "an ignored row's gradient is not 0"
    if e["loss_rel"] > 1e-4:
        return f"loss relative error {e['loss_rel']:.2e} > 1e-4"
    if e["grad_rel_norm"] > grad_tol:
        return f"gradient relative error (norm) {e['grad_rel_norm']:.2e} > {grad_tol}"
    return None


def inputs(R: int, V: int, *, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 1):
    """The benchmark's inputs (bench/bench.py's logit_inputs): randn * 2 logits, every 7th row ignored."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(R, V, device=device, generator=g) * 2).to(dtype)
    y = torch.randint(0, V, (R,), device=device, generator=g)
    y[::7] = IGNORE
    return x, y


def self_test() -> None:
    """The math on the CPU under TRITON_INTERPRET=1: whole row (grid = rows, and persistent with and
    without prefetch) and split (G = 2, 3, 4 as two launches: partials, then merge + gradient) against
    the float64 reference, fp32 and bf16, labels at the first and last column, every 7th row ignored."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run the self-test under TRITON_INTERPRET=1"
    failed = 0
    for dtype in (torch.float32, torch.bfloat16):
        for R, V in ((5, 300), (9, 300), (8, 64)):
            x, y = inputs(R, V, device="cpu", dtype=dtype)
            y[1] = 0
            y[-1] = V - 1 if y[-1] != IGNORE else IGNORE
            whole = triton.next_power_of_2(V)
            cases = [(Config(1, whole, 4, False), dict(programs=R)), (Config(1, whole, 4, True), dict(programs=2)),
                     (Config(1, whole, 4, True, True), dict(programs=3))]
            for G in (2, 3, 4):
                for prefetch in (False, True):
                    cfg = Config(G, triton.next_power_of_2(triton.cdiv(V, G)), 4, True, prefetch)
                    cases.append((cfg, dict(programs=2 * G, two_launches=True)))
            for cfg, kw in cases:
                loss, grad, err = ce_row_on_chip(x, y, cfg, **kw)
                e = errors(loss, grad, y, reference(x, y))
                why = acceptable(e, dtype) or ("error flag set" if int(err) else None)
                failed += why is not None
                print(f"{str(dtype):15} {R}x{V:<4} {cfg.name:55} {kw}  loss {e['loss_rel']:.1e}  "
                      f"grad {e['grad_rel_norm']:.1e}  {'ok' if why is None else 'FAIL: ' + why}", flush=True)
    print("self-test:", "all ok" if not failed else f"{failed} FAILED")
    sys.exit(1 if failed else 0)


def configs(V: int, quick: bool, slices: list[tuple[int, int, int | None]] | None = None) -> list[Config]:
    """A few configs a vocabulary, 16-32 columns a thread (one program's slice in 32-64 registers as
    fp32): the whole row where it may fit (V <= 65536: one program per row, and persistent with
    prefetch), then rows split into slices of 32768 columns (32 warps, one program a multiprocessor),
    16384 (16 warps capped at 64 registers: two a multiprocessor, each hiding the other's load) and
    8192 (8 warps, 64 registers: four), with and without prefetch (--quick: fewer). ``slices``
    (--slices): (columns, warps, register cap) of the split configs to try instead, without prefetch."""
    if slices:
        return [Config.for_slice(V, sl, warps, maxnreg=cap) for sl, warps, cap in slices if sl < V]
    out = []
    if V <= 65536:
        out.append(Config.for_slice(V, triton.next_power_of_2(V), 32, persistent=False))
        out.append(Config.for_slice(V, triton.next_power_of_2(V), 32, prefetch=True))
    for sl, warps, maxnreg, prefetches in ((32768, 32, None, (False, True)), (16384, 16, 64, (False, True)),
                                           (8192, 8, 64, (False,))):
        if sl >= V:
            continue
        for prefetch in ((True,) if quick and sl != 8192 else prefetches):
            out.append(Config.for_slice(V, sl, warps, prefetch=prefetch, maxnreg=maxnreg))
    return out


def host_enqueue_ms(fn, n: int = 20) -> float:
    """The median host time to enqueue one call (no sync inside it). do_bench's time includes host
    time where the host falls behind the GPU (a small shape, or a call of many launches): a call whose
    host time nears its ms is host-bound there, and the comparison is then partly about launches."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[n // 2]


def main(quick: bool, out_path: str | None, shapes: list[tuple[int, int]] | None = None,
         slices: list[tuple[int, int, int | None]] | None = None) -> None:
    import losscodegen as lcg
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU (the self-test runs on the CPU)"
    if not shapes:
        shapes = [(8192, 32000), (8192, 128256)] if quick else [(8192, 32000), (8192, 65536), (8192, 128256),
                                                                (4096, 262144)]
    rounds, rep = (2, 100) if quick else (3, 200)
    records = []

    def emit(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs", flush=True)
    head = lcg.HeadLoss(lcg.CrossEntropy())
    for R, V in shapes:
        shape = f"{R}x{V}"
        # Correctness at the shape's V (4096 rows: the float64 reference is computed in row blocks);
        # a config that fails (or does not compile) is not timed.
        Rc = min(R, 4096)
        x, y = inputs(Rc, V, device="cuda")
        x.requires_grad_()
        out = head(x, y)
        out.loss.backward()
        e = errors(out.loss.detach(), x.grad, y, reference(x.detach(), y))
        emit(dict(kind="check", shape=f"{Rc}x{V}", impl="losscodegen", config="default", **e))
        ok = []
        for cfg in configs(V, quick, slices):
            try:
                res = resident_programs(cfg, x)
                loss, grad, err = ce_row_on_chip(x.detach(), y, cfg)
                torch.cuda.synchronize()
                e = errors(loss, grad, y, reference(x.detach(), y))
                why = acceptable(e, x.dtype) or ("error flag set (a barrier timed out)" if int(err) else None)
            except Exception as exc:   # an out-of-resources compile, say: reported, not timed
                res, e, why = (None, {}), {}, f"{type(exc).__name__}: {str(exc)[:200]}"
            emit(dict(kind="check", shape=f"{Rc}x{V}", impl="row-on-chip", config=cfg.name, programs=res[0],
                      **res[1], **e, ok=why is None, why=why))
            if why is None:
                ok.append(cfg)
        del x, y, out
        torch.cuda.empty_cache()

        # Timing. The default call: forward + backward with the gradient written, exactly as
        # bench/ab.py times it (x.grad = None, head(x, y).loss.backward(); the head writes the
        # gradient in its forward launch, and backward rescales rows only where the upstream gradient
        # is not 1: docs/architecture.md, Autograd). do_bench zeroes a buffer the size of L2 before
        # each call, outside the timed events, for both. The prototype: ce_row_on_chip
        # (its doc says what it includes). Interleaved over rounds, the min of the medians.
        x, y = inputs(R, V, device="cuda")
        x.requires_grad_()

        def ours():
            x.grad = None
            head(x, y).loss.backward()
        impls = [("losscodegen", "default", ours)]
        xd = x.detach()
        for cfg in ok:
            impls.append(("row-on-chip", cfg.name, lambda cfg=cfg: ce_row_on_chip(xd, y, cfg)))
        best = {}
        for _ in range(rounds):
            for impl, config, fn in impls:
                ms = triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
                best[(impl, config)] = min(ms, best.get((impl, config), float("inf")))
        host = {}
        for impl, config, fn in impls:
            host[(impl, config)] = host_enqueue_ms(fn)
            if impl == "row-on-chip":
                _, _, err = fn()
                if int(err):
                    print(f"  {config}: the error flag was set during timing (a barrier timed out)")
        moved = 2 * R * V * x.element_size()
        for (impl, config), ms in best.items():
            emit(dict(kind="time", shape=shape, impl=impl, config=config, ms=round(ms, 4),
                      gbps=round(moved / ms / 1e6, 1), floor_ms=round(moved / HBM_BYTES_PER_S * 1e3, 4),
                      host_ms=round(host[(impl, config)], 4)))
        del x, y, xd, impls
        torch.cuda.empty_cache()

    # last: the table (GB/s counts one read and one write of the logits; the floor is that at 4.8 TB/s;
    # "default/ms" > 1 is faster than the default call; "host ms": the host's time to enqueue one call)
    print(f"\n{'shape':14} {'impl':13} {'config':68} {'ms':>8} {'GB/s':>7} {'floor ms':>8} {'default/ms':>10} "
          f"{'host ms':>8}")
    default = {r["shape"]: r["ms"] for r in records if r["kind"] == "time" and r["impl"] == "losscodegen"}
    for r in records:
        if r["kind"] == "time":
            print(f"{r['shape']:14} {r['impl']:13} {r['config']:68} {r['ms']:8.4f} {r['gbps']:7.1f} "
                  f"{r['floor_ms']:8.4f} {default[r['shape']] / r['ms']:10.3f} {r['host_ms']:8.4f}")
    if out_path:
        write_records(out_path, records)


def write_records(path: str, records: list[dict]) -> None:
    """Every record as a JSON line at ``path``."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two shapes, fewer configs and rounds")
    p.add_argument("--self-test", action="store_true", help="the math on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--out", help="also write every record as JSON lines here")
    p.add_argument("--shapes", help="rows x columns to run, e.g. 8192x65536,8192x128256")
    p.add_argument("--slices", help="split configs to try, columns:warps:register cap (0: none), "
                                    "e.g. 8192:4:64,4096:4:64")
    a = p.parse_args()
    if a.self_test:
        self_test()
    else:
        main(a.quick, a.out,
             [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")] if a.shapes else None,
             [(sl, w, cap or None) for sl, w, cap in (tuple(int(n) for n in s.split(":"))
                                                       for s in a.slices.split(","))] if a.slices else None)
