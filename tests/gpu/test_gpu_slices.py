"""The row-slices kernel (issue 47) on a GPU: the benchmark heads with a Slices configuration against
their float64 references, at a realistic size (4096 x 128256 bf16: 8 programs a row, the last
slice partial) and at 1024 x 262144 (16 programs a row), and in ``assert_parity``'s regimes
(saturated labels, one-hot teachers, ...) at one program a row and at two. Each checks that the
row-slices kernel ran (``_ran``), not its fallback."""
from __future__ import annotations

import pytest

from losscodegen.backends.triton.tiles import Slices
from losscodegen.testing import assert_parity
from test_gpu_parity import HEADS, _check

pytestmark = pytest.mark.gpu
# the benchmark heads whose files have the row-slices kernel (CE + z + entropy + accuracy's argmax: none)
SERVED = ["CE", "GRPO+ent+clip+ratio", "CE+z+0.5FKL+ent", "JSD", "FKL"]


def _sliced(name: str, config: Slices = Slices(16384, 8)):
    head = HEADS[name]()          # (backend "auto": Triton on a GPU)
    head.tile_override = config
    return head


def _ran(head) -> None:
    # the row-slices kernel compiled on the GPU, so it was launched (not only its fallback)
    fn = getattr(head.kernel, f"head_loss_slices_{head.kernel.KEY}")
    assert any(cache[0] for cache in fn.device_caches.values()), "the row-slices kernel did not run"


@pytest.mark.parametrize("name", SERVED)
def test_row_slices_parity_at_4096_x_128256_bf16(name):
    head = _sliced(name)
    _check(head, 4096, 128256)
    _ran(head)


@pytest.mark.parametrize("name", ["CE", "JSD"])
def test_row_slices_parity_at_1024_x_262144_bf16_in_smaller_slices(name):
    head = _sliced(name, Slices(8192, 4))
    _check(head, 1024, 262144)
    _ran(head)


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("vocab", [512, 32000])   # (rows at 16-byte multiples: the kernel's copies read them)
def test_row_slices_in_the_regimes_where_training_goes(name, vocab):
    head = _sliced(name)
    assert_parity(head, rows=64, vocab=vocab, device="cuda")
    _ran(head)
