"""Multi-GPU runs (not collected by pytest): `torchrun --nproc_per_node N bench/multi_gpu.py --out DIR`
(`bench/multi_gpu.sh KIND` names N and DIR per machine kind; docs/performance.md, "Multi-GPU runs").

Parts (`--parts`, all by default), each rank on its own GPU over NCCL:
- correctness: every head of HEADS on logits sharded N ways (`process_group=`), in-kernel and
  all-gather exchange, at each shape of MGPU_SHAPES; GSPO also with its rows (segments crossing
  ranks) over a sequence-parallel group (`segment_group=`) and on a dp x tp grid of groups;
  `head.linear` with a vocab-sharded weight; calls queued back to back with a rank held back.
  Each against the unsharded call, which every rank computes on its own GPU from the same inputs
  (one seed), so each rank's gradient shard is compared where it lies; the worst error over ranks
  is kept.
- dtensor: the same heads given DTensor logits (`Shard(-1)` on a 1-D mesh; `Shard(0), Shard(-1)` on
  a dp x tp mesh) and `head.linear` given a `Shard(0)` DTensor weight (CONTRACT.md, "Distributed
  engines"). Where the first head's DTensor calls all raise, "DTensor: not supported by this build"
  and the rest goes on.
- fsdp: `apply_losscodegen` on a small transformers Llama whose layers and lm_head are FSDP2 units,
  a few SGD steps against the unsharded model's (its own loss, every rank's batch in turn); guarded
  like DTensor.
- scaling: the default call's time (forward + backward) at N ranks beside one GPU's, for the same
  global work (R x V/N a rank) and the same work per rank (N*R x V/N), on each path: the default
  (in-kernel exchange where the GPUs map each other's memory), the all-gather, and "no-op" (the
  all-gather path with every collective replaced by a local copy of the same shape: the shard-local
  work). Collective rounds and bytes per call, counted at the dispatcher, against the one-round
  ideal: the all-reduce of the packed row stats.

Timings use a fixed number of iterations on every rank: a timer that picks its own repeat count
(triton's do_bench) can pick a different one per rank, and the ranks then wait forever on each
other's collectives. One JSON record per run, `DIR/<device>-multigpu-<N>.json`, rewritten after
each step (a run stopped by its time limit keeps what it finished); a table is printed last. The
exit status is 1 where a check failed.

`--cpu`: gloo ranks on the CPU, tiny sizes, kernels in Triton's interpreter: the same code paths
(tests/runtime/test_multi_gpu_script.py). Sizes and counts: the MGPU_* variables below.
`python bench/multi_gpu.py --markdown RECORD...`: the records' tables for docs/performance.md."""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import json
import math
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

# NVLink multicast stays off (the device machines' rule: using it can take a shared host's GPUs out
# of service); set before torch.distributed starts, and inherited by any child process.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in MULTICAST_OFF.items():
    os.environ.setdefault(_k, _v)
PARTS = ("correctness", "dtensor", "fsdp", "scaling")
WORKS = ("same global work", "same work per rank")


def markdown(paths: list[str]) -> str:
    """The records' scaling side by side (a column per record, its ranks heading it: the sharded
    call's ms / one GPU's on the same machine, efficiencies, rounds and bytes), then each record's
    checks counted, as markdown for docs/performance.md."""
    records = sorted((json.load(open(p)) for p in paths), key=lambda r: r["meta"]["world"])
    heads = list(dict.fromkeys(s["head"] for r in records for s in r.get("scaling", [])))
    out = []
    for work in WORKS:
        out += [f"{work}: ms, N ranks / 1 GPU (efficiency; on the shard-local work; rounds, wire / ideal):", "",
                "| head | " + " | ".join(f"{r['meta']['world']} ranks" for r in records) + " |",
                "|---|" + "---|" * len(records)]
        for head in heads:
            cells = []
            for r in records:
                s = next((s for s in r.get("scaling", []) if s["head"] == head), None)
                if s is None:
                    cells.append("-")
                    continue
                w, c = s[work], s["collectives"]
                wire = "-" if c["wire_over_ideal"] is None else f"{c['wire_over_ideal']:.2f}x"
                cells.append(f"{w['ms']['default']:.3f} / {s['ms_1gpu']:.3f} ({w['efficiency']['default']:.2f}; "
                             f"{w['efficiency']['no-op']:.2f}; {c['rounds']}, {wire})")
            out.append(f"| {head} | " + " | ".join(cells) + " |")
        out.append("")
    for r in records:
        m = r["meta"]
        checks = [c for part in ("correctness", "dtensor", "fsdp") for c in r.get(part, [])]
        worst = {k: max(c[k] for c in checks if k in c) for k in ("value_err", "grad_err")
                 if any(k in c for c in checks)}
        out.append(f"- {m['world']} x {m['device']} ({m['date']}, codegen {m.get('codegen')}): "
                   f"{sum(c['status'] == 'pass' for c in checks)} of {len(checks)} checks passed"
                   + "".join(f", worst {k.removesuffix('_err')} error {v:.1e}" for k, v in worst.items())
                   + "".join(f"; {part}: {r[part + '_status']['status']}" for part in ("dtensor", "fsdp")
                             if r.get(part + "_status", {}).get("status") == "unsupported"))
    return "\n".join(out)


_parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_parser.add_argument("--out", help="folder of the JSON record (required for a run)")
_parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, tiny sizes, Triton's interpreter")
_parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
_parser.add_argument("--markdown", nargs="+", metavar="RECORD", help="print these records' tables (no run)")
ARGS = _parser.parse_args()
if ARGS.markdown:
    print(markdown(ARGS.markdown))
    sys.exit(0)
if not ARGS.out:
    _parser.error("--out is required for a run")
