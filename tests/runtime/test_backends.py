"""A backend is a folder: the torch backend (``losscodegen/backends/torch/``, a second renderer and
template, no edit of the runtime) runs heads, and the runtime reaches the device only through it
(each call's launches come from its ``kernel`` and ``prologue``, backward's scale from its
``scale_rows``), counted here."""
import collections

import pytest
import torch

import losscodegen as lcg
from losscodegen import backends
from losscodegen import symbols as S
from losscodegen.testing import assert_parity
import reference as R


@pytest.fixture
def counting(monkeypatch, tmp_path):
    """The torch backend, each thing the runtime asks of it counted (and its launches too), with
    no kernel file of it yet (an empty cache, none loaded in this process)."""
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(lcg.load, "_modules", {})
    torch_backend = backends.get("torch")
    asked, launched = collections.Counter(), collections.Counter()

    def count(name, kind=None):
        original = getattr(torch_backend, name)

        def counted(*args, **kwargs):
            asked[name] += 1
            out = original(*args, **kwargs)
            if kind is None:
                return out
            what = kind(args)

            def launch(grid, *launch_args):
                launched[what] += 1
                out(grid, *launch_args)
            return launch
        monkeypatch.setattr(torch_backend, name, counted)
    for name in ("render", "check_device", "config", "scale_rows"):
        count(name)
    count("kernel", lambda args: args[0].__name__.split("_")[0])
    count("prologue", lambda args: "prologue")
    return asked, launched


def test_both_backends_are_backends():
    for name in ("triton", "torch"):
        assert isinstance(backends.get(name), backends.Backend) and backends.get(name).name == name


def test_a_backend_in_its_own_folder_runs_heads(counting):
    asked, launched = counting
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), metrics=(lcg.Entropy(),), backend="torch")
    assert_parity(head, rows=6, vocab=70)
    assert asked["render"] == 1                       # its own kernel file, rendered through it
    calls = launched["prologue"]
    assert calls > 0 and launched["head"] == calls    # one launch of the head's kernel a call
    assert asked["check_device"] >= calls and asked["config"] >= 1
    assert asked["scale_rows"] > 0                    # backward's upstream scale


def test_segment_terms_and_linear_heads_launch_through_the_backend(counting):
    asked, launched = counting
    head = lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1), backend="torch")
    assert_parity(head, rows=8, vocab=50)
    assert launched["segments"] > 0
    lin = lcg.HeadLoss(lcg.CrossEntropy(), backend="torch")
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 16, generator=g, requires_grad=True), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (9,), generator=g)
    launches, scales = launched["head"], asked["scale_rows"]
    out = lin.linear(hidden, weight, labels)
    out.loss.backward()
    h = hidden.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h @ weight.double().T, labels)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), h.grad, rtol=1e-4, atol=1e-6)
    assert launched["head"] > launches and asked["scale_rows"] > scales


def test_each_backend_writes_its_own_file():
    """One head, two kernel files: the Triton one (the package's generated/, by its key) and the torch
    one (the cache, ``head_loss_<key>_torch.py``), each stamped with its own code generator."""
    triton_head = lcg.HeadLoss(lcg.CrossEntropy(), backend="triton")
    torch_head = lcg.HeadLoss(lcg.CrossEntropy(), backend="torch")
    assert triton_head.key == torch_head.key
    assert triton_head.kernel is not torch_head.kernel
    assert torch_head.kernel.CODEGEN == lcg.load.codegen_version(torch_head.backend) \
        != lcg.load.codegen_version(triton_head.backend)
    # the runtime's contract, written by both templates from the same plan
    _same_contract(triton_head.kernel, torch_head.kernel)


def _same_contract(triton_kernel, torch_kernel) -> None:
    # every constant the runtime reads, as load read them (interface.FileSpec; those that follow from the
    # others, LOSS, COUNT, DONE, FIXED_SLOTS and HAS_EXACT, checked against them there)
    assert torch_kernel.SPEC == triton_kernel.SPEC


_l = S.target_logit - S.lse


@pytest.mark.parametrize("formula", [
    (_l - S.segment_mean(_l)) ** 2 * S.token("advantages"),                  # a row term of segment statistics
    -S.segment_sum(_l) / S.segment_count,                                     # a segment term
    S.row_max ** 2,                                                           # the row max (argmax gradient)
    S.vsum(S.vector("prior") * (S.lse - S.logit)),                            # a per-class vector
], ids=["row_segment", "segment_sum", "row_max", "vector"])
def test_both_backends_write_one_contract_for_each_construct(formula):
    """interface.KernelSpec is the file's contract for both backends: every constant the runtime reads
    (segment row terms, vectors and the segment kernel's interface included) is the same."""
    term = lcg.declare_term("t", formula)
    _same_contract(lcg.HeadLoss(term(), lcg.CrossEntropy(), backend="triton").kernel,
                   lcg.HeadLoss(term(), lcg.CrossEntropy(), backend="torch").kernel)


def test_backend_option_is_validated_naming_it():
    with pytest.raises(ValueError, match="backend"):
        lcg.HeadLoss(lcg.CrossEntropy(), backend="cuda")
