"""bench/training_step.py and bench/trl_sft.py end to end on the CPU at tiny size (``--cpu --tiny``, Triton's
interpreter), as the GPU runs call them: exit 0, the records written to $OUT, the short table printed last
and, for TRL's SFT, the head's logged terms within tolerance of float64. (Timings live in the scripts' GPU
runs, never in a test.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def _run(script, *options, out):
    env = dict(os.environ, OUT=str(out), PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--cpu", "--tiny", "--steps", "2",
                           "--warmup", "1", *options], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_training_step_runs_a_mixture_of_experts(tmp_path):
    lines = _run("training_step.py", "--model", "qwen3_moe", "--batch", "1", "--variants", "losscodegen+",
                 out=tmp_path)
    record = json.loads((tmp_path / "cpu-hf-training-step-qwen3_moe-b1.json").read_text())
    assert record["results"]["losscodegen+"]["loss_check"]["ok"]   # (against the unpatched model's loss)
    assert len(record["results"]["losscodegen+"]["losses"]) == 2
    assert lines[-1].startswith("losscodegen+") and lines[-1].split()[-2] == "ok"


def test_trl_sft_logs_the_heads_terms_as_float64_gives_them(tmp_path):
    lines = _run("trl_sft.py", "--variants", "losscodegen+", out=tmp_path)
    (result,) = json.loads(next(tmp_path.glob("cpu-trl-sft-b*.json")).read_text())["results"].values()
    assert result["loss_check"]["ok"] and result["terms_check"]["ok"] and not result["missing_logs"]
    assert {"cross_entropy", "z_loss", "entropy", "token_accuracy"} <= set(result["logged_vs_float64"])
    assert lines[-1].startswith("losscodegen+") and " ok " in lines[-1]
