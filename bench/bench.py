"""The benchmark (GPU; not collected by pytest): losscodegen beside its peers, in one process.

    python bench/bench.py [--logits] [--linear] [--host] [--quick] [--out DIR]

(Parity at 4096 x 128256 bf16 is a GPU test: `pytest -m gpu tests`. The tile table is measured by
`python -m losscodegen tune`.)
--logits  forward + backward on bf16 logits: CE, GRPO + entropy + clip fraction, CE + z + 0.5 FKL +
          entropy, JSD, at 4096 x 32000, 8192 x 128256 and 4096 x 262144; losscodegen's default call
          and validate=False, against torch eager, torch.compile and Liger (when installed).
--host    host time per forward + backward call at 512 x 4096 (the GPU work is negligible there),
          beside the autograd engine's alone and the peers' CE, and the torch ops and kernel launches
          a call issues.
--linear  fused linear heads, forward + backward with the gradients of hidden and weight: CE at
          8192 x 4096 x 128256 and 8192 x 2048 x 262144, GRPO + entropy and CE + z + 0.5 FKL (a
          teacher weight of the same shape) at 8192 x 4096 x 128256; against torch eager,
          torch.compile, Liger's fused linear CE, Apple's Cut Cross-Entropy (when installed) and
          torch's own F.linear_cross_entropy, chunked (options=LinearCrossEntropyOptions(); torch
          2.13+, skipped where the installed torch lacks it).
          Also the fused path's precision against an fp32 reference, beside the unfused bf16 one.

Times are medians of triton.testing.do_bench; a logits workload's "floor" is the time to read its
logits (and the teacher's) once and write the gradient at the copy bandwidth measured in the same
process (copy_bandwidth, kept in the JSON as copy_bandwidth, bytes/s); peak_GB is torch.cuda.max_memory_allocated above what
was allocated before the call (inputs included there). Everything goes to DIR/<device>.json (default
DIR: docs/perf) as records {workload, shape, impl, ms, peak_GB}, and, with matplotlib (the `bench`
extra), a bar chart DIR/<device>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F
import triton

import losscodegen as lcg

records: list[dict] = []


def peak_gb(fn: Callable[[], None]) -> float:
    """GB allocated above what was allocated before a call of ``fn`` (run once before, to warm up)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def measure(fn: Callable[[], None], rep_ms: int = 300) -> tuple[float, float]:
    """(median ms, peak GB above what was allocated before a call)."""
    peak = peak_gb(fn)
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"), peak


def record(workload: str, shape: str, impl: str, fn: Callable[[], None], rep_ms: int = 300) -> None:
    try:
        ms, peak = measure(fn, rep_ms)
    except Exception as e:  # a peer that fails or runs out of memory at a shape is reported, not fatal
        print(f"  {workload} {shape} {impl}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        ms = peak = float("nan")
    records.append(dict(workload=workload, shape=shape, impl=impl, ms=ms, peak_GB=peak))
    print(f"  {workload:28s} {shape:22s} {impl:24s} {ms:9.3f} ms {peak:7.2f} GB", flush=True)
    torch.cuda.empty_cache()


def optional(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except Exception as e:
        print(f"({module} not available: {type(e).__name__})", flush=True)
        return None


# ---- the formulas in plain torch: the eager and torch.compile peers ---------------------------
def _valid_mean(per_row, v):
    return torch.where(v, per_row, 0).sum() / v.sum().clamp_min(1)


def torch_ce(x, y, **_):
    return F.cross_entropy(x.float(), y, ignore_index=-100)


def torch_grpo(x, y, advantages, old_logprobs, **_):
    logp = torch.log_softmax(x.float(), -1)
    v = y != -100
    r = torch.exp(logp.gather(1, y.clamp_min(0)[:, None])[:, 0] - old_logprobs)
    per = -torch.min(r * advantages, r.clamp(0.8, 1.2) * advantages)
    ent = _valid_mean(-(logp.exp() * logp).sum(-1), v)
    clip = _valid_mean(((r < 0.8) | (r > 1.2)).float(), v)
    return _valid_mean(per, v), ent.detach(), clip.detach()


def torch_fkl_mix(x, y, teacher_logits, **_):
    z = x.float()
    v = y != -100
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    logq = torch.log_softmax(teacher_logits.float(), -1)
    ce = F.cross_entropy(z, y, ignore_index=-100)
    kl = (logq.exp() * (logq - logp)).sum(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return ce + 1e-4 * _valid_mean(lse ** 2, v) + 0.5 * _valid_mean(kl, v), _valid_mean(ent, v).detach()


def torch_jsd(x, y, teacher_logits, **_):
    logp, logq = torch.log_softmax(x.float(), -1), torch.log_softmax(teacher_logits.float(), -1)
    logm = torch.logaddexp(logp, logq) - 0.6931471805599453
    per = 0.5 * (logp.exp() * (logp - logm)).sum(-1) + 0.5 * (logq.exp() * (logq - logm)).sum(-1)
    return _valid_mean(per, y != -100)


LOGIT_WORKLOADS = {
    "CE": (lambda: lcg.HeadLoss(lcg.CrossEntropy()), set(), torch_ce),
    "GRPO+entropy+clip": (lambda: lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())),
                          {"policy"}, torch_grpo),
    "CE+z+0.5FKL+entropy": (lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                                 lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),)),
                            {"teacher"}, torch_fkl_mix),
    "JSD": (lambda: lcg.HeadLoss(lcg.JSD()), {"teacher"}, torch_jsd),
}
LOGIT_SHAPES = [(4096, 32000), (8192, 128256), (4096, 262144)]


