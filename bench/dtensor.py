"""The DTensor path against the ``process_group=`` path on one GPU (not collected by pytest):
`torchrun --nproc_per_node 1 bench/dtensor.py`.

A one-rank NCCL group, so that both paths run the same kernels and collectives and the difference is
what the DTensor path adds (its layout checks, ``to_local``/``from_local``, the wrapped loss): the
default call (forward + backward) on vocab-sharded logits, ``Shard(-1)`` DTensor against the local
tensor with ``process_group=``; the same for ``head.linear`` with a ``Shard(0)`` weight; and rows
sharded (``Shard(0)``: one all-reduce of the valid-row count and one of the packed values, over a
one-rank group here), against the plain call without a group (the kernel it runs). Each the
median of CUDA-event times over ``ITERS`` calls, in 3 rounds that alternate between the paths
(after one round not kept), at a large shape (GPU time) and a small one (where host time shows).
GPU_DT_ROWS / GPU_DT_VOCAB / GPU_DT_HIDDEN set the large shape (default 8192 x 128256, hidden 4096)."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import losscodegen as lcg

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if world != 1:
    raise SystemExit("bench/dtensor.py compares paths on one GPU: torchrun --nproc_per_node 1")
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=180))
mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
group = mesh.get_group(0)
ITERS, ROUNDS = 20, 3


def timed(fn):
    """Median milliseconds of ``fn`` (CUDA events around each call)."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in events)[ITERS // 2]


def step(head, make_logits, y, **kw):
    """One default call, forward and backward, on fresh leaf logits (their .grad dropped)."""
    x = make_logits()

    def run():
        x.grad = None
        head(x, y, **kw).loss.backward()
    return run


def linear_step(head, h, w, y, **kw):
    def run():
        h.grad = w.grad = None
        head.linear(h, w, y, **kw).loss.backward()
    return run


def paths(R, V, H):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    y[::7] = -100
    hidden = (torch.randn(R, H, device="cuda", generator=g)).to(torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4), metrics=(lcg.Entropy(),))
    return {
        "logits, process_group=": step(head, lambda: x.clone().requires_grad_(), y, process_group=group),
        "logits, DTensor Shard(-1)": step(head, lambda: distribute_tensor(x, mesh, [Shard(1)]).requires_grad_(), y),
        "logits, plain (no group)": step(head, lambda: x.clone().requires_grad_(), y),
        "logits, DTensor Shard(0) (rows)": step(head, lambda: distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(),
                                                y),
        "linear, process_group=": linear_step(head, hidden.clone().requires_grad_(), weight.clone().requires_grad_(),
                                              y, process_group=group),
        "linear, DTensor weight Shard(0)": linear_step(
            head, hidden.clone().requires_grad_(), distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_(), y),
    }


def main():
    R, V = int(os.environ.get("GPU_DT_ROWS", "8192")), int(os.environ.get("GPU_DT_VOCAB", "128256"))
    H = int(os.environ.get("GPU_DT_HIDDEN", "4096"))
    device = torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, bf16, CE + z-loss + entropy metric, fwd + bwd, median ms")
    print("| shape | path | ms | vs its baseline |\n|---|---|---|---|")
    for shape in ((R, V, H), (512, 4096, 1024)):
        fns = paths(*shape)
        times = {name: [] for name in fns}
        for round_ in range(ROUNDS + 1):
            for name, fn in fns.items():
                t = timed(fn)
                if round_:
                    times[name].append(t)
        med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        for name, t in med.items():
            # (rows sharded run the kernel of unsharded logits: against the plain call)
            base = med["linear, process_group=" if name.startswith("linear") else
                       "logits, plain (no group)" if "Shard(0)" in name else "logits, process_group="]
            print(f"| {shape[0]} x {shape[1]} (H {shape[2]}) | {name} | {t:.3f} | {t / base:.3f}x |")
        del fns
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
