"""Issue 47 on a GPU: the row-slices kernel (templates/gluon/_slices.j2, each element read from HBM
once) checked against float64 and timed beside the default call and the copy rate, in one process.

    python bench/slices.py [--out DIR] [--ignored every7|random5] [--quick]

1. ``losscodegen.testing.assert_parity`` of each benchmark head with a ``Slices`` configuration (its
   regimes: saturated labels, one-hot teachers, ...; fp32 and bf16) at vocabularies of one program a
   row (500), and of 2, 8 and 16 (32000, 128256, 262144 at 16384 columns a slice);
2. forward + backward of the benchmark heads (bf16) at 8192 x 128256 and 4096 x 262144: the default
   call, then each Slices configuration, each as a fraction of the floor (one read of the logits and
   the teacher and one write of the gradient at the copy rate measured here).
The last lines are a table; everything goes to DIR/slices.json too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from losscodegen.backends.triton.tiles import Slices  # noqa: E402
from losscodegen.testing import assert_parity  # noqa: E402

CONFIGS = [Slices(16384, 8), Slices(8192, 8), Slices(8192, 4)]


def parity(quick: bool) -> list[dict]:
    out = []
    for name, (make, _, _) in bench.LOGIT_WORKLOADS.items():
        for V in ((500, 128256) if quick else (500, 32000, 128256, 262144)):
            head = make()
            head.tile_override = Slices(16384, 8)
            t0 = time.time()
            try:
                assert_parity(head, rows=64 if V > 100000 else 128, vocab=V, device="cuda")
                result = "pass"
            except Exception as e:   # reported with the rest: the table says which failed and why
                result = f"FAIL {type(e).__name__}: {str(e)[:300]}"
            out.append(dict(workload=name, V=V, parity=result, s=round(time.time() - t0, 1)))
            print(json.dumps(out[-1]), flush=True)
    return out


def timings(quick: bool, bandwidth: float, only: list[str]) -> list[dict]:
    out = []
    for name, (make, needs, _) in bench.LOGIT_WORKLOADS.items():
        if only and name not in only:
            continue
        for R, V in ((8192, 128256),) if quick else ((8192, 128256), (4096, 262144)):
            head, step = bench.logit_step(make, needs, R, V)
            floor = bench._floor(needs, R, V, bandwidth)
            for config in [None, *CONFIGS]:
                head.tile_override = config
                try:
                    ms = triton.testing.do_bench(step, warmup=25, rep=300, return_mode="median")
                except Exception as e:
                    print(f"  {name} {R}x{V} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    ms = float("nan")
                out.append(dict(workload=name, shape=f"{R}x{V}", impl=repr(config) if config else "default",
                                ms=round(ms, 4), of_floor=round(floor / ms, 3), ignored=bench.ignored))
                print(json.dumps(out[-1]), flush=True)
            del head, step
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ignored", default="every7", choices=sorted(bench.IGNORED))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--workloads", nargs="*", default=[], help="only these (bench.LOGIT_WORKLOADS' names)")
    args = ap.parse_args()
    bench.ignored = args.ignored
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    checks = [] if args.skip_parity else parity(args.quick)
    bench._warm_up()
    bandwidth = bench.copy_bandwidth()
    times = timings(args.quick, bandwidth, args.workloads)
    result = dict(device=torch.cuda.get_device_name(), triton=triton.__version__, copy_bandwidth=bandwidth,
                  parity=checks, times=times)
    with open(os.path.join(args.out, "slices.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"copy rate {bandwidth / 1e12:.2f} TB/s; parity: "
          f"{sum(c['parity'] == 'pass' for c in checks)}/{len(checks)} pass", flush=True)
    for c in checks:
        if c["parity"] != "pass":
            print(f"  {c['workload']} V={c['V']}: {c['parity'][:200]}")
    for t in times:
        print(f"{t['workload']:22s} {t['shape']:12s} {t['impl']:42s} {t['ms']:8.3f} ms  {t['of_floor']:.3f} of floor")


if __name__ == "__main__":
    main()