# Which rows are ignored (label -100): every 7th (this benchmark's records), or a random 5% (how an outside
# benchmark draws them); --ignored picks, and each record says which.
IGNORED = {"every7": lambda y, g: y.__setitem__(slice(None, None, 7), -100),
           "random5": lambda y, g: y.masked_fill_(torch.rand(y.shape, device=y.device, generator=g) < 0.05, -100)}
ignored = "every7"


def ignore_rows(y, g):
    IGNORED[ignored](y, g)


def logit_inputs(R, V, needs, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(R, V, device="cuda", generator=g) * 2).bfloat16()
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    ignore_rows(y, g)
    kw = {}
    if "teacher" in needs:
        kw["teacher_logits"] = (torch.randn(R, V, device="cuda", generator=g) * 2).bfloat16()
    if "policy" in needs:
        with torch.no_grad():
            lp = torch.log_softmax(x.float(), -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
        kw["old_logprobs"] = lp + 0.3 * torch.randn(R, device="cuda", generator=g)
        kw["advantages"] = torch.randn(R, device="cuda", generator=g)
    return x, y, kw


def logit_step(make, needs, R, V):
    """A benchmark head and its default call (forward + backward) on the benchmark's inputs."""
    x, y, kw = logit_inputs(R, V, needs, seed=1)
    x.requires_grad_()
    head = make()

    def step():
        x.grad = None
        head(x, y, **kw).loss.backward()
    return head, step


def liger_logits(name, liger):
    """Liger's function for a workload on logits, as a user would call it; None where it has none."""
    if liger is None:
        return None
    if name == "CE":
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
        ce = LigerCrossEntropyLoss()
        return lambda x, y, **_: ce(x, y)
    if name == "JSD":
        from liger_kernel.transformers.jsd import LigerJSD
        jsd = LigerJSD(beta=0.5)
        return lambda x, y, teacher_logits, **_: jsd(torch.log_softmax(x.float(), -1),
                                                     torch.log_softmax(teacher_logits.float(), -1), y)
    if name == "GRPO+entropy+clip":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def grpo(x, y, advantages, old_logprobs, **_):
            # (B, L+1, V) logits: the last row only closes the sequence, so L = R - 1 tokens are scored
            return triton_grpo_loss(x[None], old_logprobs[None, :-1], None, y.clamp_min(0)[None, :-1],
                                    advantages[:1], completion_mask=(y != -100)[None, :-1], temperature=1.0,
                                    beta=0.0, eps_low=0.2, eps_high=0.2, inplace=False, reduce=True)[0]
        return grpo
    return None


def _warm_up(seconds: float = 3.0) -> None:
    """Busy the GPU before the first timing: its clocks ramp up under load, so the first workload
    timed on an idle GPU can read slow."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def bench_logits(quick: bool, liger) -> float:
    """The logits workloads' records; returns the copy bandwidth their floors are at (bytes/s)."""
    print("\nlogits workloads, forward + backward, bf16:", flush=True)
    _warm_up()
    bandwidth = copy_bandwidth()
    print(f"  copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    shapes = LOGIT_SHAPES[1:2] if quick else LOGIT_SHAPES
    for name, (make, needs, formula) in LOGIT_WORKLOADS.items():
        for R, V in shapes:
            shape = f"{R}x{V}"
            x, y, kw = logit_inputs(R, V, needs, seed=1)
            x.requires_grad_()
            head = make()
            head_noval = make()
            head_noval.validate = False
            compiled = torch.compile(formula)
            impls = {"losscodegen": lambda: head(x, y, **kw).loss,
                     "losscodegen validate=False": lambda: head_noval(x, y, **kw).loss,
                     "torch eager": lambda: formula(x, y, **kw),
                     "torch.compile": lambda: compiled(x, y, **kw)}
            liger_fn = liger_logits(name, liger)
            if liger_fn is not None:
                impls["Liger"] = lambda: liger_fn(x, y, **kw)
            steps = {}
            for impl, fn in impls.items():
                def step(fn=fn):
                    x.grad = None
                    out = fn()
                    (out[0] if isinstance(out, tuple) else out).backward()
                steps[impl] = step
                record(name, shape, impl, step)
            # Every implementation again, in alternating rounds: the machine drifts between two
            # measurements by as much as the difference sought (at 4096 x 32000, where every
            # implementation is bound by its host work, by up to 2x).
            mine = [r for r in records[-len(impls):] if r["ms"] == r["ms"]]   # (not the failed ones)
            samples = {r["impl"]: [r["ms"]] for r in mine}
            for _ in range(3):
                for impl in samples:
                    samples[impl].append(triton.testing.do_bench(steps[impl], warmup=10, rep=200,
                                                                 return_mode="median"))
            for r in mine:
                r["ms"] = sorted(samples[r["impl"]])[len(samples[r["impl"]]) // 2]
                print(f"  {name:28s} {shape:22s} {r['impl']:24s} {r['ms']:9.3f} ms (median of 4, alternating)",
                      flush=True)
            records.append(dict(workload=name, shape=shape, impl="floor", peak_GB=0.0,
                                ms=_floor(needs, R, V, bandwidth)))
            del x, kw
            torch.cuda.empty_cache()
    return bandwidth


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes a second that a device-to-device copy of ``gib`` GiB moves (read + write), measured here:
    the rate a head bound by memory can reach on this GPU (3.0e12 on the H100 of the earlier tables,
    which took it as a constant)."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=300, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / (ms / 1e3)


def _floor(needs, R, V, bandwidth: float) -> float:
    """ms to read the logits (and the teacher's) once and write the gradient, at ``bandwidth``."""
    return (6 if "teacher" in needs else 4) * R * V / bandwidth * 1e3


# ---- fused linear heads ----------------------------------------------------------------------
LINEAR_WORKLOADS = [("CE", 8192, 4096, 128256), ("CE", 8192, 2048, 262144),
                    ("GRPO+entropy", 8192, 4096, 128256), ("CE+z+0.5FKL", 8192, 4096, 128256)]


def linear_inputs(N, H, V, teacher: bool, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    ignore_rows(y, g)
    kw = {}
    if teacher:
        kw = dict(teacher_hidden=(torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16(),
                  teacher_weight=(torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16())
    return hidden, weight, y, kw


def linear_precision(N=4096, H=4096, V=128256):
    """dL/dhidden and dL/dweight of the fused path and of the unfused bf16 path (logits in bf16, one
    product for each gradient), each against fp32 autograd on the same inputs."""
    hidden, weight, y, _ = linear_inputs(N, H, V, False, seed=3)
    torch.backends.cuda.matmul.allow_tf32 = False
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    F.cross_entropy(h32 @ w32.t(), y, ignore_index=-100).backward()
    head = lcg.HeadLoss(lcg.CrossEntropy())
    out = {}
    for name, run in (("losscodegen linear", lambda: head.linear(hidden, weight, y).loss),
                      ("unfused bf16", lambda: head(hidden @ weight.t(), y).loss)):
        hidden.grad = weight.grad = None
        run().backward()
        out[name] = {k: ((g.float() - r).norm() / r.norm()).item()
                     for k, g, r in (("hidden", hidden.grad, h32.grad), ("weight", weight.grad, w32.grad))}
    print(f"\nfused linear precision at {N}x{H}x{V} bf16 (relative Frobenius error against fp32):", flush=True)
    for name, errs in out.items():
        print(f"  {name:20s} dL/dhidden {errs['hidden']:.2e}  dL/dweight {errs['weight']:.2e}", flush=True)
    return out


def torch_linear(name):
    def ce(h, w, y, **_):
        return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)

    def grpo(h, w, y, advantages, old_logprobs, **_):
        return torch_grpo(h @ w.t(), y, advantages, old_logprobs)[:2]

    def fkl(h, w, y, teacher_hidden, teacher_weight, **_):
        return torch_fkl_mix(h @ w.t(), y, (teacher_hidden @ teacher_weight.t()).detach())
    return {"CE": ce, "GRPO+entropy": grpo, "CE+z+0.5FKL": fkl}[name]


def bench_linear(quick: bool, liger, cce):
    precision = linear_precision()
    torch_lce = getattr(F, "linear_cross_entropy", None)          # torch 2.13+
    torch_lce_options = torch.nn.LinearCrossEntropyOptions() if torch_lce is not None else None
    if torch_lce is None:
        print(f"(torch {torch.__version__} has no F.linear_cross_entropy)", flush=True)
    print("\nfused linear workloads, forward + backward (grads of hidden and weight), bf16:", flush=True)
    heads = {"CE": lambda: lcg.HeadLoss(lcg.CrossEntropy()),
             "GRPO+entropy": lambda: lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(),)),
             "CE+z+0.5FKL": lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                                 lcg.ForwardKL(weight=0.5))}
    for name, N, H, V in LINEAR_WORKLOADS[:1] if quick else LINEAR_WORKLOADS:
        shape = f"{N}x{H}x{V}"
        hidden, weight, y, kw = linear_inputs(N, H, V, "FKL" in name)
        if name.startswith("GRPO"):
            g = torch.Generator(device="cuda").manual_seed(5)
            kw = dict(advantages=torch.randn(N, device="cuda", generator=g),
                      old_logprobs=torch.randn(N, device="cuda", generator=g) - 11.0)
        head = heads[name]()
        formula = torch_linear(name)
        compiled = torch.compile(formula)
        impls = {"losscodegen": lambda: head.linear(hidden, weight, y, **kw).loss,
                 "torch eager": lambda: formula(hidden, weight, y, **kw),
                 "torch.compile": lambda: compiled(hidden, weight, y, **kw)}
        if name == "CE" and liger is not None:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
            flce = LigerFusedLinearCrossEntropyLoss()
            impls["Liger FLCE"] = lambda: flce(weight, hidden, y)
        if name == "CE" and cce is not None:
            impls["CCE"] = lambda: cce.linear_cross_entropy(hidden, weight, y)
        if name == "CE" and torch_lce is not None:
            # its chunked path (options=None is the unfused formula, the "torch eager" row)
            impls["torch linear_cross_entropy"] = lambda: torch_lce(hidden, weight, y, options=torch_lce_options)
        for impl, fn in impls.items():
            def step(fn=fn):
                hidden.grad = weight.grad = None
                out = fn()
                (out[0] if isinstance(out, tuple) else out).backward()
            record(name, shape, impl, step, rep_ms=1500)
        hidden.grad = weight.grad = None
        records.append(dict(workload=name, shape=shape, impl="weight.grad", ms=float("nan"),
                            peak_GB=weight.numel() * weight.element_size() / 1e9))
        del hidden, weight, kw
        torch.cuda.empty_cache()
    return precision


# ---- host work -----------------------------------------------------------------------------------
def host_work(liger, R=512, V=4096, rounds=15, calls=100):
    """Host time per forward + backward call where the GPU work is negligible: calls queued back to
    back, one sync a round; the best and the median of the rounds' means (this machine's host is
    noisy). Beside it, what the same loop costs the autograd engine alone (a backward through one
    multiplication) and the peers' CE; and what a call issues: torch ops and kernel launches
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    def per_call(step):
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        means = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
            means.append((time.perf_counter() - t0) / calls * 1e6)
        means.sort()
        return means[0], means[rounds // 2]

    def issued(step):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
        ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and
                  (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))) / 10
        launches = sum(1 for e in prof.events() if e.name in ("cuLaunchKernel", "cudaLaunchKernel",
                                                               "cuLaunchKernelEx", "cudaMemsetAsync",
                                                               "cudaMemcpyAsync")) / 10
        return ops, launches

    heads = {**{k: (v[0], v[1], {}) for k, v in LOGIT_WORKLOADS.items()},
             "GSPO (num_segments=)": (lambda: lcg.HeadLoss(lcg.GSPO()), {"policy"},
                                      dict(segment_ids=torch.arange(R, device="cuda") // 64, num_segments=R // 64))}
    def backward(x, loss_of):
        def step():
            x.grad = None
            loss_of().backward()
        return step

    x, y, _ = logit_inputs(R, V, set())
    x.requires_grad_()
    one = torch.ones((), device="cuda", requires_grad=True)
    compiled_ce = torch.compile(torch_ce)
    steps = {"autograd engine alone: (a * 2).backward()": backward(one, lambda: one * 2),
             "torch eager CE": backward(x, lambda: torch_ce(x, y)),
             "torch.compile CE": backward(x, lambda: compiled_ce(x, y))}
    liger_ce = liger_logits("CE", liger)
    if liger_ce is not None:
        steps["Liger CE"] = backward(x, lambda: liger_ce(x, y))
    for name, (make, needs, extra) in heads.items():
        for validate in (True, False):
            head = make()
            head.validate = validate
            xh, yh, kw = logit_inputs(R, V, needs)
            kw.update(extra)
            xh.requires_grad_()
            steps[name + ("" if validate else " validate=False")] = \
                backward(xh, lambda head=head, xh=xh, yh=yh, kw=kw: head(xh, yh, **kw).loss)
    rows = []
    print(f"\nhost work per forward + backward call at {R} x {V} bf16 (best / median of {rounds} rounds):",
          flush=True)
    for label, step in steps.items():
        best, median = per_call(step)
        ops, launches = issued(step)
        rows.append(dict(head=label, host_us=best, host_us_median=median, torch_ops=ops, launches=launches))
        print(f"  {label:44s} {best:7.1f} / {median:7.1f} us   {ops:4.1f} torch ops   "
              f"{launches:4.1f} launches/copies", flush=True)
    return rows


def plot(path: str, device: str) -> None:
    """Bars per workload and shape, one per implementation, the memory floor marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    groups = list(dict.fromkeys((r["workload"], r["shape"]) for r in records if r["impl"] != "weight.grad"))
    impls = list(dict.fromkeys(r["impl"] for r in records if r["impl"] not in ("floor", "weight.grad")))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 5))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        ms = [next((r["ms"] for r in records if (r["workload"], r["shape"], r["impl"]) == (*grp, impl)),
                   float("nan")) for grp in groups]
        ax.bar([j + i * width for j in range(len(groups))], ms, width, label=impl)
    for j, grp in enumerate(groups):
        floor = next((r["ms"] for r in records if (r["workload"], r["shape"], r["impl"]) == (*grp, "floor")), None)
        if floor:
            ax.hlines(floor, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="dashed")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{s}" for w, s in groups], fontsize=7)
    ax.set_ylabel("ms, forward + backward (dashed: memory floor)")
    ax.set_yscale("log")
    ax.set_title(f"losscodegen and peers, {device}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logits", action="store_true")
    ap.add_argument("--linear", action="store_true")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one shape per workload")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    ap.add_argument("--ignored", choices=sorted(IGNORED), default="every7", help="which rows have label -100")
    args = ap.parse_args()
    global ignored
    ignored = args.ignored
    device = torch.cuda.get_device_name()
    print(device, "torch", torch.__version__, "triton", triton.__version__, flush=True)
    liger, cce = optional("liger_kernel"), optional("cut_cross_entropy")
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, ignored=ignored)
    if args.host:
        result["host"] = host_work(liger)
    if args.logits:
        result["copy_bandwidth"] = bench_logits(args.quick, liger)
    if args.linear:
        result["linear_precision"] = bench_linear(args.quick, liger, cce)
    result["records"] = records
    name = "-".join(device.split())
    os.makedirs(args.out, exist_ok=True)
    if ignored != "every7":
        name += f"-{ignored}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(os.path.join(args.out, f"{name}.png"), device)
    print("\nworkload                     shape                  impl                            ms      GB")
    for r in records:
        print(f"{r['workload']:28s} {r['shape']:22s} {r['impl']:24s} {r['ms']:9.3f} {r['peak_GB']:7.2f}")


if __name__ == "__main__":
    main()
