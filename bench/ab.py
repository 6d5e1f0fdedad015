"""Before/after: the benchmark heads' default call (forward + backward, bf16) timed with whatever
losscodegen is importable, one JSON line per (workload, shape). Run it alternately against two
installs (PYTHONPATH) in one command, so that both versions see the same machine:

    for i in 1 2; do PYTHONPATH=/tmp/base python bench/ab.py base; PYTHONPATH=/tmp/new python bench/ab.py new; done

(``python bench/ab.py LABEL WORKLOAD ...`` times only those workloads.)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import LOGIT_WORKLOADS, logit_step  # noqa: E402

SHAPES = {"CE": [(8192, 128256), (4096, 32000), (4096, 262144)], "JSD": [(8192, 128256), (4096, 262144)],
          "CE+z+0.5FKL+entropy": [(8192, 128256), (4096, 262144)]}


def main(label: str, only: list[str]) -> None:
    import losscodegen as lcg
    for name, (make, needs, _) in LOGIT_WORKLOADS.items():
        if only and name not in only:
            continue
        for R, V in SHAPES.get(name, [(8192, 128256)]):
            _, step = logit_step(make, needs, R, V)
            ms = triton.testing.do_bench(step, warmup=25, rep=400, return_mode="median")
            print(json.dumps(dict(version=label, lcg=os.path.dirname(lcg.__file__), workload=name,
                                  shape=f"{R}x{V}", ms=round(ms, 4))), flush=True)
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
