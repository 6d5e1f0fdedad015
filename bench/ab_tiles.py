"""The shipped tile table against a new one (``python -m losscodegen tune --out FILE``), in one process:
each benchmark head (and the forward KL, and CE + z + entropy + accuracy) at 8192 x 128256 and
4096 x 262144 bf16, the benchmark's inputs (bench/bench.py), eager forward + backward, the table's
configuration and the new file's for the head's plan state, interleaved over 3 rounds, the best median.

    python bench/ab_tiles.py NEW.json > rows.jsonl      # on one CUDA GPU

Imports only torch, triton, losscodegen and the standard library (a measurement, not part of the package).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

import losscodegen as lcg
from losscodegen.backends.triton import tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import LOGIT_WORKLOADS, logit_step  # noqa: E402

WORKLOADS = {**LOGIT_WORKLOADS,
             "FKL": (lambda: lcg.HeadLoss(lcg.ForwardKL()), {"teacher"}, None),
             "CE+z+entropy+accuracy": (lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(),
                                                            metrics=(lcg.Entropy(), lcg.TokenAccuracy())), set(), None)}


def main(new_path: str) -> None:
    new = {k: tiles.Config(*v) for k, v in json.load(open(new_path)).items()}
    device = torch.device("cuda")
    for name, (make, needs, _) in WORKLOADS.items():
        for R, V in ((8192, 128256), (4096, 262144)):
            head, step = logit_step(make, needs, R, V)
            old = tiles.choose(head, head.kernel, V, torch.bfloat16, device)
            cand = new.get(tiles.key(device, head.kernel.SPEC, V, 2))
            configs = [old] + ([cand] if cand and cand != old else [])
            best = {}
            for config in configs:       # compiled before the timing
                head.tile_override = config
                step()
            for _ in range(3):
                for config in configs:
                    head.tile_override = config
                    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
                    best[config] = min(best.get(config, float("inf")), ms)
            head.tile_override = None
            print(json.dumps(dict(workload=name, shape=f"{R}x{V}", old=old.entry(), old_ms=round(best[old], 4),
                                  new=cand.entry() if cand else None,
                                  new_ms=round(best[cand], 4) if cand else None)), flush=True)
            del step, head
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
