"""Stage 5, load: find the kernel module of a head, else generate it into the cache.

A kernel file is named by a hash of its spec (the bound formulas and the options that change code)
and records the code generator that wrote it (``CODEGEN``: a hash of the compiler stages' sources,
its backend's (``Backend.sources``: its renderer and template) and the sympy version). Folders are
searched in order:

1. ``LOSSCODEGEN_KERNELS=DIR[:DIR...]``: a downstream project's build-time kernels (read-only);
2. the kernels built into the package (``losscodegen/generated``, from the repository's generated/);
3. the cache, ``$LOSSCODEGEN_CACHE/<CODEGEN>/`` (default under the user cache), where a head found
   nowhere else is generated at first use.

A file in 1 or 2 written by another code generator is never used: the kernel is generated into the
cache, with one warning naming the stale file. A loaded module's constants are read once into its
``SPEC`` (``interface.FileSpec``), what the runtime reads of it: a file lacking one is an error naming
it. Every kernel file ends with the hash of its text
(``TEXT_HASH``, ``interface.seal``): a cache file that does not match it is generated again, with one
warning naming it; in folders 1 and 2 a mismatch is an error naming the file.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable

import sympy as sp

from . import backends
from .interface import FileSpec, intact
from .resources import GENERATED

_PACKAGE = Path(__file__).resolve().parent
# The compiler stages' sources: a change to any of them (or to the backend's) may change what the
# code generator writes. (Not terms.py: a kernel's key hashes its bound formulas, so a new built-in
# re-stamps nothing.)
_CODEGEN_SOURCES = ("symbols.py", "lower.py", "derive.py", "stable.py", "plan.py", "interface.py", "emit.py", "program.py")
_CODEGEN_LINE = re.compile(r'^CODEGEN = "([0-9a-f]+)"$', re.M)




def codegen_version(backend: backends.Backend | None = None) -> str:
    """The CODEGEN of the files ``backend`` (None: the default one) writes."""
    return _codegen_version(backend or backends.get())


@functools.lru_cache(maxsize=None)
def _codegen_version(backend: backends.Backend) -> str:
    h = hashlib.sha256(sp.__version__.encode())
    for path in [_PACKAGE / name for name in _CODEGEN_SOURCES] + list(backend.sources):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def kernel_key(spec_text: str) -> str:
    return hashlib.sha256(spec_text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    env = os.environ.get("LOSSCODEGEN_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "losscodegen"


def kernel_dirs() -> list[Path]:
    """Folders of prebuilt kernels, in the order they are searched (before the cache)."""
    extra = [Path(d) for d in os.environ.get("LOSSCODEGEN_KERNELS", "").split(os.pathsep) if d]
    return extra + [GENERATED]


def file_name(key: str, backend: backends.Backend | None = None) -> str:
    """A kernel file's name: ``head_loss_<key>.py`` for the default backend's (the generated/ ones),
    ``head_loss_<key>_<backend>.py`` for another's (a folder may hold both)."""
    suffix = "" if backend is None or backend.name == backends.DEFAULT else f"_{backend.name}"
    return f"head_loss_{key}{suffix}.py"


def codegen_of(path: Path) -> str | None:
    """The CODEGEN a kernel file records (read, not imported)."""
    found = _CODEGEN_LINE.search(path.read_text(errors="replace"))
    return found.group(1) if found else None


_warned: set[Path] = set()


def module_path(key: str, backend: backends.Backend | None = None) -> Path:
    """The file that serves ``key``: a current one from a kernel folder, else its place in the cache."""
    current = codegen_version(backend)
    for folder in kernel_dirs():
        path = folder / file_name(key, backend)
        if path.exists():
            found = codegen_of(path)
            if found in (current, None):
                # (no CODEGEN line at all: empty, binary or cut short, not another generator's)
                if not intact(path.read_bytes()):
                    raise RuntimeError(
                        f"losscodegen: {path} does not match the hash of its text (TEXT_HASH): it was "
                        "truncated, edited or damaged. Kernel folders are read-only to losscodegen: "
                        "regenerate it (`python -m losscodegen generate --manifest MANIFEST --out "
                        f"{folder}`; the package's own kernels: reinstall losscodegen) or delete it.")
                return path
            _warn_once(path, f"losscodegen: {path} was written by another code generator (CODEGEN "
                             f"{found}, running {current}); generating this head into the cache instead. "
                             "Regenerate that folder with `python -m losscodegen generate`.")
    return cache_dir() / current / file_name(key, backend)


def _warn_once(path: Path, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(message, stacklevel=5)


def write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one: processes
    writing the same file at once leave one valid file, and a write that fails leaves no temporary
    file behind. Raises ``OSError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())     # (the new name never points at data still in flight)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        # a full disk or an interrupt: no half-written .tmp left in the folder for ever
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, text: str) -> None:
    """``write_file`` into the cache: an error names LOSSCODEGEN_CACHE."""
    try:
        write_file(path, text)
    except OSError as e:
        raise RuntimeError(
            f"losscodegen cannot write {path} ({e.strerror or e}). Kernels not built into the package "
            f"are generated at first use into LOSSCODEGEN_CACHE (now {cache_dir()}): point it at a "
            "writable folder, or generate the heads at build time (python -m losscodegen generate "
            "--out DIR) and list DIR in LOSSCODEGEN_KERNELS.") from e


_modules: dict[tuple[str, str], ModuleType] = {}   # by backend and key


def load(key: str, generate: Callable[[], str], backend: backends.Backend | None = None) -> ModuleType:
    """The kernel module for ``key`` written by ``backend`` (None: the default one); ``generate()``
    returns its source (the backend's rendering) when no file serves it."""
    backend = backend or backends.get()
    if (backend.name, key) in _modules:
        return _modules[backend.name, key]
    path = module_path(key, backend)
    if not path.exists():
        write_atomic(path, generate())
    elif path.parent.parent == cache_dir() and not intact(path.read_bytes()):
        # a cache file cut short or edited: never run, written again
        _warn_once(path, f"losscodegen: {path} does not match the hash of its text (TEXT_HASH): it was "
                         "truncated, edited or damaged; generating it again.")
        write_atomic(path, generate())
    name = f"losscodegen_kernels.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (a jit decorator may read the source through it: triton.jit does)
    spec.loader.exec_module(module)
    try:
        # the file's contract, read once: the runtime reads its fields, never a constant by name
        module.SPEC = FileSpec.read(module)
    except ValueError as e:
        raise RuntimeError(f"losscodegen: {path} is no kernel file this version reads: {e}. Regenerate it "
                           "(`python -m losscodegen generate`), or delete it from the cache.") from None
    _modules[backend.name, key] = module
    return module
