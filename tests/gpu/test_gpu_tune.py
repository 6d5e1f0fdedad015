"""The tuner on a GPU (marked ``gpu``: skipped without one): it times each candidate tile and, where
ptxas gave a tile's kernel registers that cost a program a multiprocessor, the tile under the caps
that fit more (tune.register_caps); a capped tile computes the float64 reference's values.
(Timings live in bench/, never in a test: here only which configurations were timed.)"""
from __future__ import annotations

import pytest
import torch

import losscodegen as lcg
from losscodegen.backends.triton import dispatch, tiles, tune
from losscodegen.testing import assert_parity

pytestmark = pytest.mark.gpu


def test_the_tuner_times_register_caps_and_a_capped_tile_computes_the_same(tmp_path):
    head = lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction()))
    V = 32000
    times = tune.measure(head, V, torch.bfloat16, torch.device("cuda"), rows=256, reps=2)
    uncapped = [c for c in times if c.maxnreg is None]
    assert set(uncapped) == set(tune.candidates(head.kernel.SPEC, V))
    capped = {c for c in times if c.maxnreg is not None}
    assert capped, "no tile of GRPO's kernel took more than 64 registers a thread"
    assert all(0 < ms < 1e3 for ms in times.values())
    for config in capped:
        assert tiles.Config(config.block_v, config.num_warps, config.split) in uncapped
    found = tune.tune([head], [V], torch.device("cuda"), rows=256, out=tmp_path / "tiles.json")
    assert list(found.values())[0] in times
    head.tile_override = sorted(capped, key=lambda c: c.maxnreg)[0]   # the tightest cap: spills, same values
    assert_parity(head, rows=64, vocab=V, dtypes=(torch.bfloat16,))


def test_a_kernel_that_spills_under_the_tables_cap_runs_uncapped_after_its_first_launch(tmp_path, monkeypatch):
    """The forward KL's 16-warp tile capped at 64 registers spilled 108 on an H200 and ran 3.6x slower:
    a table entry with that cap (the user's) is dropped for this kernel once its first binary shows the
    spill (dispatch.SPILL_LIMIT), and the head computes the float64 reference's values either way."""
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(tiles, "TABLE", tiles._Table())
    head = lcg.HeadLoss(lcg.ForwardKL())
    V, device = 131072, torch.device("cuda")
    tiles.TABLE.put(tiles.key(device, head.kernel.SPEC, V, 2), tiles.Config(16384, 16, False, 64))
    assert_parity(head, rows=64, vocab=V, dtypes=(torch.bfloat16,))     # its launch: capped, spilled
    launched = [kernel for layout in head.layouts.values() for _, kernel in layout.steps]
    assert all("maxnreg" not in kernel.constexprs for kernel in launched)
    assert_parity(head, rows=64, vocab=V, dtypes=(torch.bfloat16,), seed=1)     # the next: uncapped
    binaries = getattr(head.kernel, f"head_loss_{head.kernel.KEY}").device_caches[torch.cuda.current_device()][0]
    spills = sorted(b.n_spills for b in binaries.values())
    assert spills[-1] > dispatch.SPILL_LIMIT and spills[0] <= dispatch.SPILL_LIMIT, spills
