"""The row-slices kernel (issue 47; templates/gluon/_slices.j2) as far as a CPU can check it: which
files have it, how a Slices configuration splits a row and how many programs fit at once, and that
a call it does not serve takes its fallback while one it serves says it needs a GPU (Triton's
interpreter does not run Gluon); and its phases, in Triton's interpreter at one program a row (its
Gluon layout mapped onto Triton's language), against float64. Its compiled form for sm_90a is checked in
tests/compiler/test_portable_builds.py, its values on a GPU in tests/gpu/test_gpu_slices.py."""
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import losscodegen as lcg
from losscodegen.backends.triton import slices, tiles
from losscodegen.backends.triton.slices import resident_per_sm


def _head(*terms, **options) -> lcg.HeadLoss:
    return lcg.HeadLoss(*terms, backend="triton", **options)


def test_a_file_has_the_row_slices_kernel_where_its_rows_are_the_whole_work():
    for head, has in ((_head(lcg.CrossEntropy()), True), (_head(lcg.JSD()), True),
                      (_head(lcg.GSPO()), False),     # segment statistics: a row adds into its segment
                      (_head(lcg.CrossEntropy(), lcg.TopKForwardKL()), False),
                      (_head(lcg.CrossEntropy(), metrics=(lcg.TokenAccuracy(),)), False),   # the argmax
                      (_head(lcg.GRPO(kl_beta=0.04)), False)):   # a compensated sum (log(1 - p)'s)
        assert hasattr(head.kernel, f"head_loss_slices_{head.kernel.KEY}") is has, head


@pytest.mark.parametrize("V, element_size, expect", [
    (128256, 2, dict(BLOCK_V=2048, G=8, N_CHUNKS=8)),      # 8 slices of 16384 columns (the last 13568)
    (262144, 2, dict(BLOCK_V=2048, G=16, N_CHUNKS=8)),
    (32000, 2, dict(BLOCK_V=2048, G=2, N_CHUNKS=8)),
    (500, 2, dict(BLOCK_V=2048, G=1, N_CHUNKS=1)),          # one program a row, one chunk, mostly masked
    (128256, 4, dict(BLOCK_V=1024, G=8, N_CHUNKS=16)),      # fp32: 16 bytes a thread are 4 columns
])
def test_a_slices_configuration_splits_a_row_into_slices_of_whole_chunks(V, element_size, expect):
    options = tiles.Slices(16384, 8).launch(V, element_size)
    assert {k: options[k] for k in expect} == expect and options["launch_cooperative_grid"]
    # every column is in a slice, and every slice holds some of the row
    width = options["N_CHUNKS"] * options["BLOCK_V"]
    assert options["G"] * width >= V > (options["G"] - 1) * width


def test_no_program_of_a_row_holds_none_of_it_where_a_chunk_is_wider_than_the_slices_asked_for():
    for V in range(1000, 40000, 337):
        options = tiles.Slices(1024, 8).launch(V, 2)      # 2048-column chunks
        width = options["N_CHUNKS"] * options["BLOCK_V"]
        assert options["G"] * width >= V > (options["G"] - 1) * width


def test_a_table_entry_of_a_slices_configuration_reads_back_as_it():
    for config in (tiles.Slices(8192, 4, 2), tiles.Slices(64, 1, copy_bytes=4)):
        assert tiles.of_entry(config.entry()) == config
    assert tiles.of_entry([4096, 8, False]) == tiles.Config(4096, 8)


def test_programs_resident_at_once_take_the_least_that_registers_shared_memory_and_threads_allow():
    h100 = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                           max_threads_per_multi_processor=2048)
    assert resident_per_sm(128, 65568, 8, h100) == 2     # registers: 128 x 256 threads twice is 64K
    assert resident_per_sm(40, 65568, 8, h100) == 3      # shared memory: 3 x (64 KB + 1 KB)
    assert resident_per_sm(40, 131104, 8, h100) == 1
    assert resident_per_sm(32, 1024, 4, h100) == 16      # threads: 2048 / 128


def _inputs(head, R=6, V=700):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R, V, generator=g) * 2
    y = torch.randint(0, V, (R,), generator=g)
    y[::3] = -100
    kw = {"teacher_logits": torch.randn(R, V, generator=g)} if head.kernel.USES_TEACHER else {}
    return x, y, kw


@pytest.mark.parametrize("make", [lambda: _head(lcg.CrossEntropy()), lambda: _head(lcg.JSD())])
def test_a_call_the_row_slices_kernel_does_not_serve_takes_its_fallback(make):
    head = make()
    x, y, kw = _inputs(head)
    want = head(x, y, **kw, reduction="none").loss
    head.tile_override = tiles.Slices(16384, 8)
    with torch.no_grad():
        assert torch.equal(head(x, y, **kw).loss, make()(x, y, **kw).loss)        # no gradient: no slices
    assert torch.equal(head(x, y, **kw, reduction="none").loss, want)           # the gradient in backward


def test_a_call_the_row_slices_kernel_serves_needs_a_gpu():
    head = _head(lcg.CrossEntropy())
    head.tile_override = tiles.Slices(16384, 8)
    x, y, _ = _inputs(head, V=704)
    with pytest.raises(ValueError, match="runs on a GPU only"):
        head(x.requires_grad_(), y)


