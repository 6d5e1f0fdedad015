"""Issue 35, measured before it is built: the split row for the teacher heads (JSD, forward KL). The
default call reads a JSD row three times (the statistics; the exact sums, which need the final
normalisers; the gradient) and a forward-KL row twice, the student's and the teacher's logits each
time: at 8192 x 128256 a row is 512 KB, the rows in flight are several times L2, and Nsight Compute
counts 12.9 GB from DRAM for JSD where one read and one write are 6.3 GB (docs/perf/ncu).

Here each row is split over a group of G co-resident programs of a persistent grid, each sweeping
its slice of SLICE columns (tiles of BLOCK) for every read. The slices in flight are a few MB, so a
slice's second and third reads come from L2: one HBM read a row. The programs of a row exchange
their partial statistics, then (JSD) their exact sums, through a global scratch behind a counter
(release ``atomic_add``, acquire spin), as bench/row_on_chip.py does for cross-entropy, whose slices
are held in registers instead.

    python bench/split_teacher.py [--quick] [--out rows.jsonl]   # on one CUDA GPU: check, then time
    TRITON_INTERPRET=1 python bench/split_teacher.py --self-test    # on the CPU: the math, small sizes

Imports only torch, triton, losscodegen and the standard library (an experiment, not part of the package).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_on_chip import (IGNORE, MAX_SPIN, acceptable, blocks_per_sm, errors, host_enqueue_ms,  # noqa: E402
                         reference_blocks, write_records)

HBM_BYTES_PER_S = 4.8e12   # H200: the floor counts one read of the logits and the teacher's, one write
SLOTS = tl.constexpr(6)    # a member's scratch: m, s, m_t, s_t, then JSD's two exact sums
BETA = 0.5                 # JSD's beta (HeadLoss(JSD())'s default)


@triton.jit
def _wait(count_ptr, target, spins_left, err_ptr):
    """This program's arrival at the row's counter (release: every store before it is visible
    first), then a spin until the counter reaches ``target`` (acquire); the spins left after it."""
    tl.debug_barrier()
    seen = tl.atomic_add(count_ptr, 1, sem="release") + 1
    while (seen < target) & (spins_left > 0):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        spins_left -= 1
    if seen < target:
        tl.atomic_xchg(err_ptr, 1)   # a member never arrived: results are wrong, say so
    tl.debug_barrier()
    return spins_left


@triton.jit
def _teacher_split(x_ptr, t_ptr, stride, grad_ptr, y_ptr, n_valid_ptr, loss_rows_ptr, scratch_ptr,
                   count_ptr, err_ptr, n_rows, V, beta, max_spin,
                   G: tl.constexpr, G_P2: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr,
                   JSD: tl.constexpr, STATS: tl.constexpr, EXACT: tl.constexpr, GRAD: tl.constexpr,
                   BARRIER: tl.constexpr):
    """Programs in groups of G; group g takes rows g, g + n_groups, ... (every member the same rows in
    the same order: the barriers rely on it). Member k sweeps columns [k*SLICE, (k+1)*SLICE).

    STATS, EXACT (JSD only) and GRAD are the three reads. On the GPU one launch does all three with
    BARRIER (the exchanges between them); Triton's interpreter runs programs one after another (a
    spin never ends there), so on the CPU each read is its own launch and the launch boundary is the
    barrier. Loss rows: JSD's from the exact sums (member 0 writes it); forward KL's summed over the
    members by atomic adds (loss_rows zeroed by the caller)."""
    pid = tl.program_id(0)
    n_groups = tl.num_programs(0) // G
    group = pid // G
    member = pid % G
    lo = member * SLICE
    hi = tl.minimum(lo + SLICE, V)
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK)
    grad_scale = 1.0 / tl.maximum(tl.load(n_valid_ptr).to(tl.float32), 1.0)
    k = tl.arange(0, G_P2)
    spins_left = max_spin
    for r in range(group, n_rows, n_groups):
        row = tl.cast(r, tl.int64)
        x_row = x_ptr + row * stride
        t_row = t_ptr + row * stride
        part = scratch_ptr + row * (G * SLOTS)
        counter = count_ptr + row
        # every member reads the same label, so all agree to skip the barriers of an ignored row
        if tl.load(y_ptr + row) != -100:
            if STATS:
                m = float("-inf")
                s = 0.0
                m_t = float("-inf")
                s_t = 0.0
                for i in range(0, n_tiles):
                    cols = lo + i * BLOCK + tl.arange(0, BLOCK)
                    inside = cols < hi
                    z = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                    t = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
                    m_new = tl.maximum(m, tl.max(z, 0))
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    s = s * tl.exp2(1.4426950408889634 * (m - m_ref)) + tl.sum(tl.exp2(1.4426950408889634 * (z - m_ref)), 0)
                    m = m_new
                    m_t_new = tl.maximum(m_t, tl.max(t, 0))
                    m_t_ref = tl.where(m_t_new == float("-inf"), 0.0, m_t_new)
                    s_t = s_t * tl.exp2(1.4426950408889634 * (m_t - m_t_ref)) + tl.sum(tl.exp2(1.4426950408889634 * (t - m_t_ref)), 0)
                    m_t = m_t_new
                mine = part + member * SLOTS
                tl.store(mine + 0, m)
                tl.store(mine + 1, s)
                tl.store(mine + 2, m_t)
                tl.store(mine + 3, s_t)
                if BARRIER:
                    spins_left = _wait(counter, G, spins_left, err_ptr)
            if EXACT or GRAD:
                # the row's normalisers from every member's partials (.cg: from L2, never a stale L1 line)
                ms = tl.load(part + k * SLOTS + 0, mask=k < G, other=float("-inf"), cache_modifier=".cg")
                ss = tl.load(part + k * SLOTS + 1, mask=k < G, other=0.0, cache_modifier=".cg")
                big = tl.max(ms, 0)
                n0 = big + tl.log(tl.sum(ss * tl.exp2(1.4426950408889634 * (ms - big)), 0))
                ms = tl.load(part + k * SLOTS + 2, mask=k < G, other=float("-inf"), cache_modifier=".cg")
                ss = tl.load(part + k * SLOTS + 3, mask=k < G, other=0.0, cache_modifier=".cg")
                big = tl.max(ms, 0)
                n1 = big + tl.log(tl.sum(ss * tl.exp2(1.4426950408889634 * (ms - big)), 0))
            if JSD:
                if EXACT:
                    # the exact sums, tiles last to first (the last tiles read are the likeliest in L2)
                    a1 = 0.0
                    a3 = 0.0
                    for i in range(0, n_tiles):
                        cols = lo + (n_tiles - 1 - i) * BLOCK + tl.arange(0, BLOCK)
                        inside = cols < hi
                        zl = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32) - n0
                        tl_ = tl.load(t_row + cols, mask=inside, other=0.0).to(tl.float32) - n1
                        p = tl.exp2(1.4426950408889634 * zl)
                        q = tl.exp2(1.4426950408889634 * tl_)
                        lm = 0.6931471805599453 * tl.log2(beta * p + (1.0 - beta) * q + 1.1754943508222875e-38)
                        a1 += tl.sum(tl.where(inside, p * (zl - lm), 0.0), 0)
                        a3 += tl.sum(tl.where(inside, q * (tl_ - lm), 0.0), 0)
                    tl.store(part + member * SLOTS + 4, a1)
                    tl.store(part + member * SLOTS + 5, a3)
                    if BARRIER:
                        spins_left = _wait(counter, 2 * G, spins_left, err_ptr)
            if GRAD:
                if JSD:
                    acc1 = tl.sum(tl.load(part + k * SLOTS + 4, mask=k < G, other=0.0, cache_modifier=".cg"), 0)
                    if member == 0:
                        acc3 = tl.sum(tl.load(part + k * SLOTS + 5, mask=k < G, other=0.0, cache_modifier=".cg"), 0)
                        tl.store(loss_rows_ptr + row, beta * acc1 + (1.0 - beta) * acc3)
                loss = 0.0
                for i in range(0, n_tiles):
                    cols = lo + i * BLOCK + tl.arange(0, BLOCK)
                    inside = cols < hi
                    zl = tl.load(x_row + cols, mask=inside, other=0.0, eviction_policy="evict_first").to(tl.float32) - n0
                    tl_ = tl.load(t_row + cols, mask=inside, other=0.0, eviction_policy="evict_first").to(tl.float32) - n1
                    p = tl.exp2(1.4426950408889634 * zl)
                    q = tl.exp2(1.4426950408889634 * tl_)
                    if JSD:
                        lm = 0.6931471805599453 * tl.log2(beta * p + (1.0 - beta) * q + 1.1754943508222875e-38)
                        dz = (grad_scale * beta) * p * (zl - lm - acc1)
                    else:
                        dz = grad_scale * (p - q)
                        loss += tl.sum(tl.where(inside, q * (tl_ - zl), 0.0), 0)
                    tl.store(grad_ptr + row * stride + cols, dz.to(grad_ptr.dtype.element_ty), mask=inside,
                             cache_modifier=".cs")
                if not JSD:
                    tl.atomic_add(loss_rows_ptr + row, loss)
        elif GRAD:
            # an ignored row: loss 0 (zeroed by the caller), gradient 0
            for i in range(0, n_tiles):
                cols = lo + i * BLOCK + tl.arange(0, BLOCK)
                tl.store(grad_ptr + row * stride + cols, tl.zeros([BLOCK], tl.float32).to(grad_ptr.dtype.element_ty),
                         mask=cols < hi, cache_modifier=".cs")


@dataclass(frozen=True)
class Config:
    """G programs a row, each sweeping ``slice`` columns in tiles of ``block``; ``share``: the grid as
    a fraction of the programs that can be resident at once (fewer slices in flight, more of them in L2)."""
    G: int
    slice: int
    block: int
    num_warps: int
    share: float = 1.0

    @staticmethod
    def for_slice(V: int, slice_cols: int, block: int, num_warps: int, share: float = 1.0) -> "Config":
        G = triton.cdiv(V, slice_cols)
        sl = triton.cdiv(triton.cdiv(V, G), block) * block   # a whole number of tiles
        return Config(G, sl, block, num_warps, share)

    @property
    def name(self) -> str:
        return f"G={self.G} slice={self.slice} block={self.block} warps={self.num_warps} share={self.share}"


def _launch(x, t, y, cfg: Config, jsd: bool, programs: int, phases: list[dict]):
    R, V = x.shape
    grad = torch.empty_like(x)
    loss_rows = torch.zeros(R, device=x.device, dtype=torch.float32)
    n_valid = (y != IGNORE).sum(dtype=torch.int32)
    ws = torch.zeros(R + 1, device=x.device, dtype=torch.int32)   # the rows' counters, then the flag
    scratch = torch.empty(R * cfg.G * SLOTS.value, device=x.device, dtype=torch.float32)
    args = (x, t, x.stride(0), grad, y, n_valid, loss_rows, scratch, ws, ws[-1:], R, V, BETA, MAX_SPIN)
    for phase in phases:
        _teacher_split[(programs,)](*args, G=cfg.G, G_P2=triton.next_power_of_2(cfg.G), SLICE=cfg.slice,
                                    BLOCK=cfg.block, JSD=jsd, num_warps=cfg.num_warps, **phase)
    return loss_rows.sum() / n_valid.clamp_min(1), grad, ws[-1]


_RESIDENT: dict = {}


def resident(cfg: Config, x, t, y, jsd: bool) -> tuple[int, dict]:
    """The persistent grid: the programs resident at once (a multiple of G), times ``share``."""
    key = (cfg, tuple(x.shape), x.dtype, jsd)
    if key not in _RESIDENT:
        R, V = x.shape
        scratch = torch.empty(R * cfg.G * SLOTS.value, device=x.device, dtype=torch.float32)
        ws = torch.zeros(R + 1, device=x.device, dtype=torch.int32)
        k = _teacher_split.warmup(x, t, x.stride(0), x, y, ws, scratch, scratch, ws, ws, R, V, BETA, MAX_SPIN,
                                  grid=(1,), G=cfg.G, G_P2=triton.next_power_of_2(cfg.G), SLICE=cfg.slice,
                                  BLOCK=cfg.block, JSD=jsd, STATS=True, EXACT=jsd, GRAD=True, BARRIER=True,
                                  num_warps=cfg.num_warps)
        per_sm, info = blocks_per_sm(k, cfg.num_warps, x.device)
        n = per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count
        n = max(int(n * cfg.share) // cfg.G * cfg.G, cfg.G)
        _RESIDENT[key] = (n, info)
    return _RESIDENT[key]


def split_teacher(x, t, y, cfg: Config, jsd: bool, *, programs: int | None = None, interpret: bool = False):
    """(mean loss over valid rows, dlogits in x's dtype, error flag): one launch on the GPU, one a
    read under the interpreter."""
    if programs is None:
        programs = min(resident(cfg, x, t, y, jsd)[0], x.shape[0] * cfg.G)
    if interpret:
        phases = [dict(STATS=True, EXACT=False, GRAD=False, BARRIER=False)]
        if jsd:
            phases.append(dict(STATS=False, EXACT=True, GRAD=False, BARRIER=False))
        phases.append(dict(STATS=False, EXACT=False, GRAD=True, BARRIER=False))
    else:
        phases = [dict(STATS=True, EXACT=jsd, GRAD=True, BARRIER=True)]
    return _launch(x, t, y, cfg, jsd, programs, phases)


def reference(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, jsd: bool) -> tuple[torch.Tensor, list]:
    """float64 loss and gradient blocks (row_on_chip.reference_blocks) of the textbook formulas."""
    def row_losses(xb: torch.Tensor, a: int) -> torch.Tensor:
        lp = torch.log_softmax(xb, -1)
        lq = torch.log_softmax(t[a:a + xb.shape[0]].double(), -1)
        if jsd:
            lm = torch.logsumexp(torch.stack([lp + math.log(BETA), lq + math.log(1 - BETA)]), 0)
            return BETA * (lp.exp() * (lp - lm)).sum(-1) + (1 - BETA) * (lq.exp() * (lq - lm)).sum(-1)
        return (lq.exp() * (lq - lp)).sum(-1)
    return reference_blocks(x, y, row_losses)


def inputs(R: int, V: int, *, device: str, dtype=torch.bfloat16, seed: int = 1):
    """bench/bench.py's inputs: randn * 2 logits and teacher logits, every 7th row ignored."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(R, V, device=device, generator=g) * 2).to(dtype)
    y = torch.randint(0, V, (R,), device=device, generator=g)
    y[::7] = IGNORE
    t = (torch.randn(R, V, device=device, generator=g) * 2).to(dtype)
    return x, t, y


def self_test() -> None:
    """The math on the CPU under TRITON_INTERPRET=1 (each read its own launch), fp32 and bf16, G = 1-4,
    slices that end inside a tile and a member with nothing (G * slice past V)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run the self-test under TRITON_INTERPRET=1"
    failed = 0
    for dtype in (torch.float32, torch.bfloat16):
        for R, V in ((5, 300), (8, 64)):
            x, t, y = inputs(R, V, device="cpu", dtype=dtype)
            for jsd in (True, False):
                for cfg in (Config.for_slice(V, V, 16, 4), Config.for_slice(V, 128, 32, 4),
                            Config.for_slice(V, 80, 16, 4), Config(triton.cdiv(V, 96) + 1, 96, 32, 4)):
                    loss, grad, err = split_teacher(x, t, y, cfg, jsd, programs=2 * cfg.G, interpret=True)
                    e = errors(loss, grad, y, reference(x, t, y, jsd))
                    why = acceptable(e, dtype) or ("error flag set" if int(err) else None)
                    failed += why is not None
                    print(f"{str(dtype):15} {R}x{V:<4} {'JSD' if jsd else 'FKL'} {cfg.name:45} loss {e['loss_rel']:.1e}"
                          f"  grad {e['grad_rel_norm']:.1e}  {'ok' if why is None else 'FAIL: ' + why}", flush=True)
    print("self-test:", "all ok" if not failed else f"{failed} FAILED")
    sys.exit(1 if failed else 0)


def configs(V: int, quick: bool) -> list[Config]:
    """Slices of 4096-16384 columns in tiles of 1024-2048, 4 or 8 warps, the whole resident grid or
    half of it (fewer slices in flight)."""
    out = [Config.for_slice(V, 8192, 2048, 4), Config.for_slice(V, 4096, 2048, 4),
           Config.for_slice(V, 16384, 2048, 8), Config.for_slice(V, 8192, 1024, 4, 0.5)]
    if not quick:
        out += [Config.for_slice(V, 8192, 2048, 4, 0.5), Config.for_slice(V, 16384, 4096, 8),
                Config.for_slice(V, 4096, 1024, 4)]
    return out


def main(quick: bool, out_path: str | None, shapes: list[tuple[int, int]] | None) -> None:
    import losscodegen as lcg
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU (the self-test runs on the CPU)"
    shapes = shapes or ([(8192, 128256)] if quick else [(8192, 128256), (4096, 262144), (8192, 65536)])
    rounds, rep = (2, 100) if quick else (3, 200)
    records = []

    def emit(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    heads = {"JSD": (True, lcg.HeadLoss(lcg.JSD(beta=BETA))), "FKL": (False, lcg.HeadLoss(lcg.ForwardKL()))}
    for R, V in shapes:
        for name, (jsd, head) in heads.items():
            # correctness at 4096 rows (float64 reference in row blocks); a failing config is not timed
            x, t, y = inputs(min(R, 4096), V, device="cuda")
            x.requires_grad_()
            out = head(x, y, teacher_logits=t)
            out.loss.backward()
            e = errors(out.loss.detach(), x.grad, y, reference(x.detach(), t, y, jsd))
            emit(dict(kind="check", head=name, shape=f"{x.shape[0]}x{V}", impl="losscodegen", config="default", **e))
            ok = []
            for cfg in configs(V, quick):
                try:
                    res = resident(cfg, x.detach(), t, y, jsd)
                    loss, grad, err = split_teacher(x.detach(), t, y, cfg, jsd)
                    torch.cuda.synchronize()
                    e = errors(loss, grad, y, reference(x.detach(), t, y, jsd))
                    why = acceptable(e, x.dtype) or ("error flag set (a barrier timed out)" if int(err) else None)
                except Exception as exc:   # an out-of-resources compile, say: reported, not timed
                    res, e, why = (None, {}), {}, f"{type(exc).__name__}: {str(exc)[:200]}"
                emit(dict(kind="check", head=name, shape=f"{x.shape[0]}x{V}", impl="split", config=cfg.name,
                          programs=res[0], **res[1], **e, ok=why is None, why=why))
                if why is None:
                    ok.append(cfg)
            del x, t, y, out
            torch.cuda.empty_cache()

            # timing: the default call as bench/ab.py times it, against each config, interleaved rounds
            x, t, y = inputs(R, V, device="cuda")
            x.requires_grad_()

            def ours():
                x.grad = None
                head(x, y, teacher_logits=t).loss.backward()
            xd = x.detach()
            impls = [("losscodegen", "default", ours)]
            impls += [("split", cfg.name, lambda cfg=cfg: split_teacher(xd, t, y, cfg, jsd)) for cfg in ok]
            best = {}
            for _ in range(rounds):
                for impl, config, fn in impls:
                    ms = triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
                    best[(impl, config)] = min(ms, best.get((impl, config), float("inf")))
            moved = 3 * R * V * x.element_size()
            fns = {config: fn for _, config, fn in impls}
            for (impl, config), ms in best.items():
                emit(dict(kind="time", head=name, shape=f"{R}x{V}", impl=impl, config=config, ms=round(ms, 4),
                          floor_ms=round(moved / HBM_BYTES_PER_S * 1e3, 4), host_ms=round(host_enqueue_ms(fns[config]), 4)))
            for impl, config, fn in impls[1:]:
                if int(fn()[2]):
                    print(f"  {config}: the error flag was set during timing (a barrier timed out)")
            del x, t, y, xd, impls
            torch.cuda.empty_cache()

    print(f"\n{'head':5} {'shape':13} {'impl':12} {'config':52} {'ms':>8} {'floor ms':>8} {'default/ms':>10} {'host':>6}")
    default = {(r["head"], r["shape"]): r["ms"] for r in records if r["kind"] == "time" and r["impl"] == "losscodegen"}
    for r in records:
        if r["kind"] == "time":
            print(f"{r['head']:5} {r['shape']:13} {r['impl']:12} {r['config']:52} {r['ms']:8.4f} {r['floor_ms']:8.4f} "
                  f"{default[(r['head'], r['shape'])] / r['ms']:10.3f} {r['host_ms']:6.3f}")
    if out_path:
        write_records(out_path, records)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one shape, fewer configs and rounds")
    p.add_argument("--self-test", action="store_true", help="the math on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--out", help="also write every record as JSON lines here")
    p.add_argument("--shapes", help="rows x columns to run, e.g. 8192x65536,8192x128256")
    a = p.parse_args()
    if a.self_test:
        self_test()
    else:
        main(a.quick, a.out, [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")] if a.shapes else None)
