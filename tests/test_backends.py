"""A second backend is a new folder: a stand-in backend package added to ``losscodegen.backends``
(it delegates to Triton's and counts what the runtime asks of it) runs heads with no edit anywhere
else, and the runtime reaches the device only through it (each call's launches come from its
``kernel`` and ``prologue``, backward's scale from its ``scale_rows``)."""
import sys
import textwrap

import pytest
import torch

import losscodegen as lcg
from losscodegen import backends
from losscodegen.testing import assert_parity

STAND_IN = '''
import collections
from pathlib import Path

from losscodegen import backends


class Counting:
    """Triton's backend, each thing the runtime asks of it counted (and its launches too)."""

    name = "counting"

    def __init__(self):
        self.triton = backends.get("triton")
        # its own file is part of what it renders from: its kernels are not the shipped ones
        self.sources = (*self.triton.sources, Path(__file__))
        self.asked = collections.Counter()
        self.launched = collections.Counter()

    def _count(self, what, launchable):
        def launch(grid, *args):
            self.launched[what] += 1
            launchable(grid, *args)
        return launch

    def render(self, *args, **kwargs):
        self.asked["render"] += 1
        return self.triton.render(*args, **kwargs)

    def check_device(self, device):
        self.asked["check_device"] += 1
        self.triton.check_device(device)

    def config(self, *args, **kwargs):
        self.asked["config"] += 1
        return self.triton.config(*args, **kwargs)

    def describe_config(self, state):
        return self.triton.describe_config(state)

    def describe_costs(self, plan):
        return self.triton.describe_costs(plan)

    def kernel(self, fn, fixed, constexprs, options):
        self.asked["kernel"] += 1
        return self._count(fn.__name__.split("_")[0], self.triton.kernel(fn, fixed, constexprs, options))

    def prologue(self, count):
        return self._count("prologue", self.triton.prologue(count))

    def scale_rows(self, grad, upstream):
        self.asked["scale_rows"] += 1
        self.triton.scale_rows(grad, upstream)

    def tune(self, *args):
        raise NotImplementedError


BACKEND = Counting()
'''


# (a kernel folder holds one backend's files: the shipped Triton file of a head is another code
# generator's to the stand-in, which renders its own into the cache and says so)
pytestmark = pytest.mark.filterwarnings("ignore:.*written by another code generator")


@pytest.fixture
def counting(tmp_path, monkeypatch):
    (tmp_path / "counting").mkdir()
    (tmp_path / "counting" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    yield backends.get("counting")
    backends.get.cache_clear()
    sys.modules.pop("losscodegen.backends.counting", None)


def _with(backend, head):
    head.backend = backend      # (what a head's backend option would set)
    return head


def test_a_backend_in_a_new_folder_runs_heads(counting):
    assert isinstance(counting, backends.Backend) and isinstance(backends.get(), backends.Backend)
    head = _with(counting, lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), metrics=(lcg.Entropy(),)))
    assert_parity(head, rows=6, vocab=70)
    assert counting.asked["render"] == 1               # its own kernel file, rendered through it
    calls = counting.launched["prologue"]
    assert calls > 0 and counting.launched["head"] == calls    # one launch of the head's kernel a call
    assert counting.asked["check_device"] >= calls and counting.asked["config"] >= 1
    assert counting.asked["scale_rows"] > 0            # backward's upstream scale


def test_segment_terms_and_linear_heads_launch_through_the_backend(counting):
    head = _with(counting, lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1)))
    assert_parity(head, rows=8, vocab=50)
    assert counting.launched["segments"] > 0
    lin = _with(counting, lcg.HeadLoss(lcg.CrossEntropy()))
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 16, generator=g, requires_grad=True), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (9,), generator=g)
    launches, scales = counting.launched["head"], counting.asked["scale_rows"]
    out = lin.linear(hidden, weight, labels)
    out.loss.backward()
    h = hidden.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h @ weight.double().T, labels)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), h.grad, rtol=1e-4, atol=1e-6)
    assert counting.launched["head"] > launches and counting.asked["scale_rows"] > scales