@pytest.mark.parametrize("V, columns", [(700, 700), (720, 712)])
def test_rows_its_copies_cannot_read_take_the_fallback(V, columns):
    # rows of 700 fp32 columns start at multiples of 2800 bytes, not of 16: no 16-byte copy reads them;
    # rows of 712 columns of a 720-column tensor do start at 16-byte multiples, but their masks split
    # a copy into single elements (Triton cannot tell they are constant over 16 columns): both calls
    # run the head kernel (Triton would refuse to compile the copies, not take the fallback)
    head = _head(lcg.CrossEntropy())
    x, y, _ = _inputs(head, V=V)
    x = x[:, :columns]
    y = y.clamp(max=columns - 1)
    want = torch.autograd.grad(head(x.requires_grad_(), y).loss, x)[0]
    head.tile_override = tiles.Slices(16384, 8)
    assert torch.equal(torch.autograd.grad(head(x, y).loss, x)[0], want)


# ---- the row-slices kernel's phases in Triton's interpreter ------------------------------------
# The interpreter does not run Gluon (shared memory, asynchronous copies) and runs a grid's programs
# one after another (the G programs of a row would wait for each other forever). At one program a
# row, though, the kernel's phases are plain Triton but for the layout: its Gluon primitives mapped
# onto Triton's language below (each shared-memory chunk read from global memory instead, the copies
# and CTA barriers dropped, the layouts' aranges and fills without a layout), the generated kernel
# runs as it is written otherwise: its first read (the slice's maxima, then lane-by-lane sums), its
# exchange and merge (of one), its exact sums, its gradient and its finish.
_GLUON_TO_TRITON = (
    (r"@gluon\.jit", "@triton.jit"),
    (r"\n[ ]*_copy_slice\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)", ""),
    (r"async_copy\.(commit_group|wait_group)\([^)]*\)", "pass"),
    (r"\n[ ]*\w+_smem = gl\.allocate_shared_memory\([^\n]*", ""),
    (r"\n[ ]*\w+_bufs = _reinterpret\([^\n]*", ""),
    (r"\n[ ]*offs2 = \(gl\.arange[^\n]*\n[^\n]*", ""),
    (r"_cta_barrier\(\)", "tl.debug_barrier()"),
    (r"gl\.static_range", "tl.static_range"),
    (r"gl\.num_warps\(\)", "4"),
    (r"row = rw\.to\(tl\.int64\)", "row = tl.full([], rw, tl.int64)"),
    (r"gl\.arange\(0, ([^,]+), layout=(?:gl\.SliceLayout\([^()]*\)|\w+)\)", r"tl.arange(0, \1)"),
    (r"gl\.full\(\[([^\]]+)\], ([^,]+), gl\.float32, \w+\)", r"tl.full([\1], \2, tl.float32)"),
    (r"gl\.zeros\(\[([^\]]+)\], gl\.float32, (?:gl\.SliceLayout\([^()]*\)|\w+)\)", r"tl.zeros([\1], tl.float32)"),
    (r"(\w+)_smem\.index\(slot \* N_CHUNKS \+ i\)\.load\(L1\)",
     r"tl.load(\1_row + i * BLOCK_V + tl.arange(0, BLOCK_V), mask=i * BLOCK_V + tl.arange(0, BLOCK_V) < V, other=0.0)"),
)


def _interpretable(head, tmp_path):
    """``head`` with its kernel file's row-slices kernel mapped onto Triton's language (a module of
    its own, written to ``tmp_path``: the interpreter reads a kernel's source)."""
    k = head.kernel
    text = Path(k.__file__).read_text()
    for pattern, replacement in _GLUON_TO_TRITON:
        text, n = re.subn(pattern, replacement, text)
        assert n, f"the row-slices kernel no longer has {pattern!r}: update the mapping"
    path = tmp_path / f"slices_{k.KEY}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SPEC = k.SPEC
    head._kernel = module
    return head


@pytest.mark.parametrize("make", [
    lambda: _head(lcg.CrossEntropy()),
    lambda: _head(lcg.JSD()),    # two streams, an exact read and its exchange
    pytest.param(lambda: _head(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())),
                 marks=pytest.mark.slow),
    pytest.param(lambda: _head(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4), lcg.ForwardKL(weight=0.5),
                               metrics=(lcg.Entropy(),)), marks=pytest.mark.slow),   # moved sums
], ids=["ce", "jsd", "grpo", "fkl-mix"])
def test_the_row_slices_kernels_phases_at_one_program_a_row_match_float64(make, tmp_path, monkeypatch):
    head = _interpretable(make(), tmp_path)
    ran = []
    monkeypatch.setattr(slices, "interpreting", lambda: False)
    monkeypatch.setattr(slices.SliceKernel, "__call__", lambda self, grid, *args: ran.append(grid) or
                        _SLICE_CALL(self, grid, *args))
    # slices of 4 chunks (64 columns of fp32 or 128 of bf16 each: the lanes' sums run over chunks)
    head.tile_override = tiles.Slices(4096, 1, copy_bytes=8)
    lcg.testing.assert_parity(head, rows=12, vocab=256, device="cpu")
    assert ran, "the row-slices kernel did not run"


_SLICE_CALL = slices.SliceKernel.__call__
