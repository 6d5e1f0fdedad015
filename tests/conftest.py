import os
import tempfile

import torch

# Without a GPU the kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Heads not in generated/ are generated into a throwaway cache, never into the user's.
os.environ.setdefault("LOSSCODEGEN_CACHE", tempfile.mkdtemp(prefix="losscodegen-test-"))

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
    """Tests marked ``gpu`` need a CUDA device: skipped without one (CI), run on the lent GPU."""
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
