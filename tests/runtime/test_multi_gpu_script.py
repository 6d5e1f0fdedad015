"""bench/multi_gpu.py, the multi-GPU runs' driver, on gloo ranks on the CPU (`--cpu`: tiny sizes,
kernels in Triton's interpreter): it runs every part through, and each of its checks passes; a
sharded result that is wrong fails its check and the run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, ranks: int, *args: str, env: dict[str, str], pythonpath: str = "") -> tuple[int, str, dict]:
    """(exit status, stdout, the record) of a run on ``ranks`` gloo ranks."""
    out = tmp_path / "records"
    environ = {**os.environ, "TRITON_INTERPRET": "1", **env,
               "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(ranks), str(ROOT / "bench" / "multi_gpu.py"), "--cpu", "--out", str(out), *args],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)
    records = list(out.glob(f"cpu-multigpu-{ranks}*.json"))
    assert len(records) == 1, (records, proc.stdout[-3000:], proc.stderr[-5000:])
    return proc.returncode, proc.stdout, json.loads(records[0].read_text()) | {"path": str(records[0])}


@pytest.mark.slow   # (every part of the script; it runs on two ranks in the default tier: test_multi_gpu_script_fails_a_wrong_sharded_result)
def test_multi_gpu_script_runs_every_part_and_its_checks_pass_on_two_cpu_ranks(tmp_path):
    # (two of the script's heads, CE and GSPO with its sequence-parallel rows, and its linear head:
    # each head's sharded values are tests/runtime/test_vocab_parallel.py's and test_dtensor.py's)
    rc, stdout, record = _run(tmp_path, 2, env={"MGPU_SHAPES": "8x1008", "MGPU_LINEAR_ROWS": "8",
                                                "MGPU_HEADS": "CE,GSPO,linear CE+entropy",
                                                "MGPU_SCALING_HEADS": "CE"})
    assert rc == 0, stdout[-3000:]
    assert record["failed"] == [] and record["meta"]["world"] == 2
    checks = record["correctness"] + record.get("dtensor", []) + record.get("fsdp", [])
    assert all(c["status"] == "pass" for c in checks)
    variants = {(c["head"], c["variant"]) for c in record["correctness"]}
    from_script = {"CE", "GSPO"}
    assert {h for h, v in variants if v == "vocab/2"} == from_script
    assert ("GSPO", "rows/2 (segment_group)") in variants and ("linear CE+entropy", "weight vocab/2") in variants
    # DTensor and FSDP2: checked, or said to be unsupported by this build (never silently skipped)
    assert record.get("dtensor") or record["dtensor_status"]["status"] == "unsupported"
    assert "DTensor: not supported by this build" in stdout or len(record["dtensor"]) == 2 * len(from_script) + 1
    assert len(record.get("fsdp", [])) == 2 or record["fsdp_status"]["status"] == "unsupported"
    (scaled,) = record["scaling"]
    assert scaled["head"] == "CE" and scaled["collectives"]["rounds"] == 1   # the packed stats' all-gather
    # at 2 ranks the all-gather of the packed stats moves what their all-reduce would
    assert abs(scaled["collectives"]["wire_over_ideal"] - 1.0) < 1e-9
    assert "goal one collective round per call (default path, logits heads): met" in stdout
    # the docs' tables from the record
    table = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--markdown", record["path"]],
                           capture_output=True, text=True, check=True).stdout
    assert "| head | 2 ranks |" in table and f"| CE | {scaled['same global work']['ms']['default']:.3f} /" in table
    assert f"{len(checks)} of {len(checks)} checks passed" in table


@pytest.mark.slow   # (a third rank count for the script; two ranks run every part in the default tier)
def test_multi_gpu_script_checks_sequence_parallel_gspo_on_three_cpu_ranks(tmp_path):
    rc, stdout, record = _run(tmp_path, 3, "--parts", "correctness",
                              env={"MGPU_SHAPES": "12x1008", "MGPU_HEADS": "GSPO", "MGPU_B2B_REPEATS": "0"})
    assert rc == 0, stdout[-3000:]
    assert {c["variant"] for c in record["correctness"]} == {"vocab/3", "rows/3 (segment_group)",
                                                            "rows/1 x vocab/3 (groups)"}
    assert all(c["status"] == "pass" for c in record["correctness"])


def test_multi_gpu_script_fails_a_wrong_sharded_result(tmp_path):
    """The packed stats exchanged between ranks, perturbed (a sitecustomize module patches the
    library's all-gather): the vocab-parallel check fails, and so does the run."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "from losscodegen import collectives\n"
        "_gather = collectives.gather\n"
        "def _wrong(out, part, group):\n"
        "    _gather(out, part, group)\n"
        "    out.add_(0.5)\n"
        "collectives.gather = _wrong\n")
    rc, stdout, record = _run(tmp_path, 2, "--parts", "correctness", pythonpath=str(hook),
                              env={"MGPU_SHAPES": "8x1008", "MGPU_HEADS": "CE", "MGPU_B2B_REPEATS": "0"})
    assert rc == 1
    (ce,) = [c for c in record["correctness"] if c["head"] == "CE"]
    assert ce["status"] == "FAIL" and record["failed"] == ["CE, vocab/2, 8x1008"]
