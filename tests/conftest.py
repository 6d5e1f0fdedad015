import os
import sys
import tempfile
from pathlib import Path

import torch

# The tests live in one folder per stage (compiler/, runtime/, integrations/, gpu/); the helpers they
# share (helpers.py, reference.py, this file) stay here, importable by name from
# any of them, whatever pytest's import mode (spawned ranks inherit sys.path).
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Without a GPU the kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Heads not in generated/ are generated into a throwaway cache, never into the user's (one for the
# session: its ranks, which import this file again, inherit it).
if "LOSSCODEGEN_CACHE" not in os.environ:
    os.environ["LOSSCODEGEN_CACHE"] = tempfile.mkdtemp(prefix="losscodegen-test-")


def patch_triton_language_once_a_launch() -> None:
    """Triton's interpreter patches triton.language for the interpreter when it starts a launch
    (``_patch_lang``, undone when the launch ends), and again at every call of a ``@triton.jit``
    helper from inside the kernel, for every program of the grid: the same patches, already in place
    (their builtins are the interpreter's wrappers by then, and the attributes it sets are set
    again to the same functions), each time scanning the modules with ``inspect.getmembers``. That
    scan was a third of the time the fuzzer's slice spent in the interpreter. Inside a launch, a
    helper's call whose modules the launch (or an earlier helper in it) already patched now skips
    it; the launch itself, and a helper that sees a module not yet patched in it (triton.language's
    own helpers see triton.language.core), patch as Triton does. The kernels run the same code,
    with the same results to the bit. (Processes the tests start as a user starts them, and the
    fuzzer's own ranks, interpret as Triton does.)"""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or not hasattr(interpreter, "_LangPatchScope") \
            or getattr(patch_lang, "once_a_launch", False):
        return      # (a Triton whose interpreter is laid out otherwise runs as it is; or done already)
    run = executor.__call__
    # the modules the running launch and its helpers patched (None: none yet); [] outside a launch
    launches: list[set | None] = []

    def modules(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    def once_a_launch(fn):
        langs = modules(fn)
        if launches and launches[-1] is not None and langs <= launches[-1]:
            return interpreter._LangPatchScope()      # (a helper's call: nothing to patch again)
        scope = patch_lang(fn)
        if launches:    # (the launch's own patch, or a helper's of a module it had not patched)
            launches[-1] = langs | (launches[-1] or set())
        return scope
    once_a_launch.once_a_launch = True
    interpreter._patch_lang = once_a_launch
    executor.__call__ = launch


patch_triton_language_once_a_launch()

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


BACKENDS = ("triton", "torch")


def pytest_addoption(parser):
    parser.addoption("--all-backends", action="store_true",
                     help="run each case of a test that takes the backend fixture on every backend (by default "
                          "each case runs on one, the backends taking turns, as do the tests of one case)")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """A test run with each backend: heads it builds with the default backend="auto" get it. Its
    cases take turns (the first on Triton, the next on torch...), each on one backend, as do the tests
    of one case, unless pytest runs with --all-backends (``_one_backend_a_case``); the fuzzer
    (tests/runtime/test_fuzz.py) runs each random head on both."""
    from losscodegen import backends
    monkeypatch.setattr(backends, "resolve", backends.resolve)   # (undone after the test)
    monkeypatch.setenv("LOSSCODEGEN_TEST_BACKEND", request.param)
    use_backend(request.param)
    return request.param


@pytest.fixture(scope="session")
def _fuzz_pool():
    pool: dict = {}
    yield pool
    if "ranks" in pool:
        pool["ranks"].close()


@pytest.fixture
def fuzz_ranks2(_fuzz_pool):
    """The fuzzer's pool of two gloo ranks (``losscodegen.fuzz.Ranks``), kept for the session as the
    fuzzer keeps it between cases: a pool starts two fresh interpreters, each importing torch and
    losscodegen again (seconds of the suite on 2 busy cores). Started again where a rank is gone (a
    hang closes the pool: ``Ranks.run``), so that one test's hang is not every later test's."""
    from losscodegen import fuzz
    ranks = _fuzz_pool.get("ranks")
    if ranks is None or not all(p.is_alive() for p in ranks.procs):
        ranks = _fuzz_pool["ranks"] = fuzz.Ranks(2)
    return ranks


@pytest.fixture(autouse=True)
def _nan_workspace(monkeypatch):
    """Every call's workspace starts as NaN, not as whatever memory held: a kernel that reads a slot
    the prologue does not zero before writing it fails the test's comparison."""
    from losscodegen import launch
    monkeypatch.setattr(launch, "workspace", lambda size, device: torch.full((size,), float("nan"), device=device))


def _one_backend_a_case(items) -> list:
    """The items that take the ``backend`` fixture and are not run: of a test with several cases,
    each case's items but the one on BACKENDS[k % 2], k its place among the test's cases; of a test
    with one case, the items but the one on BACKENDS[t % 2], t its place among such tests (running
    each on both cost the suite minutes on CI's 2 cores; ``--all-backends``, which the GPU runs use,
    and the fuzzer's slice still run both)."""
    cases: dict[tuple, dict[tuple, list]] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or "backend" not in spec.params or _names_backend(item):
            continue
        # (a case by its other parameters' values, the same objects on each backend)
        case = tuple(sorted((name, id(value)) for name, value in spec.params.items() if name != "backend"))
        cases.setdefault((item.path, item.originalname), {}).setdefault(case, []).append(item)
    dropped = []
    one_case = 0
    for by_case in cases.values():
        turns = range(len(by_case)) if len(by_case) > 1 else [one_case]
        one_case += len(by_case) == 1
        for k, case_items in zip(turns, by_case.values()):
            kept = [i for i in case_items if i.callspec.params["backend"] == BACKENDS[k % len(BACKENDS)]]
            dropped += [i for i in case_items if kept and i not in kept]
    return dropped


def _names_backend(item) -> bool:
    """Whether the test chooses its cases' backends itself (``parametrize("...,backend", ...,
    indirect=...)``): those run as written."""
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0]
        if "backend" in [n.strip() for n in names]:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped without one (CI), run on the lent GPU. Tests
    marked ``cpu`` (a test, or a whole file) run CPU tensors through the Triton backend, which takes
    them only in Triton's interpreter (chosen above, before triton is imported, only where there is
    no GPU): skipped where there is a GPU, unless marked ``gpu`` too; CI runs them. Every other test
    takes its tensors to ``device`` (or DEVICE), or spawns gloo ranks (helpers.run_ranks); the
    integration tests (tests/integrations/) are all ``cpu``. And the ``backend`` fixture's cases
    take turns (``_one_backend_a_case``), unless --all-backends."""
    if not config.getoption("--all-backends"):
        dropped = set(_one_backend_a_case(items))
        if dropped:
            config.hook.pytest_deselected(items=[i for i in items if i in dropped])
            items[:] = [i for i in items if i not in dropped]
    for item in items:
        if INTEGRATIONS in item.path.parents:   # tiny models built on the CPU, as the docs show them
            item.add_marker(pytest.mark.cpu)
        if DEVICE != "cuda" and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif DEVICE == "cuda" and item.get_closest_marker("cpu") and not item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="runs CPU tensors in Triton's interpreter: CI runs it"))