RUN_PARTS = [p for p in ARGS.parts.split(",") if p]
if set(RUN_PARTS) - set(PARTS):
    _parser.error(f"--parts: unknown {sorted(set(RUN_PARTS) - set(PARTS))}, of {PARTS}")
if ARGS.cpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import losscodegen as lcg  # noqa: E402
from losscodegen import collectives  # noqa: E402


def setting(name: str, gpu: str, cpu: str) -> str:
    """MGPU_<name>, else the default of this mode."""
    return os.environ.get(f"MGPU_{name}", cpu if ARGS.cpu else gpu)


def parse_shape(text: str) -> tuple[int, int]:
    rows, vocab = (int(n) for n in text.split("x"))
    return rows, vocab


SHAPES = [parse_shape(s) for s in setting("SHAPES", "8192x128256,4096x262144", "16x1008").split(",")]   # rows x vocab
SCALING_SHAPE = parse_shape(os.environ["MGPU_SCALING_SHAPE"]) if "MGPU_SCALING_SHAPE" in os.environ else SHAPES[0]
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setting("DTYPE", "bf16", "bf16")]
HIDDEN = int(setting("HIDDEN", "4096", "32"))            # head.linear's hidden size
LINEAR_ROWS = int(setting("LINEAR_ROWS", "2048", "16"))  # head.linear's rows in the correctness part
TOPK = int(setting("TOPK", "64", "4"))
ITERS, WARMUP, ROUNDS = (int(setting(n, g, c)) for n, g, c in (("ITERS", "30", "1"), ("WARMUP", "5", "0"),
                                                               ("ROUNDS", "3", "0")))
LLAMA = dict(zip(("layers", "hidden", "vocab", "seq"), (int(n) for n in setting("LLAMA", "2,1024,128256,2048",
                                                                                  "2,32,1008,8").split(","))))
FSDP_STEPS = int(setting("FSDP_STEPS", "3", "2"))
B2B_REPEATS = int(setting("B2B_REPEATS", "8", "1"))      # rounds of the 6 back-to-back calls
ONLY_HEADS = setting("HEADS", "all", "all")                # a comma-separated subset of HEADS (and LINEAR_NAME)
SCALING_HEADS = setting("SCALING_HEADS", ONLY_HEADS, ONLY_HEADS)

faulthandler.dump_traceback_later(int(setting("WATCHDOG", "540", "600")), exit=True)
T0 = time.time()
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if ARGS.cpu:
    DEVICE = torch.device("cpu")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
else:
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", RANK)))
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", device_id=DEVICE, timeout=datetime.timedelta(seconds=180))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # fp32 means fp32 (FSDP part)
CUDA = DEVICE.type == "cuda"
GROUP = dist.group.WORLD
DP = 2 if WORLD >= 4 and WORLD % 2 == 0 else 1   # the 2-D grid: dp x tp
MESH_1D = init_device_mesh(DEVICE.type, (WORLD,), mesh_dim_names=("tp",))
MESH_2D = init_device_mesh(DEVICE.type, (DP, WORLD // DP), mesh_dim_names=("dp", "tp"))
warnings.filterwarnings("ignore", message=".*deprecated.*")   # all_gather_into_tensor, in torch 2.13
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")   # the interpreter's masked lanes


def log(msg: str) -> None:
    print(f"[rank {RANK} {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def shard_of(n: int, parts: int, index: int) -> slice:
    """The ``index``-th of ``parts`` equal contiguous pieces of ``n``."""
    if n % parts:
        raise SystemExit(f"{n} does not split into {parts} equal shards: pick sizes that do (MGPU_SHAPES)")
    return slice(index * n // parts, (index + 1) * n // parts)


# ---- inputs -------------------------------------------------------------------------------------
# Every head; what each reads besides logits and labels: "teacher" (teacher logits), "policy"
# (old and reference log-probs, advantages), "topk" (a teacher's top-k), "segments" (GSPO's).
HEADS: dict[str, tuple[lcg.HeadLoss, tuple[str, ...]]] = {
    "CE": (lcg.HeadLoss(lcg.CrossEntropy()), ()),
    "CE+z+entropy+acc": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                      metrics=(lcg.Entropy(), lcg.TokenAccuracy())), ()),
    "CE+z+0.5FKL+entropy": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4), lcg.ForwardKL(weight=0.5),
                                         metrics=(lcg.Entropy(),)), ("teacher",)),
    "JSD": (lcg.HeadLoss(lcg.JSD()), ("teacher",)),
    "GRPO+metrics": (lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.Entropy(), lcg.ClipFraction(),
                                                                    lcg.RatioMean(), lcg.KLNewOld())), ("policy",)),
    "CE+topk-KD": (lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.TopKForwardKL()), ("topk",)),
    "GSPO": (lcg.HeadLoss(lcg.GSPO()), ("policy", "segments")),
}
LINEAR_HEAD = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
LINEAR_NAME = "linear CE+entropy"


