import os
import sys
import tempfile
from pathlib import Path

import torch

# The tests live in one folder per stage (compiler/, runtime/, integrations/, gpu/); the helpers they
# share (helpers.py, reference.py, contract_reference.py, this file) stay here, importable by name from
# any of them, whatever pytest's import mode (spawned ranks inherit sys.path).
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Without a GPU the kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Heads not in generated/ are generated into a throwaway cache, never into the user's.
os.environ.setdefault("LOSSCODEGEN_CACHE", tempfile.mkdtemp(prefix="losscodegen-test-"))

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTEGRATIONS = Path(__file__).resolve().parent / "integrations"


@pytest.fixture
def device():
    return DEVICE


def use_backend(name: str) -> None:
    """Heads built with backend="auto" (the default) get backend ``name`` in this process (what
    the ``backend`` fixture sets, and a test's spawned ranks through LOSSCODEGEN_TEST_BACKEND)."""
    from losscodegen import backends
    resolve = backends.resolve
    backends.resolve = lambda option: name if option == "auto" else resolve(option)


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """A test run once with each backend: heads it builds with the default backend="auto" get it."""
    from losscodegen import backends
    monkeypatch.setattr(backends, "resolve", backends.resolve)   # (undone after the test)
    monkeypatch.setenv("LOSSCODEGEN_TEST_BACKEND", request.param)
    use_backend(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _nan_workspace(monkeypatch):
    """Every call's workspace starts as NaN, not as whatever memory held: a kernel that reads a slot
    the prologue does not zero before writing it fails the test's comparison."""
    from losscodegen import launch
    monkeypatch.setattr(launch, "workspace", lambda size, device: torch.full((size,), float("nan"), device=device))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped without one (CI), run on the lent GPU. Tests
    marked ``cpu`` (a test, or a whole file) run CPU tensors through the Triton backend, which takes
    them only in Triton's interpreter (chosen above, before triton is imported, only where there is
    no GPU): skipped where there is a GPU, unless marked ``gpu`` too; CI runs them. Every other test
    takes its tensors to ``device`` (or DEVICE), or spawns gloo ranks (helpers.run_ranks); the
    integration tests (tests/integrations/) are all ``cpu``."""
    for item in items:
        if INTEGRATIONS in item.path.parents:   # tiny models built on the CPU, as the docs show them
            item.add_marker(pytest.mark.cpu)
        if DEVICE != "cuda" and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif DEVICE == "cuda" and item.get_closest_marker("cpu") and not item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="runs CPU tensors in Triton's interpreter: CI runs it"))
