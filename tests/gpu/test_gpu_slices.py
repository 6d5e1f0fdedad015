"""The row-slices kernel (issue 47) on a GPU: the benchmark heads with a Slices configuration against
their float64 references, at a realistic size (4096 x 128256 bf16: 8 programs a row, the last
slice partial) and at 1024 x 262144 (16 programs a row), and in ``assert_parity``'s regimes
(saturated labels, one-hot teachers, ...) at one program a row and at two."""
from __future__ import annotations

import pytest

from losscodegen.backends.triton.tiles import Slices
from losscodegen.testing import assert_parity
from test_gpu_parity import HEADS, _check

pytestmark = pytest.mark.gpu
SERVED = ["CE", "CE+z+ent+acc", "GRPO+ent+clip+ratio", "CE+z+0.5FKL+ent", "JSD", "FKL"]


def _sliced(name: str, config: Slices = Slices(16384, 8)):
    head = HEADS[name]()          # (backend "auto": Triton on a GPU)
    head.tile_override = config
    return head


@pytest.mark.parametrize("name", SERVED)
def test_row_slices_parity_at_4096_x_128256_bf16(name):
    _check(_sliced(name), 4096, 128256)


@pytest.mark.parametrize("name", ["CE", "JSD"])
def test_row_slices_parity_at_1024_x_262144_bf16_in_smaller_slices(name):
    _check(_sliced(name, Slices(8192, 4)), 1024, 262144)


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("vocab", [500, 32000])
def test_row_slices_in_the_regimes_where_training_goes(name, vocab):
    assert_parity(_sliced(name), rows=64, vocab=vocab, device="cuda")