def make_inputs(R: int, V: int, width: int, needs: tuple[str, ...], *, seed: int,
                logit_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(logits [R, width], labels [R], the other inputs): the rows' inputs from ``seed`` (alike on
    every rank), the logits (and teacher logits) from ``logit_seed`` (default ``seed``). With
    ``width == V`` the old log-probs are the logits' own plus noise (ratios near 1, some clipped);
    for a shard (timing only) they are a plausible constant plus noise."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    gl = torch.Generator(device=DEVICE).manual_seed(seed if logit_seed is None else logit_seed)
    x = (torch.randn(R, width, device=DEVICE, generator=gl) * 2).to(DTYPE)
    y = torch.randint(0, V, (R,), device=DEVICE, generator=g)
    y[::7] = -100
    kw: dict[str, Any] = {}
    if "teacher" in needs:
        kw["teacher_logits"] = (torch.randn(R, width, device=DEVICE, generator=gl) * 2).to(DTYPE)
    if "policy" in needs:
        if width == V:
            lp = torch.cat([torch.log_softmax(c.float(), -1).gather(1, yc.clamp_min(0)[:, None])[:, 0]
                            for c, yc in zip(x.split(1024), y.split(1024))])
        else:
            lp = torch.full((R,), -math.log(V) - 2.0, device=DEVICE)
        kw.update(old_logprobs=lp + 0.1 * torch.randn(R, device=DEVICE, generator=g),
                  ref_logprobs=lp + 0.1 * torch.randn(R, device=DEVICE, generator=g),
                  advantages=torch.randn(R, device=DEVICE, generator=g))
    if "topk" in needs:   # TOPK distinct ids a row: a random start, then steps of V // TOPK
        start = torch.randint(0, V, (R, 1), device=DEVICE, generator=g)
        kw.update(teacher_topk_ids=(start + torch.arange(TOPK, device=DEVICE) * (V // TOPK)) % V,
                  teacher_topk_logprobs=torch.log_softmax(torch.randn(R, TOPK, device=DEVICE, generator=g), -1))
    if "segments" in needs:
        # segments of L rows, L not dividing a rank's rows: segments cross the ranks' boundaries
        L = max(2, R // (2 * WORLD) + 1)
        kw.update(segment_ids=torch.arange(R, device=DEVICE) // L, num_segments=-(-R // L))
    return x, y, kw


def local_inputs(kw: dict[str, Any], rows: slice, cols: slice) -> dict[str, Any]:
    """This rank's part of the inputs: the teacher logits' [rows, cols], every per-row input's rows."""
    return {k: v if not isinstance(v, torch.Tensor) else v[rows, cols].contiguous() if k == "teacher_logits"
            else v[rows] for k, v in kw.items()}


# ---- counting collectives ---------------------------------------------------------------------
def _op_bytes(op: str, tensors: list[torch.Tensor]) -> int:
    """The bytes one rank gives a collective: a gather's input (its smallest tensor), a
    reduce-scatter's or all-to-all's input (its largest), else the first tensor (an all-reduce's)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    if "gather" in op:
        return min(sizes)
    if "reduce_scatter" in op or "all_to_all" in op or "alltoall" in op:
        return max(sizes)
    return sizes[0]


def _wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes a rank sends for one collective over ``n`` ranks (ring algorithms), ``nbytes`` its input."""
    if "allreduce" in op or "all_reduce" in op:
        return 2 * (n - 1) / n * nbytes
    if "gather" in op:
        return (n - 1) * nbytes
    if "reduce_scatter" in op or "all_to_all" in op or "alltoall" in op:
        return (n - 1) / n * nbytes
    return float(nbytes)   # broadcast and the rest


def _group_size(args: tuple) -> int:
    for a in args:
        if isinstance(a, str):
            with contextlib.suppress(Exception):
                return collectives.resolve(a).size()
        if isinstance(a, torch.ScriptObject):
            with contextlib.suppress(Exception):
                return dist.ProcessGroup.unbox(a).size()
    return WORLD


class Collectives(TorchDispatchMode):
    """Every collective the calls inside issue, as it reaches the dispatcher (c10d ops and functional
    collectives, those DTensor issues too), and every in-kernel exchange: (op, bytes, wire bytes)."""

    _SKIP = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int, int, float]] = []   # (op, bytes, ranks, wire bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented   # let DTensor run; its collectives come back here on local tensors
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and not any(s in func.__name__ for s in self._SKIP):
            nbytes = _op_bytes(func.__name__, [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)])
            n = _group_size(args)
            self.ops.append((func.__name__, nbytes, n, _wire_bytes(func.__name__, nbytes, n)))
        return out

    def __enter__(self):
        original = collectives.Exchange.next

        def next_counted(exchange, rows, columns):
            # each rank writes its rows' stats, a flag a row and one a launch to every peer
            self.ops.append(("in-kernel exchange", 4 * rows * columns, exchange.world,
                             4.0 * (exchange.world - 1) * (rows * columns + rows + 1)))
            return original(exchange, rows, columns)
        self._patch = mock.patch.object(collectives.Exchange, "next", next_counted)
        self._patch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)
        return super().__exit__(*exc)


def counted(fn: Callable[[], Any], rows: int, columns: int, n: int) -> dict[str, Any]:
    """One call of ``fn`` under ``Collectives``: its rounds (collectives over more than one rank:
    one over a group of one, as DTensor makes on a mesh dimension of size 1, moves nothing) and
    bytes, against the one-round ideal (the all-reduce of ``rows`` x ``columns`` fp32 packed row
    stats over ``n`` ranks)."""
    with Collectives() as c:
        fn()
    if CUDA:
        torch.cuda.synchronize()
    wire, ideal = sum(w for *_, w in c.ops), _wire_bytes("all_reduce", 4 * rows * columns, n)
    return dict(rounds=sum(k > 1 for _, _, k, _ in c.ops),
                ops=[dict(op=o, bytes=b, ranks=k, wire_bytes=w) for o, b, k, w in c.ops],
                wire_bytes=wire, ideal_wire_bytes=ideal, wire_over_ideal=wire / ideal if ideal else None)


# ---- the paths the exchange may take ----------------------------------------------------------
def _forced_all_gather():
    return mock.patch.object(collectives, "exchange", lambda group, device: None)


def _local_gather(out: torch.Tensor, part: torch.Tensor, group: Any) -> None:
    n = out.numel() // part.numel()   # every rank's part taken to be this one's: the same bytes written
    out.view(n, *part.shape).copy_(part.unsqueeze(0).expand(n, *part.shape))


@contextlib.contextmanager
def _no_collectives():
    with _forced_all_gather(), mock.patch.object(collectives, "gather", _local_gather), \
            mock.patch.object(collectives, "all_reduce", lambda t, group, op="sum": None):
        yield


