"""Issue 35: which tile-table entries gain from a register cap (``tiles.Config.maxnreg``). For a head of
each plan state the H200 table holds, at 8192 x 128256 and 4096 x 262144 bf16: the table's tile
without a cap, then capped at the next occupancy steps below the registers ptxas chose (the most
registers a thread may have for one more program of that many warps on a multiprocessor), forward +
backward timed in one process, rounds interleaved, the best median of each.

    python bench/reg_caps.py [--out rows.jsonl] [--rounds N] [HEAD ...]     # on one CUDA GPU

Imports only torch, triton, losscodegen and the standard library (a measurement, not part of the package).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

import losscodegen as lcg
from losscodegen.backends.triton import tiles
from losscodegen.backends.triton.tune import compiled_registers, register_caps
from losscodegen.testing import random_inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_on_chip import write_records  # noqa: E402

HEADS = {
    "CE": lambda: lcg.HeadLoss(lcg.CrossEntropy()),
    "GRPO+entropy+clip": lambda: lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())),
    "CE+z+entropy+accuracy": lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(),
                                                  metrics=(lcg.Entropy(), lcg.TokenAccuracy())),
    "FKL": lambda: lcg.HeadLoss(lcg.ForwardKL()),
    "CE+z+FKL+entropy": lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(),
                                             metrics=(lcg.Entropy(),)),
    "JSD": lambda: lcg.HeadLoss(lcg.JSD()),
}
SHAPES = [(8192, 128256), (4096, 262144)]


def main(out_path: str | None, only: list[str], rounds: int) -> None:
    device = torch.device("cuda")
    records = []
    known: dict = {}     # (head, config) -> its binaries' registers, from the shape that compiled them
    for name, make in HEADS.items():
        if only and name not in only:
            continue
        for R, V in SHAPES:
            head = make()
            logits, labels, kw = random_inputs(head, R, V, torch.bfloat16, device)
            x = logits.requires_grad_()

            def step():
                x.grad = None
                head(x, labels, **kw).loss.backward()

            def compile_(config: tiles.Config) -> list[int]:
                """The registers of the binaries ``config`` launches (compiled now, or at an earlier shape)."""
                seen = compiled_registers(head, device)
                head.tile_override = config
                step()
                torch.cuda.synchronize()
                got = [n for k, n in compiled_registers(head, device).items() if k not in seen]
                if got:
                    known[(name, config)] = got
                return known.get((name, config), [])
            table = tiles.choose(head, head.kernel, V, torch.bfloat16, device)
            bare = tiles.Config(table.block_v, table.num_warps, table.split)
            regs = compile_(bare)
            configs = [bare] + [tiles.Config(bare.block_v, bare.num_warps, bare.split, c)
                                for c in register_caps(bare.launch(V, 2)["num_warps"], max(regs, default=0))]
            info = {config: compile_(config) for config in configs}
            best = {}
            for _ in range(rounds):
                for config in configs:
                    head.tile_override = config
                    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
                    best[config] = min(ms, best.get(config, float("inf")))
            head.tile_override = None
            for config in configs:
                rec = dict(head=name, state="/".join(map(str, head.kernel.SPEC.state)), shape=f"{R}x{V}",
                           config=config.entry(), table=config == table, ms=round(best[config], 4),
                           kernels=info[config], gain=round(best[bare] / best[config], 4))
                records.append(rec)
                print(json.dumps(rec), flush=True)
            del x, logits, labels, kw, step
            torch.cuda.empty_cache()
    print(f"\n{'head':24} {'state':8} {'shape':13} {'config':26} {'table':5} {'ms':>8} {'uncapped/ms':>11}  registers")
    for r in records:
        print(f"{r['head']:24} {r['state']:8} {r['shape']:13} {str(r['config']):26} {str(r['table']):5} "
              f"{r['ms']:8.4f} {r['gain']:11.3f}  {r['kernels']}")
    if out_path:
        write_records(out_path, records)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="also write every record as JSON lines here")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds (default: %(default)s)")
    p.add_argument("heads", nargs="*", help=f"only these heads, of {', '.join(HEADS)}")
    a = p.parse_args()
    main(a.out, a.heads, a.rounds)
