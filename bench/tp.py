"""Vocab-parallel on GPUs (not collected by pytest): `torchrun --nproc_per_node N bench/tp.py`.
Each rank's loss, terms, metrics and gradient shard vs the unsharded call; then the default call's
time (forward + backward) on N ranks beside the unsharded call on one GPU, with the packed stats
exchanged in-kernel (the default where the GPUs map each other's memory) and by an all-gather: the
median of 3 rounds that alternate between the three, after one round not kept.

Timings use a fixed number of iterations on every rank: a timer that picks its own repeat count
(triton's do_bench) can pick a different one per rank, and the ranks then wait forever on each
other's collectives. GPU_TP_ROWS / GPU_TP_VOCAB set the shape (default 8192 x 128256)."""
import contextlib
import datetime
import faulthandler
import json
import os
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

import losscodegen as lcg
from losscodegen import collectives

faulthandler.dump_traceback_later(int(os.environ.get("GPU_TP_WATCHDOG", "500")), exit=True)
t0 = time.time()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank),
                        timeout=datetime.timedelta(seconds=180))


def log(msg):
    print(f"[rank {rank} {time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def timed(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    ends = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)]
    for a, b in ends:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ends)[iters // 2]


ROUNDS = 3
R, V = int(os.environ.get("GPU_TP_ROWS", "8192")), int(os.environ.get("GPU_TP_VOCAB", "128256"))
g = torch.Generator(device="cuda").manual_seed(0)
x = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
t = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
y = torch.randint(0, V, (R,), device="cuda", generator=g)
y[::7] = -100
lp = torch.log_softmax(x.float(), -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
policy = dict(old_logprobs=lp + 0.1 * torch.randn(R, device="cuda", generator=g),
              advantages=torch.randn(R, device="cuda", generator=g))
cols = slice(rank * V // world, (rank + 1) * V // world)
heads = {"CE": (lcg.HeadLoss(lcg.CrossEntropy()), {}),
         "CE+z+entropy+acc": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                           metrics=(lcg.Entropy(), lcg.TokenAccuracy())), {}),
         "CE+z+0.5FKL+entropy": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4), lcg.ForwardKL(weight=0.5),
                                              metrics=(lcg.Entropy(),)), {"teacher"}),
         "JSD": (lcg.HeadLoss(lcg.JSD()), {"teacher"}),
         "GRPO+entropy+clip": (lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())), policy),
         "GSPO": (lcg.HeadLoss(lcg.GSPO()), dict(policy, segment_ids=torch.arange(R, device="cuda") // 256,
                                                 num_segments=R // 256))}
rows_out, records = [], []
for name, (head, needs) in heads.items():
    full_kw = {"teacher_logits": t} if "teacher" in needs else {}
    shard_kw = {"teacher_logits": t[:, cols].contiguous()} if "teacher" in needs else {}
    if isinstance(needs, dict):
        full_kw.update(needs)
        shard_kw.update(needs)
    log(f"{name}: unsharded reference call (compiles on first use)")
    xf = x.clone().requires_grad_()
    ref = head(xf, y, **full_kw)
    ref.loss.backward()
    refs = {**ref.terms, **ref.metrics}
    xs = x[:, cols].contiguous().requires_grad_()

    def sharded():
        xs.grad = None
        head(xs, y, process_group=dist.group.WORLD, **shard_kw).loss.backward()

    def single():
        xf.grad = None
        head(xf, y, **full_kw).loss.backward()
    paths = {"in-kernel": contextlib.nullcontext,
             # "all-gather": the stats exchanged between two launches, not in-kernel
             "all-gather": lambda: mock.patch.object(collectives, "exchange", lambda group, device: None)}
    errs = {}
    for path, exchange in paths.items():
        with exchange():
            log(f"{name}, {path}: sharded call")
            xs.grad = None
            out = head(xs, y, process_group=dist.group.WORLD, **shard_kw)
            out.loss.backward()
            torch.cuda.synchronize()
            verr = max(abs(v.item() - refs[k].item()) / max(1.0, abs(refs[k].item()))
                       for k, v in {**out.terms, **out.metrics}.items())
            gerr = ((xs.grad.float() - xf.grad[:, cols].float()).norm() / xf.grad[:, cols].float().norm()).item()
            lerr = abs(out.loss.item() - ref.loss.item()) / max(1.0, abs(ref.loss.item()))
            errs[path] = lerr, verr, gerr
    # rounds alternating between one GPU and both paths, each time the median of its rounds (one
    # GPU's time alone moved by up to 20% between the ranks of one run), after a round not kept (the
    # first calls of a process ran 10-20% slower on 4 ranks)
    log(f"{name}: timing")
    times = {"single": [], **{path: [] for path in paths}}
    for i in range(ROUNDS + 1):
        kept = times if i else {key: [] for key in times}
        kept["single"].append(timed(single))
        for path, exchange in paths.items():
            with exchange():
                kept[path].append(timed(sharded))
    ms_single = sorted(times["single"])[ROUNDS // 2]
    for path in paths:
        lerr, verr, gerr = errs[path]
        ms_sharded = sorted(times[path])[ROUNDS // 2]
        rows_out.append(f"{name:22s} {path:10s} {lerr:9.1e} {verr:9.1e} {gerr:9.1e} {ms_sharded:9.3f} "
                        f"{ms_single:9.3f} {ms_sharded / ms_single:7.2f}x")
        records.append(dict(head=name, exchange=path, world=world, shape=f"{R}x{V}", loss_err=lerr,
                            value_err=verr, grad_err=gerr, ms_sharded=ms_sharded, ms_single_gpu=ms_single,
                            rounds={k: v for k, v in times.items() if k in ("single", path)}))
    del xs, xf, out, ref
    torch.cuda.empty_cache()
def back_to_back():
    """Calls queued without a sync, of changing row counts, some with every row ignored (no row then
    touches the exchange), with rank 1 held back now and then so rank 0 runs ahead: each equals the
    unsharded call."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    calls = [(2048, False), (2048, True), (1000, False), (1000, True), (1000, True), (3000, False)] * 8
    got, labels = [], []
    for i, (n, ignored) in enumerate(calls):
        yi = torch.full_like(y[:n], -100) if ignored else y[:n]
        if rank == 1 and i % 3 == 0:
            torch.cuda._sleep(5_000_000)     # a few ms of GPU time: rank 0 gets calls ahead
        out = head(x[:n, cols], yi, process_group=dist.group.WORLD)
        got.append(torch.stack([out.loss, out.metrics["entropy"]]))
        labels.append(yi)
    torch.cuda.synchronize()
    worst = 0.0
    for (n, _), yi, g in zip(calls, labels, got):
        ref = head(x[:n], yi)
        want = torch.stack([ref.loss, ref.metrics["entropy"]])
        worst = max(worst, ((g - want).abs() / want.abs().clamp_min(1.0)).max().item())
    return worst


def fused_linear():
    """head.linear with this rank's rows of the weight, in chunks (a launch and an exchange each):
    loss, entropy and both gradients against the unsharded call."""
    N, H = 2048, 1024
    gl = torch.Generator(device="cuda").manual_seed(1)
    hidden = (torch.randn(N, H, device="cuda", generator=gl) * 0.5).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=gl) * H ** -0.5).bfloat16()
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    hs, ws = hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_()
    out = head.linear(hs, ws, y[:N], process_group=dist.group.WORLD, chunk_rows=512)
    out.loss.backward()
    hf, wf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = head.linear(hf, wf, y[:N], chunk_rows=512)
    ref.loss.backward()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    return max(rel(out.loss, ref.loss), rel(out.metrics["entropy"], ref.metrics["entropy"])), \
        rel(hs.grad, hf.grad), rel(ws.grad, wf.grad[cols])


log("fused linear")
linear_errs = fused_linear()
records.append(dict(check="fused linear, 4 chunks", value_err=linear_errs[0], hidden_grad_err=linear_errs[1],
                    weight_grad_err=linear_errs[2]))
log("back-to-back calls")
b2b_err = back_to_back()
records.append(dict(check="back-to-back calls", worst_rel_err=b2b_err))


if rank == 0:
    print(f"{world} ranks over NCCL, {R} x {V} bf16, default call, device {torch.cuda.get_device_name()}\n"
          f"{'head':22s} {'exchange':10s} {'loss err':>9s} {'value err':>9s} {'grad err':>9s} {'ms TP':>9s} "
          f"{'ms 1 GPU':>9s}"
          f" {'ratio':>8s}")
    print("\n".join(rows_out), flush=True)
    print(f"back-to-back calls (changing rows, all-ignored calls, rank 1 held back): worst relative error "
          f"{b2b_err:.1e}", flush=True)
    print("fused linear, 2048 x 1024 x V in 4 chunks: value err {:.1e}, dL/dhidden err {:.1e}, dL/dweight "
          "err {:.1e}".format(*linear_errs), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"tp{world}.json"), "w") as f:
            json.dump(records, f, indent=1)
dist.destroy_process_group()
faulthandler.cancel_dump_traceback_later()