PATHS = {"default": contextlib.nullcontext, "all-gather": _forced_all_gather, "no-op": _no_collectives}


def exchange_in_kernel(group: Any) -> bool:
    return collectives.exchange(group, DEVICE) is not None   # (decided once a group, by every rank)


# ---- checks -------------------------------------------------------------------------------------
TOL = {torch.float32: dict(value=1e-5, grad=1e-4, hidden_grad=1e-4),
       # bf16 gradients round differently from the unsharded call's (1 ulp = 4e-3 on a few entries);
       # head.linear's dL/dhidden rounds each rank's bf16 product before the sum over ranks
       torch.bfloat16: dict(value=1e-4, grad=2e-3, hidden_grad=1e-2),
       torch.float16: dict(value=1e-4, grad=1e-3, hidden_grad=5e-3)}[DTYPE]
FSDP_TOL = dict(loss=1e-4, weight=1e-3)
RECORD: dict[str, Any] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1.0 if b.dim() == 0 else 1e-30)).item()


def worst_over_ranks(errors: dict[str, float]) -> dict[str, float]:
    """Each error's worst over the ranks (a NaN counted as infinite: MAX need not keep NaNs)."""
    t = torch.tensor([math.inf if math.isnan(v) else v for v in errors.values()], dtype=torch.float64,
                     device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(errors, t.tolist()))


def plain(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(out, ref: dict[str, torch.Tensor], grads: list[tuple[str, Any, torch.Tensor]]) -> dict[str, float]:
    """Errors of ``out`` against the unsharded call's ``ref`` (loss, terms and metrics), and of each
    (name, gradient, reference gradient); a missing value or gradient counts as infinite."""
    got = {"loss": out.loss, **out.terms, **out.metrics}
    errs = {"loss_err": rel(plain(got["loss"]), ref["loss"]),
            "value_err": max(rel(plain(got[k]), v) if k in got else math.inf for k, v in ref.items())}
    for name, g, want in grads:
        errs[name] = math.inf if g is None else rel(g.to_local() if isinstance(g, DTensor) else g, want)
    return worst_over_ranks(errs)


def verdict(errs: dict[str, float], tol: dict[str, float]) -> bool:
    limit = {"loss_err": tol["value"], "value_err": tol["value"]}
    return all(v <= limit.get(k, tol.get(k.removesuffix("_err"), tol["grad"])) for k, v in errs.items())


def add_check(part: str, name: str, variant: str, shape: str, errs: dict[str, float], tol: dict[str, float],
              **extra: Any) -> None:
    ok = verdict(errs, tol)
    RECORD.setdefault(part, []).append(dict(head=name, variant=variant, shape=shape, **errs, tolerance=tol,
                                            status="pass" if ok else "FAIL", **extra))
    log(f"{part}: {name}, {variant}, {shape}: {'pass' if ok else 'FAIL'} "
        + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))


def reference(head: lcg.HeadLoss, x: torch.Tensor, y: torch.Tensor, kw: dict) -> tuple[dict, torch.Tensor]:
    xf = x.clone().requires_grad_()
    out = head(xf, y, **kw)
    out.loss.backward()
    return {"loss": out.loss.detach(), **out.terms, **out.metrics}, xf.grad


# A variant: how the call is sharded. Given the head, the global inputs and the reference gradient,
# it runs one sharded call and returns (out, [(name, gradient here, the reference's part of it)]).
Variant = Callable[[lcg.HeadLoss, torch.Tensor, torch.Tensor, dict, torch.Tensor], tuple[Any, list]]


def groups_variant(rows: slice, cols: slice, **groups: Any) -> Variant:
    """``head(logits[rows, cols], labels[rows], process_group=..., segment_group=...)``."""
    def run(head, x, y, kw, ref_grad):
        xs = x[rows, cols].contiguous().requires_grad_()
        out = head(xs, y[rows], **groups, **local_inputs(kw, rows, cols))
        out.loss.backward()
        return out, [("grad_err", xs.grad, ref_grad[rows, cols])]
    return run


def chosen(name: str, heads: str) -> bool:
    return heads == "all" or name in heads.split(",")


def mesh_shard(mesh, dim: str, n: int) -> slice:
    """This rank's piece of ``n`` along the mesh dimension ``dim``."""
    return shard_of(n, mesh.size(mesh.mesh_dim_names.index(dim)), mesh.get_local_rank(dim))


def dtensor_variant(mesh, R: int, V: int, *, rows_over: str | None) -> Variant:
    """DTensor logits (and teacher logits): ``Shard(-1)`` over the mesh's "tp" dimension and, with
    ``rows_over``, ``Shard(0)`` over that one. Per-row inputs: local tensors (global, replicated) on
    a mesh without a row dimension, DTensors with the logits' row placement on one with it."""
    dims = mesh.mesh_dim_names
    rows = mesh_shard(mesh, rows_over, R) if rows_over else slice(None)
    cols = mesh_shard(mesh, "tp", V)

    def place(t: torch.Tensor, vocab: bool) -> DTensor:
        placements = [Shard(-1) if d == "tp" and vocab else Shard(0) if d == rows_over else Replicate()
                      for d in dims]
        return DTensor.from_local(t, mesh, placements, run_check=False)

    def as_dtensor(name: str, t: Any) -> bool:   # the teacher's logits always; per-row inputs where rows shard
        return isinstance(t, torch.Tensor) and (rows_over is not None or name == "teacher_logits")

    def run(head, x, y, kw, ref_grad):
        xd = place(x[rows, cols].contiguous(), True).detach().requires_grad_()
        loc = local_inputs(kw, rows, cols)
        y_in = place(y[rows], False) if rows_over else y
        loc = {k: place(v, k == "teacher_logits") if as_dtensor(k, v) else v for k, v in loc.items()}
        out = head(xd, y_in, **loc)
        out.loss.backward()
        g = xd.grad
        if g is not None and (not isinstance(g, DTensor) or tuple(g.placements) != tuple(xd.placements)):
            log(f"DTensor: the gradient's placement {getattr(g, 'placements', type(g).__name__)} is not the "
                f"logits' {xd.placements}")
            g = None
        return out, [("grad_err", g, ref_grad[rows, cols])]
    return run


