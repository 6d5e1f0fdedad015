"""Launch configurations: a call split into a launch a read computes what one launch does; the tile
keeps its bytes for wider logits and shrinks to a small vocabulary; measurements are kept."""
import json
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import losscodegen as lcg
from losscodegen.backends.triton import dispatch, tiles, tune
from losscodegen.testing import assert_parity


@pytest.mark.parametrize("head", [
    lcg.HeadLoss(lcg.JSD(beta=0.3)),
    lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(), lcg.TokenAccuracy())),
    lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1)),
], ids=["jsd", "ce_fkl", "gspo"])
def test_split_launches_compute_what_one_launch_does(head):
    head.tile_override = tiles.Config(4096, 8, split=True)  # as while measuring
    assert len(head.launches(sharded=False, grad=True, split=True)) > 1
    assert_parity(head, rows=14, vocab=300)
    assert not head.layouts         # a configuration being measured is not kept


def test_tile_bytes_and_small_vocabularies():
    config = tiles.Config(16384, 16)
    assert config.launch(128256, 2) == dict(BLOCK_V=16384, num_warps=16)
    assert config.launch(128256, 4) == dict(BLOCK_V=8192, num_warps=16)      # same bytes, fp32
    assert config.launch(3000, 2) == dict(BLOCK_V=4096, num_warps=4)         # shrunk with its warps
    head = lcg.HeadLoss(lcg.JSD())
    assert {c.split for c in tune.candidates(head.kernel.SPEC, 128256)} == {False, True}
    assert max(c.block_v for c in tune.candidates(head.kernel.SPEC, 5000)) == 8192


def test_the_rule_follows_the_plan_state_and_is_not_in_the_kernel():
    ce, fkl = lcg.HeadLoss(lcg.CrossEntropy()), lcg.HeadLoss(lcg.ForwardKL())
    assert tiles.rule(ce.kernel.SPEC.state) == tiles.Config(32768, 32)
    assert tiles.rule(fkl.kernel.SPEC.state) == tiles.Config(4096, 8)
    assert not hasattr(ce.kernel, "TILE")       # the runtime's choice, not hashed into the kernel
    assert tiles.choose(ce, ce.kernel, 128256, torch.bfloat16, torch.device("cpu")) == tiles.Config(32768, 32)


def test_a_vocab_parallel_call_takes_the_sharded_tile_of_its_streams():
    ce, jsd = lcg.HeadLoss(lcg.CrossEntropy()), lcg.HeadLoss(lcg.JSD())
    for head in (ce, jsd):
        config = tiles.choose(head, head.kernel, 32064, torch.bfloat16, torch.device("cpu"), sharded=True)
        assert config == tiles.Config(*tiles.SHARDED[head.kernel.SPEC.state[0]])
    assert tiles.SHARDED[ce.kernel.SPEC.state[0]] != tiles.SHARDED[jsd.kernel.SPEC.state[0]]    # "x" and "xt"


def test_measurements_are_kept_beside_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(tiles, "SHIPPED", tmp_path / "shipped.json")
    (tmp_path / "shipped.json").write_text(json.dumps({"gpu|x/1/0|131072|2": [32768, 32, False],
                                                       "gpu|xt/2/4|131072|2": [4096, 8, False]}))
    table = tiles._Table()
    assert table.get("gpu|x/1/0|131072|2") == tiles.Config(32768, 32, False)
    table.put("gpu|xt/2/4|131072|2", tiles.Config(8192, 16, True))
    assert json.loads((tmp_path / "tiles.json").read_text()) == {"gpu|xt/2/4|131072|2": [8192, 16, True]}
    assert tiles._Table().get("gpu|xt/2/4|131072|2") == tiles.Config(8192, 16, True)  # the user's win


def test_a_table_entry_may_cap_the_registers_of_a_thread(tmp_path, monkeypatch):
    """The H200's entry for GRPO's plan state caps registers at 80: ptxas gave that kernel 102 after a
    change far from its loops, 2 programs of 8 warps on a multiprocessor instead of 3 (tiles.Config)."""
    config = tiles.Config(8192, 8, False, 80)
    assert config.launch(128256, 2) == dict(BLOCK_V=8192, num_warps=8, maxnreg=80)
    assert "maxnreg" not in tiles.Config(8192, 8).launch(128256, 2)
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    table = tiles._Table()
    table.put("gpu|x/2/0|131072|2", config)
    assert json.loads((tmp_path / "tiles.json").read_text()) == {"gpu|x/2/0|131072|2": [8192, 8, False, 80]}
    assert tiles._Table().get("gpu|x/2/0|131072|2") == config
    assert tiles.TABLE.get("NVIDIA H200|x/2/0|131072|2").maxnreg == 80


def test_the_tuner_tries_the_register_caps_that_fit_another_program():
    """A cap is worth timing where it lets one more program onto a multiprocessor (65536 registers,
    8 a thread at a time): GRPO's 8-warp tile at 102 registers fits 2, at 80 it fits 3, at 64 it fits 4."""
    assert tune.register_caps(8, 102) == [80, 64]
    assert tune.register_caps(16, 97) == [64]
    assert tune.register_caps(4, 172) == [168, 128]
    assert tune.register_caps(4, 172, n=4) == [168, 128, 96, 80]
    assert tune.register_caps(8, 80) == [64]
    assert tune.register_caps(8, 64) == [] and tune.register_caps(32, 255) == [64]
    assert tune.register_caps(8, 200, regs_per_sm=32768) == [128, 64]   # another GPU's register file


def test_every_shipped_cap_is_an_occupancy_step_the_tuner_tries():
    """A shipped entry's register cap is one the tuner can have chosen: an occupancy step of its warps
    (the most registers a thread may have for a given number of programs a multiprocessor), 64 or more."""
    shipped = json.loads(tiles.SHIPPED.read_text())
    capped = {name: entry for name, entry in shipped.items() if len(entry) == 4}
    assert capped      # (the H200's GRPO entry, at least)
    for name, entry in capped.items():
        config = tiles.Config(*entry)
        bucket, element_size = map(int, name.split("|")[2:])
        warps = config.launch(bucket, element_size)["num_warps"]     # (the tuner's: a launch's warps)
        assert config.maxnreg in tune.register_caps(warps, 256, n=8), (name, entry)


def _one(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)


@pytest.mark.parametrize("spills, capped_after", [(dispatch.SPILL_LIMIT + 1, False), (dispatch.SPILL_LIMIT, True)])
def test_a_capped_kernel_that_spills_past_the_limit_launches_uncapped(monkeypatch, spills, capped_after):
    """dispatch.Kernel on the GPU path (a jitted function, Triton's launches replaced by a record of
    the options each compile got): a binary spilling more than SPILL_LIMIT registers under the
    table's cap makes every later launch compile without it; one within the limit keeps it."""
    compiles = []

    def jit(self, grid, *args):
        compiles.append(dict(self.constexprs))
        return SimpleNamespace(n_spills=spills if "maxnreg" in self.constexprs else 0)   # (no launcher:
    monkeypatch.setattr(dispatch.Kernel, "jit", jit)                                       #  each launch jits)
    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(get_current_device=lambda: 0))
    kernel = dispatch.Kernel(JITFunction(_one), BLOCK=16, num_warps=4, maxnreg=64)
    for _ in range(3):
        kernel(1, torch.zeros(16))
    assert [c.get("maxnreg") for c in compiles] == [64] + [64 if capped_after else None] * 2
    assert all(c["BLOCK"] == 16 and c["num_warps"] == 4 for c in compiles)
