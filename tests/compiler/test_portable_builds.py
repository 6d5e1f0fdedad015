"""Portable builds: a user without the GPU compiles the manifest's kernels for Hopper, Blackwell
and AMD (``python -m losscodegen build``, losscodegen/backends/triton/portable.py), and a GPU
without a tile-table entry gets a tile it can launch (tiles.py), measured on first use only when
asked (``LOSSCODEGEN_TUNE=first-use``).

The builds run in a process of their own: the suite's runs Triton's interpreter, whose kernels
cannot be compiled for a GPU. One manifest kernel a target here (each with a different head, to
cover more of the generated code in the suite's time); ``LOSSCODEGEN_FULL_BUILD=1`` also builds
every kernel of the manifest for every target that works (minutes)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import losscodegen as lcg
import losscodegen.backends.triton as triton_backend
from losscodegen import load
from losscodegen.__main__ import manifest_heads
from losscodegen.backends.triton import portable, tiles, tune

# the targets the installed Triton builds every kernel for (AMD's: the head kernels' _log is tl.log
# there, a v_log_f32, for its libdevice has no fast_logf: templates/triton/_functions.j2)
WORKING = ("sm_90a", "sm_100a", "sm_120a", "gfx942", "gfx950")


def _without_interpreter(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LOSSCODEGEN_CACHE=str(tmp_path / "cache"), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    return env


# each working target with a manifest head and the calls it is driven through: the teacher-stream
# mix, by the head kernel and by the row-slices kernel (Gluon: asynchronous copies); GSPO (its segment kernel); the softcap (libdevice's tanh) at the widest tile (32768 x 32
# warps), and its vocab-parallel launch exchanging stats in-kernel (atomics across GPUs); on AMD (a
# wavefront of 64), CE and GSPO (its segment kernel)
PLAN = {"sm_90a": ("HeadLoss(CrossEntropy(), ZLoss(), ForwardKL(), metrics=(Entropy(),))", ("grad", "slices")),
        "sm_100a": ("HeadLoss(GSPO(), metrics=(Entropy(),))", ("grad",)),
        "sm_120a": ("HeadLoss(CrossEntropy(), softcap=30.0)", ("grad", "exchange")),
        "gfx942": ("HeadLoss(CrossEntropy())", ("grad",)),
        "gfx950": ("HeadLoss(GSPO(), metrics=(Entropy(),))", ("grad",))}
BUILD = """
import dataclasses, json, sys
from losscodegen.__main__ import manifest_heads
from losscodegen.backends.triton import portable
from pathlib import Path
plan = json.loads(sys.argv[1])
heads = dict(manifest_heads(Path(sys.argv[2])))
out = []
for target, (line, calls) in plan.items():
    out += portable.build([(line, heads[line])], portable.parse_targets(target), calls=tuple(calls))