@dataclass
class Case:
    """One sharded call to check against the unsharded one: its part of the record, its label, the
    variant, for counting its collectives the rows a rank holds and the ranks they exchange over,
    the exchange's path, and whether to count its collectives (one call more)."""

    part: str
    label: str
    run: Variant
    rows: int
    ranks: int
    path: Callable = contextlib.nullcontext
    count: bool = True


def cases(R: int, V: int, needs: tuple[str, ...]) -> list[Case]:
    cols, tp = shard_of(V, WORLD, RANK), WORLD // DP
    vocab = groups_variant(slice(None), cols, process_group=GROUP)
    out = [Case("correctness", f"vocab/{WORLD}", vocab, R, WORLD, count=False)]   # (counted by scaling)
    if exchange_in_kernel(GROUP):   # the default took the in-kernel exchange: the all-gather too
        out.append(Case("correctness", f"vocab/{WORLD}, all-gather", vocab, R, WORLD, _forced_all_gather, False))
    if "segments" in needs:
        out += [Case("correctness", f"rows/{WORLD} (segment_group)",
                     groups_variant(shard_of(R, WORLD, RANK), slice(None), segment_group=GROUP), R // WORLD, WORLD),
                Case("correctness", f"rows/{DP} x vocab/{tp} (groups)",
                     groups_variant(mesh_shard(MESH_2D, "dp", R), mesh_shard(MESH_2D, "tp", V),
                                    process_group=MESH_2D.get_group("tp"), segment_group=MESH_2D.get_group("dp")),
                     R // DP, tp)]
    if "dtensor" in RUN_PARTS:
        out += [Case("dtensor", f"Shard(-1), mesh ({WORLD},)", dtensor_variant(MESH_1D, R, V, rows_over=None),
                     R, WORLD),
                Case("dtensor", f"Shard(0), Shard(-1), mesh ({DP}, {tp})",
                     dtensor_variant(MESH_2D, R, V, rows_over="dp"), R // DP, tp)]
    return out


DTENSOR = {"status": "untried", "message": ""}   # "supported" once a DTensor call returned


def check_case(case: Case, name: str, head: lcg.HeadLoss, x, y, kw, ref, ref_grad, shape: str) -> None:
    if case.part not in RUN_PARTS or case.part == "dtensor" and DTENSOR["status"] == "unsupported":
        return
    try:
        with case.path():
            out, grads = case.run(head, x, y, kw, ref_grad)
    except Exception as e:   # (raised alike on every rank: the inputs are alike)
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if case.part == "dtensor" and DTENSOR["status"] == "untried":
            DTENSOR.update(status="unsupported", message=msg)
            if RANK == 0:
                print(f"DTensor: not supported by this build ({msg})", flush=True)
            RECORD["dtensor_status"] = DTENSOR
            return
        add_check(case.part, name, case.label, shape, {"error": math.inf}, TOL, error=msg)
        return
    if case.part == "dtensor":
        DTENSOR["status"] = "supported"
        RECORD["dtensor_status"] = DTENSOR
    errs = compare(out, ref, grads)
    extra = {}
    if case.count:
        with case.path():
            extra["collectives"] = counted(lambda: case.run(head, x, y, kw, ref_grad), case.rows,
                                           len(head.kernel.COLUMNS), case.ranks)
    add_check(case.part, name, case.label, shape, errs, TOL, **extra)


def check_heads(R: int, V: int) -> None:
    shape = f"{R}x{V}"
    for name, (head, needs) in HEADS.items():
        if not chosen(name, ONLY_HEADS):
            continue
        log(f"{name}, {shape}: the unsharded call")
        x, y, kw = make_inputs(R, V, V, needs, seed=0)
        ref, ref_grad = reference(head, x, y, kw)
        for case in cases(R, V, needs):
            log(f"{name}, {shape}: {case.part}, {case.label}")
            check_case(case, name, head, x, y, kw, ref, ref_grad, shape)
        del x, y, kw, ref, ref_grad
        free()


def check_linear(V: int) -> None:
    """``head.linear`` with this rank's rows of the weight (a plain tensor, and a ``Shard(0)`` DTensor
    over the 1-D mesh), in 4 chunks (a launch and an exchange each): loss, entropy and both
    gradients against the unsharded call."""
    N, H = LINEAR_ROWS, HIDDEN
    g = torch.Generator(device=DEVICE).manual_seed(1)
    hidden = (torch.randn(N, H, device=DEVICE, generator=g) * 0.5).to(DTYPE)
    weight = (torch.randn(V, H, device=DEVICE, generator=g) * H ** -0.5).to(DTYPE)
    y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    y[::7] = -100
    chunk = max(1, N // 4)
    hf, wf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = LINEAR_HEAD.linear(hf, wf, y, chunk_rows=chunk)
    out.loss.backward()
    ref = {"loss": out.loss.detach(), **out.terms, **out.metrics}
    cols = shard_of(V, WORLD, RANK)

    def run(dtensor: bool):
        hs = hidden.clone().requires_grad_()
        ws = weight[cols].clone()
        ws = (DTensor.from_local(ws, MESH_1D, [Shard(0)], run_check=False) if dtensor else ws).requires_grad_()
        out = LINEAR_HEAD.linear(hs, ws, y, chunk_rows=chunk, **({} if dtensor else {"process_group": GROUP}))
        out.loss.backward()
        return out, [("hidden_grad_err", hs.grad, hf.grad), ("weight_grad_err", ws.grad, wf.grad[cols])]

    shape = f"{N}x{H}x{V}, {N // chunk} chunks"
    variants = [Case("correctness", f"weight vocab/{WORLD}", lambda *a: run(False), N, WORLD)]
    if "dtensor" in RUN_PARTS:
        variants.append(Case("dtensor", f"weight Shard(0), mesh ({WORLD},)", lambda *a: run(True), N, WORLD))
    for case in variants:
        log(f"{LINEAR_NAME}: {case.part}, {case.label}")
        check_case(case, LINEAR_NAME, LINEAR_HEAD, None, y, {}, ref, None, shape)


def check_back_to_back(R: int, V: int) -> None:
    """Calls queued without a sync, of changing row counts, some with every row ignored (no row then
    touches the exchange), with rank 1 held back now and then so rank 0 runs ahead: each equals the
    unsharded call."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    x, y, _ = make_inputs(R, V, V, (), seed=2)
    cols = shard_of(V, WORLD, RANK)
    sizes = [R // 4, R // 4, R // 8, R // 8, R // 8, 3 * R // 8]
    calls = list(zip(sizes, [False, True, False, True, True, False])) * B2B_REPEATS
    got, labels = [], []
    for i, (n, ignored) in enumerate(calls):
        yi = torch.full_like(y[:n], -100) if ignored else y[:n]
        if RANK == 1 and i % 3 == 0 and CUDA:
            torch.cuda._sleep(5_000_000)     # a few ms of GPU time: rank 0 gets calls ahead
        out = head(x[:n, cols], yi, process_group=GROUP)
        got.append(torch.stack([out.loss, out.metrics["entropy"]]))
        labels.append(yi)
    worst = 0.0
    for (n, _), yi, g in zip(calls, labels, got):
        ref = head(x[:n], yi)
        want = torch.stack([ref.loss, ref.metrics["entropy"]])
        worst = max(worst, ((g - want).abs() / want.abs().clamp_min(1.0)).max().item())
    add_check("correctness", "CE+entropy", f"back-to-back, {len(calls)} calls", f"{R}x{V}",
              worst_over_ranks({"value_err": worst}), TOL)


# ---- FSDP2 --------------------------------------------------------------------------------------
FSDP_ORDERS = ("fully_shard, then apply_losscodegen", "apply_losscodegen, then fully_shard")


def fsdp_run(order: str) -> dict[str, float]:
    """A few SGD steps of a Llama whose decoder layers, lm_head (its own unit) and root are FSDP2
    units, patched by ``apply_losscodegen``, each rank on its own batch; beside it the unsharded,
    unpatched model on every rank's batch in turn (its gradients averaged as FSDP averages them).
    Errors: the worst step's mean loss, and lm_head's weight after the steps (relative to its change)."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from losscodegen.integrations.transformers import apply_losscodegen
    L, H, V, S = (LLAMA[k] for k in ("layers", "hidden", "vocab", "seq"))
    heads = max(1, H // 128)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=S,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEVICE)
    ref = copy.deepcopy(model)
    w0 = ref.lm_head.weight.detach().clone()

    def shard(m):
        for layer in m.model.layers:
            fully_shard(layer, mesh=MESH_1D)
        fully_shard(m.lm_head, mesh=MESH_1D)
        fully_shard(m, mesh=MESH_1D)
    if order == FSDP_ORDERS[0]:
        shard(model)
        apply_losscodegen(model)
    else:
        apply_losscodegen(model)
        shard(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    g = torch.Generator(device=DEVICE).manual_seed(1)
    loss_err = 0.0
    for _ in range(FSDP_STEPS):
        ids = torch.randint(0, V, (WORLD, S), device=DEVICE, generator=g)   # the global batch
        loss = model(input_ids=ids[RANK:RANK + 1], labels=ids[RANK:RANK + 1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = 0.0
        for i in range(WORLD):
            li = ref(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss / WORLD
            li.backward()
            ref_loss += li.detach()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_err = max(loss_err, rel(mean / WORLD, ref_loss))
    w = model.lm_head.weight
    w = w.full_tensor() if isinstance(w, DTensor) else w
    w_err = ((w.detach() - ref.lm_head.weight.detach()).norm() / (ref.lm_head.weight.detach() - w0).norm()).item()
    return worst_over_ranks({"loss_err": loss_err, "weight_err": w_err})


def check_fsdp() -> None:
    shape = "Llama {layers} layers, hidden {hidden}, vocab {vocab}, seq {seq}, fp32".format(**LLAMA)
    tol = dict(value=FSDP_TOL["loss"], grad=FSDP_TOL["weight"])
    raised = {}
    for order in FSDP_ORDERS:
        log(f"FSDP2: {order}")
        try:
            errs = fsdp_run(order)
        except Exception as e:   # (alike on every rank)
            raised[order] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            continue
        add_check("fsdp", "apply_losscodegen CE", order, shape, errs, tol, steps=FSDP_STEPS)
    if len(raised) == len(FSDP_ORDERS):
        if RANK == 0:
            print(f"FSDP2: not supported by this build ({next(iter(raised.values()))})", flush=True)
        RECORD["fsdp_status"] = dict(status="unsupported", message=raised)
    else:
        for order, msg in raised.items():
            add_check("fsdp", "apply_losscodegen CE", order, shape, {"error": math.inf}, tol, error=msg)
    free()


# ---- scaling ------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> float:
    """The median of ITERS calls, in ms, after WARMUP; the same counts on every rank."""
    for _ in range(WARMUP):
        fn()
    dist.barrier()
    if not CUDA:
        times = []
        for _ in range(ITERS):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[ITERS // 2]
    torch.cuda.synchronize()
    ends = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
    for a, b in ends:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ends)[ITERS // 2]


def logits_step(head, rows: int, V: int, width: int, needs, **groups) -> Callable[[], None]:
    """The default call (forward + backward) on [rows, width] logits: the unsharded call where
    ``width == V``, else this rank's shard (its logits from a seed of its own)."""
    x, y, kw = make_inputs(rows, V, width, needs, seed=3, logit_seed=3 + (RANK + 1) * (width != V))
    x.requires_grad_()

    def step():
        x.grad = None
        head(x, y, **groups, **kw).loss.backward()
    return step


def linear_step(rows: int, V: int, width: int, **groups) -> Callable[[], None]:
    g = torch.Generator(device=DEVICE).manual_seed(4 + RANK)
    hidden = (torch.randn(rows, HIDDEN, device=DEVICE, generator=g) * 0.5).to(DTYPE).requires_grad_()
    weight = (torch.randn(width, HIDDEN, device=DEVICE, generator=g) * HIDDEN ** -0.5).to(DTYPE).requires_grad_()
    y = torch.randint(0, V, (rows,), device=DEVICE, generator=g)

    def step():
        hidden.grad = weight.grad = None
        LINEAR_HEAD.linear(hidden, weight, y, **groups).loss.backward()
    return step


def every_rank(value: float) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    out = torch.empty(WORLD, dtype=torch.float64, device=DEVICE)
    dist.all_gather_into_tensor(out, t)
    return out.tolist()


def scale_head(name: str, R: int, V: int) -> dict[str, Any]:
    """One head's times: one GPU (R x V, on every rank at once; the median over ranks) and, for each
    work and path, the sharded call (the slowest rank), in ROUNDS rounds alternating between them
    after one not kept; each time the median of its rounds."""
    width = V // WORLD
    works = dict(zip(WORKS, (R, WORLD * R)))
    if name == LINEAR_NAME:
        columns = len(LINEAR_HEAD.kernel.COLUMNS)
        single = linear_step(R, V, V)
        sharded = {w: linear_step(rows, V, width, process_group=GROUP) for w, rows in works.items()}
    else:
        head, needs = HEADS[name]
        columns = len(head.kernel.COLUMNS)
        single = logits_step(head, R, V, V, needs)
        sharded = {w: logits_step(head, rows, V, width, needs, process_group=GROUP) for w, rows in works.items()}
    kept: dict[str, list[float]] = {}
    for i in range(ROUNDS + 1):
        times = {"1 GPU": timed(single)}
        for w, step in sharded.items():
            for path, ctx in PATHS.items():
                with ctx():
                    times[f"{w}/{path}"] = timed(step)
        if i or not ROUNDS:
            for k, v in times.items():
                kept.setdefault(k, []).append(v)
    med = {k: sorted(v)[len(v) // 2] for k, v in kept.items()}
    one = every_rank(med["1 GPU"])
    rec: dict[str, Any] = dict(head=name, shape=f"{R}x{V}", world=WORLD, ms_1gpu=sorted(one)[WORLD // 2],
                               ms_1gpu_ranks=one, rounds_1gpu_rank0=kept["1 GPU"])
    for w, rows in works.items():
        ms = {path: max(every_rank(med[f"{w}/{path}"])) for path in PATHS}
        ideal = rec["ms_1gpu"] * rows / (R * WORLD)   # one GPU's time for this rank's share of the work
        rec[w] = dict(rows=rows, ms=ms, ideal_ms=ideal,
                      efficiency={p: ideal / t for p, t in ms.items()},
                      comm_share={p: 1 - ms["no-op"] / ms[p] for p in ("default", "all-gather")},
                      rounds_rank0={p: kept[f"{w}/{p}"] for p in PATHS})
    rec["collectives"] = counted(sharded["same global work"], R, columns, WORLD)
    return rec


def scaling() -> None:
    R, V = SCALING_SHAPE
    for name in [n for n in (*HEADS, LINEAR_NAME) if chosen(n, SCALING_HEADS)]:
        log(f"scaling: {name}, {R}x{V}")
        RECORD.setdefault("scaling", []).append(scale_head(name, R, V))
        free()
        write_record()   # (after each head: the scaling part is the longest)


# ---- record and table ---------------------------------------------------------------------------
def free() -> None:
    if CUDA:
        torch.cuda.empty_cache()


def device_name() -> str:
    return torch.cuda.get_device_name(DEVICE).replace(" ", "-") if CUDA else "cpu"


def commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    return None


def record_path() -> str:
    """``<device>-multigpu-<N>.json``; a run of some parts only: ``...-<N>-<part>+<part>.json``."""
    parts = "" if set(RUN_PARTS) == set(PARTS) else "-" + "+".join(RUN_PARTS)
    return os.path.join(ARGS.out, f"{device_name()}-multigpu-{WORLD}{parts}.json")


def write_record() -> None:
    if RANK == 0:
        os.makedirs(ARGS.out, exist_ok=True)
        with open(record_path(), "w") as f:
            json.dump(RECORD, f, indent=1, default=str)


def goals() -> list[str]:
    """The issue's goals, from the scaling records: each line says met or not, with the numbers."""
    recs = RECORD.get("scaling", [])
    if not recs:
        return []
    eff = {r["head"]: min(r[w]["efficiency"]["no-op"] for w in WORKS)
           for r in recs}
    # rounds and bytes: the logits heads' (head.linear adds dL/dhidden's all-reduce, which no
    # exchange of row stats replaces; its counts are in the table)
    rounds = {r["head"]: r["collectives"]["rounds"] for r in recs if r["head"] != LINEAR_NAME}
    wire = {r["head"]: r["collectives"]["wire_over_ideal"] for r in recs if r["head"] != LINEAR_NAME}

    def line(goal, ok, values, fmt):
        return f"goal {goal}: {'met' if ok else 'NOT met'} ({', '.join(f'{k} {fmt(v)}' for k, v in values.items())})"
    return [line(">= 0.9 parallel efficiency on the shard-local work (no-op path, worst of both works)",
                 min(eff.values()) >= 0.9, eff, lambda v: f"{v:.2f}"),
            line("one collective round per call (default path, logits heads)", max(rounds.values(), default=0) <= 1,
                 rounds, str),
            line("no more on the wire than the packed row stats' all-reduce (default path, logits heads)",
                 all(v is not None and v <= 1 for v in wire.values()), wire,
                 lambda v: "-" if v is None else f"{v:.2f}x")]


def table() -> str:
    lines = [f"{WORLD} ranks over {'gloo (CPU)' if not CUDA else 'NCCL'}, {str(DTYPE)[6:]}, device "
             f"{device_name()}, record {record_path()}"]
    for part in ("correctness", "dtensor", "fsdp"):
        if part == "dtensor" and DTENSOR["status"] == "unsupported":
            lines.append(f"dtensor: not supported by this build ({DTENSOR['message']})")
        if part == "fsdp" and "fsdp_status" in RECORD:
            lines.append(f"fsdp: not supported by this build ({next(iter(RECORD['fsdp_status']['message'].values()))})")
        if not RECORD.get(part):
            continue
        lines.append(f"{part}:\n  {'head':20s} {'variant':38s} {'shape':22s} {'errors (worst rank)':44s} status")
        for r in RECORD[part]:
            errs = " ".join(f"{k.removesuffix('_err')} {r[k]:.1e}" for k in r
                            if k.endswith("_err") or k == "error")
            lines.append(f"  {r['head']:20s} {r['variant']:38s} {r['shape']:22s} {errs:44s} {r['status']}"
                         + (f" ({r['error']})" if "error" in r else ""))
    if RECORD.get("scaling"):
        lines.append(f"scaling, ms per default call (fwd + bwd), {WORLD} ranks; eff = one GPU's time for the "
                     "rank's share / the time; comm = 1 - no-op / default")
        lines.append(f"  {'head':20s} {'1 GPU':>7s} | {'global work: default':>20s} {'all-gath':>8s} {'no-op':>7s} "
                     f"{'eff':>5s} {'eff no-op':>9s} {'comm':>5s} | {'per-rank work: default':>22s} {'no-op':>7s} "
                     f"{'eff':>5s} {'eff no-op':>9s} | rounds wire/ideal")
        for r in RECORD["scaling"]:
            g, w, c = r["same global work"], r["same work per rank"], r["collectives"]
            lines.append(
                f"  {r['head']:20s} {r['ms_1gpu']:7.3f} | {g['ms']['default']:20.3f} {g['ms']['all-gather']:8.3f} "
                f"{g['ms']['no-op']:7.3f} {g['efficiency']['default']:5.2f} {g['efficiency']['no-op']:9.2f} "
                f"{g['comm_share']['default']:5.2f} | {w['ms']['default']:22.3f} {w['ms']['no-op']:7.3f} "
                f"{w['efficiency']['default']:5.2f} {w['efficiency']['no-op']:9.2f} | {c['rounds']:6d} "
                + ("-" if c["wire_over_ideal"] is None else f"{c['wire_over_ideal']:.2f}x"))
    return "\n".join(lines + goals())


def main() -> int:
    import importlib.metadata as md
    for heads in (ONLY_HEADS, SCALING_HEADS):
        unknown = set(heads.split(",")) - {*HEADS, LINEAR_NAME, "all"}
        if unknown:
            raise SystemExit(f"MGPU_HEADS / MGPU_SCALING_HEADS: unknown {sorted(unknown)}, of {[*HEADS, LINEAR_NAME]}")
    RECORD["meta"] = dict(
        world=WORLD, backend=dist.get_backend(), device=device_name(), dtype=str(DTYPE), shapes=SHAPES,
        scaling_shape=SCALING_SHAPE, dp_x_tp=[DP, WORLD // DP], iters=ITERS, warmup=WARMUP, rounds=ROUNDS,
        in_kernel_exchange=exchange_in_kernel(GROUP), commit=commit(),
        codegen=lcg.load.codegen_version(), torch=torch.__version__,
        triton=md.version("triton"), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        env={k: os.environ.get(k) for k in (*MULTICAST_OFF, "TRITON_INTERPRET", "LOSSCODEGEN_EXCHANGE")})
    # the first shape's checks, FSDP2 and the scaling first, the other shapes' checks last: a run
    # cut short by its time limit loses the least new of its work (the record is written after each)
    checks = "correctness" in RUN_PARTS or "dtensor" in RUN_PARTS
    steps: list[Callable[[], None]] = []
    if checks:
        steps.append(lambda: check_heads(*SHAPES[0]))
        if chosen(LINEAR_NAME, ONLY_HEADS):
            steps.append(lambda: check_linear(SHAPES[0][1]))
        if "correctness" in RUN_PARTS and B2B_REPEATS:
            steps.append(lambda: check_back_to_back(*SHAPES[0]))
    if "fsdp" in RUN_PARTS:
        steps.append(check_fsdp)
    if "scaling" in RUN_PARTS:
        steps.append(scaling)
    if checks:
        steps += [lambda R=R, V=V: check_heads(R, V) for R, V in SHAPES[1:]]
    for step in steps:
        step()
        write_record()
    failed = [f"{c['head']}, {c['variant']}, {c['shape']}" for part in ("correctness", "dtensor", "fsdp")
              for c in RECORD.get(part, []) if c["status"] != "pass"]
    RECORD["failed"] = failed
    write_record()
    if RANK == 0:
        print(table(), flush=True)
        print(f"{len(failed)} checks failed" + (": " + "; ".join(failed) if failed else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
