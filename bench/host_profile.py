"""Where a small head's call spends its host time: CE at 4096 x 32000 bf16 (forward + backward),
whose GPU work (~0.1 ms) is shorter than its host work. Prints, for whatever losscodegen is
importable: the median step (do_bench), the host time to enqueue one step (no sync inside a round of
calls), and cProfile's top functions by own time over 300 steps; and, beside it, two floors measured
the same way: an autograd Function that launches one empty kernel in forward and one in backward
(what any fused loss pays torch and Triton), and torch's own ``F.cross_entropy`` on the same inputs.
Run it against two installs (PYTHONPATH) in one command to compare them:

    PYTHONPATH=.base python bench/host_profile.py base; PYTHONPATH=. python bench/host_profile.py new
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import LOGIT_WORKLOADS, logit_step  # noqa: E402


@triton.jit
def _empty(x_ptr):
    pass


class _OneLaunchEachWay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _empty[(1,)](x)
        ctx.grad = torch.empty_like(x)
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        _empty[(1,)](ctx.grad)
        return ctx.grad


def enqueue_us(step) -> list[float]:
    """The host's time to enqueue one ``step``, µs, in 15 rounds of 50 calls (no sync inside a round)."""
    for _ in range(10):
        step()
    rounds = []
    for _ in range(15):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            step()
        rounds.append((time.perf_counter() - t) / 50 * 1e6)
        torch.cuda.synchronize()
    return rounds


def floors(R: int, V: int) -> None:
    x = torch.randn(R, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (R,), device="cuda")

    def empty_step():
        x.grad = None
        _OneLaunchEachWay.apply(x).backward()

    def torch_step():
        x.grad = None
        torch.nn.functional.cross_entropy(x, y).backward()
    for name, step in (("one empty launch each way", empty_step), ("torch F.cross_entropy", torch_step)):
        rounds = enqueue_us(step)
        print(f"== floor {name} {R}x{V}: host enqueue best {min(rounds):.1f} us, "
              f"median {statistics.median(rounds):.1f} us")


def main(label: str, workload: str = "CE", R: int = 4096, V: int = 32000) -> None:
    make, needs, _ = LOGIT_WORKLOADS[workload]
    _, step = logit_step(make, needs, R, V)
    gpu_ms = triton.testing.do_bench(step, warmup=25, rep=400, return_mode="median")
    rounds = enqueue_us(step)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(300):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    print(f"== {label} {workload} {R}x{V}: step {gpu_ms * 1e3:.1f} us, host enqueue best "
          f"{min(rounds):.1f} us, median {statistics.median(rounds):.1f} us")
    for ln in lines[-23:]:
        print("   ", ln.replace(os.getcwd(), ".")[:150])
    if label == "new":
        floors(R, V)


if __name__ == "__main__":
    main(*sys.argv[1:2], *[a if not a.isdigit() else int(a) for a in sys.argv[2:]])