print(json.dumps([dataclasses.asdict(r) for r in out]))
"""


def test_a_manifest_kernel_compiles_for_hopper_blackwell_and_amd_without_a_gpu(tmp_path):
    manifest = load.GENERATED / "manifest"
    assert all(line in manifest.read_text() for line, _ in PLAN.values())   # (manifest heads)
    done = subprocess.run([sys.executable, "-c", BUILD, json.dumps(PLAN), str(manifest)],
                          env=_without_interpreter(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [portable.Compiled(**r) for r in json.loads(done.stdout.splitlines()[-1])]
    heads = dict(manifest_heads(manifest))
    for target, (line, calls) in PLAN.items():
        mine = [r for r in results if r.target == target]
        assert [r for r in mine if r.problem] == [], target
        kernels = {r.kernel.split(" ")[0] for r in mine}
        assert {f"head_loss_{heads[line].key}", "_prologue", "_scale_rows"} <= kernels, (target, kernels)
        # what the compiler gave each binary (ptxas's, read back with cuobjdump; AMD's from its
        # metadata): on NVIDIA a block's registers fit the 64K of a multiprocessor, on AMD a lane's
        # VGPRs the 512 a wavefront can have; the shared memory the target's
        nvidia = portable.TARGETS[target].backend == "cuda"
        assert all(r.registers is not None and (r.registers * r.num_warps * 32 <= 65536 if nvidia else r.registers <= 512)
                   for r in mine), mine
        assert all(r.shared <= portable.TARGETS[target].shared_bytes for r in mine)
    assert all(any(r.kernel.startswith("segments_") for r in results if r.target == t) for t in ("sm_100a", "gfx950"))
    widest = [r for r in results if r.target == "sm_120a" and r.block_v == 32768]
    assert widest and all(r.num_warps == 32 for r in widest)          # the rule's tile for CE
    assert any("EXCHANGE" in r.kernel for r in results if r.target == "sm_120a")
    # the row-slices kernel: no spills, its two streams' slices (2 buffers of 16384 bf16 each) in shared memory
    sliced = [r for r in results if r.kernel.startswith("head_loss_slices_")]
    assert [r.target for r in sliced] == ["sm_90a"] and sliced[0].spilled == 0 and sliced[0].shared >= 4 * 16384 * 2


@pytest.mark.skipif(os.environ.get("LOSSCODEGEN_FULL_BUILD") != "1",
                    reason="every manifest kernel for every working target: minutes (LOSSCODEGEN_FULL_BUILD=1)")
def test_every_manifest_kernel_compiles_for_every_working_target(tmp_path):
    done = subprocess.run([sys.executable, "-m", "losscodegen", "build", "--targets", ",".join(WORKING)],
                          env=_without_interpreter(tmp_path), capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_an_unknown_target_is_named_with_the_known_ones():
    assert [t.name for t in portable.parse_targets("all")] == list(WORKING)
    with pytest.raises(ValueError, match="--targets: unknown target.*'sm_89'.*sm_90a, sm_100a, sm_120a, gfx942, gfx950"):
        portable.parse_targets("sm_90a,sm_89")
    with pytest.raises(ValueError, match="calls must be some of"):
        portable.build([], portable.parse_targets("sm_90a"), calls=("backward",))
    if os.environ.get("TRITON_INTERPRET") == "1":           # (this process: the suite's, on a CPU)
        with pytest.raises(RuntimeError, match="in a process without TRITON_INTERPRET"):
            portable.build([], portable.parse_targets("sm_90a"))


# ---- tiles on a GPU without an entry ------------------------------------------------------------
HEADS = [lcg.HeadLoss(lcg.CrossEntropy()), lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), metrics=(lcg.Entropy(),)),
         lcg.HeadLoss(lcg.ForwardKL()), lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(),))]


@pytest.mark.parametrize("lanes", [32, 64])
def test_a_gpu_without_a_table_entry_gets_a_tile_it_can_launch(lanes, monkeypatch):
    """An AMD GPU (wavefronts of 64) is not in the table: the rule's 32 warps would be a block of 2048
    threads, which no launch takes. Its tile keeps the rule's width and its 1024 threads."""
    monkeypatch.setattr(tiles, "lanes", lambda device: lanes)
    for head in HEADS:
        rule = tiles.rule(head.kernel.SPEC.state)
        got = tiles.choose(head, head.kernel, 128256, torch.bfloat16, torch.device("cpu"))
        assert got.block_v == rule.block_v and got.split == rule.split
        assert got.num_warps * lanes <= tiles.MAX_THREADS
        assert got.num_warps == min(rule.num_warps, tiles.MAX_THREADS // lanes)
        for V, size in ((128256, 2), (128256, 4), (3000, 2)):       # (and each launch of it)
            assert got.launch(V, size)["num_warps"] * lanes <= tiles.MAX_THREADS
    assert tiles.fit(tiles.Config(32768, 32), 64) == tiles.Config(32768, 16)


def test_a_table_entry_or_a_forced_tile_is_fit_to_the_warp_too(monkeypatch):
    head = HEADS[0]
    monkeypatch.setattr(tiles, "lanes", lambda device: 64)
    monkeypatch.setattr(tiles, "measured", lambda k, V, dtype, device: tiles.Config(16384, 32, False, 80))
    assert tiles.choose(head, head.kernel, 128256, torch.bfloat16, torch.device("cpu")) == tiles.Config(16384, 16, False, 80)
    head.tile_override = tiles.Config(8192, 32)
    try:
        assert tiles.choose(head, head.kernel, 128256, torch.bfloat16, torch.device("cpu")) == tiles.Config(8192, 16)
    finally:
        head.tile_override = None


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A "cuda" device without a GPU: its name in the table's keys, a 32-thread warp, no capture; a
    fresh table (the user's in tmp_path); ``tune.measure`` recorded, with 8192 x 8 the fastest."""
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(tiles, "TABLE", tiles._Table())
    monkeypatch.setattr(tiles, "key", lambda device, spec, V, size: f"Some GPU|{'/'.join(map(str, spec.state))}|{V}|{size}")
    monkeypatch.setattr(tiles, "lanes", lambda device: 32)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(triton_backend, "_FIRST_USE", set())
    measured = []

    def measure(head, V, dtype, device, rows=2048, reps=20):
        measured.append((head, V, dtype))
        assert torch.is_grad_enabled()          # (a call's forward runs without grad mode)
        return {tiles.Config(4096, 8): 2.0, tiles.Config(8192, 8): 1.0, tiles.Config(32768, 32): 3.0}
    monkeypatch.setattr(tune, "measure", measure)
    return measured


def test_tuning_on_first_use_happens_only_when_asked(fake_gpu, tmp_path, monkeypatch):
    head, gpu = HEADS[1], torch.device("cuda")
    rule = tiles.rule(head.kernel.SPEC.state)
    monkeypatch.delenv("LOSSCODEGEN_TUNE", raising=False)
    assert triton_backend.BACKEND.config(head, head.kernel, 128256, torch.bfloat16, gpu) == rule
    assert fake_gpu == []                                               # never by default
    monkeypatch.setenv("LOSSCODEGEN_TUNE", "first-use")
    with torch.no_grad():
        got = triton_backend.BACKEND.config(head, head.kernel, 128256, torch.bfloat16, gpu)
    assert got == tiles.Config(8192, 8)
    assert len(fake_gpu) == 1 and fake_gpu[0][0] is not head and fake_gpu[0][1:] == (128256, torch.bfloat16)
    name = tiles.key(gpu, head.kernel.SPEC, 128256, 2)
    assert json.loads((tmp_path / "tiles.json").read_text()) == {name: [8192, 8, False]}   # kept
    assert triton_backend.BACKEND.config(head, head.kernel, 128256, torch.bfloat16, gpu) == got
    assert len(fake_gpu) == 1                                           # once
    # never for a vocab-parallel call (its ranks run in step), nor off the GPU
    triton_backend.BACKEND.config(head, head.kernel, 50000, torch.bfloat16, gpu, sharded=True)
    triton_backend.BACKEND.config(head, head.kernel, 50000, torch.bfloat16, torch.device("cpu"))
    assert len(fake_gpu) == 1


def test_a_first_use_measurement_that_fails_leaves_the_rule_and_says_so(fake_gpu, monkeypatch):
    head, gpu = HEADS[2], torch.device("cuda")
    monkeypatch.setenv("LOSSCODEGEN_TUNE", "first-use")
    tries = []

    def measure(*args, **kwargs):
        tries.append(args)
        raise torch.cuda.OutOfMemoryError("no room")
    monkeypatch.setattr(tune, "measure", measure)
    with pytest.warns(UserWarning, match="LOSSCODEGEN_TUNE=first-use: measuring .* failed .*no room"):
        got = triton_backend.BACKEND.config(head, head.kernel, 128256, torch.bfloat16, gpu)
    assert got == tiles.rule(head.kernel.SPEC.state)
    assert triton_backend.BACKEND.config(head, head.kernel, 128256, torch.bfloat16, gpu) == got
    assert len(tries) == 1                                              # not tried again


def test_a_misspelt_tune_setting_is_an_error_naming_it(monkeypatch):
    head = HEADS[0]
    monkeypatch.setenv("LOSSCODEGEN_TUNE", "1")
    with pytest.raises(ValueError, match="LOSSCODEGEN_TUNE must be 'first-use' or unset, got '1'"):
        triton_backend.BACKEND.config(head, head.kernel, 128256, torch.bfloat16, torch.device("cpu"))
