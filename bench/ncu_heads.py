"""What limits each benchmark head's kernel, read from the GPU's hardware counters by Nsight Compute
(GPU; not collected by pytest). Each head's default call (forward + backward, 8192 x 128256 bf16) is
profiled once, after a warm-up, between cudaProfilerStart and cudaProfilerStop:

    ncu --profile-from-start off --clock-control none --kernel-name regex:head_loss \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \\
        --section WarpStateStats --section LaunchStats --section Occupancy \\
        --section MemoryWorkloadAnalysis -o DIR/heads python bench/ncu_heads.py > DIR/kernels.json
    ncu --import DIR/heads.ncu-rep --page raw --csv > DIR/raw.csv
    python bench/ncu_heads.py --table DIR/raw.csv DIR/kernels.json

The table gives, per head: the time; how busy the special-function unit (exp2, lg2, rcp: the XU pipe),
the FMA and ALU pipes and the issue slots were; the instructions per vocabulary element (warp
instructions times 32 over rows times vocabulary); DRAM traffic and bandwidth; the L2 hit rate; and the three most
frequent reasons a warp could not issue.
"""
from __future__ import annotations

import csv
import json
import os
import sys

ROWS, VOCAB = 8192, 128256

# (column, ncu raw metric); a metric this version of ncu does not report is left out of the table
METRICS = [
    ("ms", "gpu__time_duration.sum"),
    ("SFU (XU) %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("ALU %", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("warps %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("regs", "launch__registers_per_thread"),
]
INSTRUCTIONS = "smsp__inst_executed.sum"      # warp instructions: 32 threads' each
DRAM_RATE = "dram__bytes.sum.per_second"      # read and written
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def profile() -> None:
    """Run each benchmark head once under the profiler; print {head: kernel name} as JSON."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench import LOGIT_WORKLOADS, logit_step

    kernels = {}
    for name, (make, needs, _) in LOGIT_WORKLOADS.items():
        head, step = logit_step(make, needs, ROWS, VOCAB)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        kernels[name] = f"head_loss_{head.key}"
        del head, step
        torch.cuda.empty_cache()
    print(json.dumps(kernels))


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def table(raw_csv: str, kernels_json: str) -> None:
    """The table of each head's counters, from ``ncu --page raw --csv`` and profile()'s output. A
    head whose call runs its reads as separate launches (``split``) gets their sum: times, counts and
    bytes added, the percentages weighted by time, the stalls of its longest launch."""
    with open(raw_csv) as f:
        rows = list(csv.reader(f))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    lines = [line for line in open(kernels_json).read().splitlines() if line.startswith("{")]
    kernels = json.loads(lines[-1])
    shown = [(label, m) for label, m in METRICS if m in col]
    seconds = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3}
    rate = {"Gbyte/s": 1.0, "Tbyte/s": 1e3}
    print(f"{'head':22s} {'launches':>8s} " + " ".join(f"{label:>10s}" for label, _ in shown)
          + f" {'inst/elem':>10s} {'DRAM GB':>8s} {'TB/s':>6s}  top stalls (warps per issue)")
    for head, kernel in kernels.items():
        launches = [r for r in data if r[col["Kernel Name"]].startswith(kernel)]
        if not launches:
            print(f"{head:22s} (kernel {kernel} not in the report)")
            continue
        time = col["gpu__time_duration.sum"]
        ms = [_number(r[time]) * seconds[units[time]] * 1e3 for r in launches]
        values = []
        for label, m in shown:
            vs = [_number(r[col[m]]) for r in launches]
            if label == "ms":
                values.append(sum(ms))
            elif label == "regs":
                values.append(max(vs))
            else:
                values.append(sum(v * t for v, t in zip(vs, ms)) / sum(ms))
        inst = sum(_number(r[col[INSTRUCTIONS]]) for r in launches) if INSTRUCTIONS in col else float("nan")
        gb = sum(_number(r[col[DRAM_RATE]]) * rate[units[col[DRAM_RATE]]] * t * 1e-3 for r, t in zip(launches, ms))
        longest = launches[max(range(len(ms)), key=ms.__getitem__)]
        stalls = sorted(((_number(longest[i]), name[len(STALL[0]):-len(STALL[1])]) for name, i in col.items()
                         if name.startswith(STALL[0]) and name.endswith(STALL[1]) and longest[i]), reverse=True)
        print(f"{head:22s} {len(launches):8d} " + " ".join(f"{v:10.3g}" for v in values)
              + f" {32 * inst / (ROWS * VOCAB):10.1f} {gb:8.2f} {gb / sum(ms):6.2f}  "
              + ", ".join(f"{n} {v:.2f}" for v, n in stalls[:3]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        table(sys.argv[2], sys.argv[3])
    else:
        profile()
