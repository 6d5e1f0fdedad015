"""Stage 5, load: find the kernel module for a spec in ``generated/``, else generate it into the cache.

A kernel's file name is a content hash of the spec (the bound formulas and the options that change
code) and of the code generator itself (its sources, the template, the sympy version), so a file
can never be stale: a different compiler gives a different name.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable

import sympy as sp

_PACKAGE = Path(__file__).resolve().parent
GENERATED = _PACKAGE.parent / "generated"
_CODEGEN_SOURCES = ("symbols.py", "terms.py", "lower.py", "plan.py", "emit.py")


@functools.lru_cache(maxsize=None)
def codegen_version() -> str:
    h = hashlib.sha256(sp.__version__.encode())
    for name in _CODEGEN_SOURCES:
        h.update((_PACKAGE / name).read_bytes())
    h.update((_PACKAGE.parent / "templates" / "head_loss.py.j2").read_bytes())
    return h.hexdigest()[:12]


def kernel_key(spec_text: str) -> str:
    return hashlib.sha256(f"{codegen_version()}\n{spec_text}".encode()).hexdigest()[:16]


def cache_dir() -> Path:
    env = os.environ.get("LOSSCODEGEN_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "losscodegen"


def module_path(key: str) -> Path:
    """Where the kernel for ``key`` is, or will be written (generated/ wins over the cache)."""
    committed = GENERATED / f"head_loss_{key}.py"
    return committed if committed.exists() else cache_dir() / f"head_loss_{key}.py"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


_modules: dict[str, ModuleType] = {}


def load(key: str, generate: Callable[[], str]) -> ModuleType:
    """The kernel module for ``key``; ``generate()`` returns its source when no file has it yet."""
    if key in _modules:
        return _modules[key]
    path = module_path(key)
    if not path.exists():
        write_atomic(path, generate())
    name = f"losscodegen_kernels.head_loss_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # triton.jit reads the source through the module
    spec.loader.exec_module(module)
    _modules[key] = module
    return module
