"""Backends: what turns the neutral plan into a kernel file, and launches that file's kernels.

The compiler stages (symbols, terms, lower, plan, interface, emit) know no backend: the ``Plan``
(plan.py) is the neutral IR, interface.py declares what every backend's file takes and records (the
kernel interface ``interface.signatures`` checked by ``interface.check_interface``, the file's
contract, the flag slots, the seal), and emit.py what every backend prints (the phases, the header).
A backend is one subpackage, ``losscodegen/backends/<name>/``, whose ``BACKEND`` is a ``Backend``: it
renders a plan into the source of a Python module (the kernel file, with the constants its template writes from the
plan: ``ARGS``, ``FIXED``, ``CONSTEXPRS``, ``COLUMNS``...), names the files its rendering depends on
(hashed into the file's ``CODEGEN`` by load.py, which finds or writes and imports the file), and
launches the module's kernels with the arguments the runtime gives by the declared names. The runtime
(head.py, inputs.py, launch.py, linear.py, autograd.py, load.py, __main__.py) reaches a backend only
through a head's ``backend`` (``get()``) and never imports one's modules, nor what it is written in.

Two backends ship: ``triton`` (CUDA, or Triton's interpreter) and ``torch`` (any device, no Triton
needed). A head's ``backend="auto"`` is ``resolve``d to one of them in each process.
"""
from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..emit import KernelSource
    from ..plan import Plan

# the backend whose kernel files ``python -m losscodegen generate`` writes (the package's generated/)
DEFAULT = "triton"
# the templates (in the package's templates/) that every backend's template includes: the file's
# constants written from its KernelSpec. Each backend lists them among its ``sources``.
SHARED_TEMPLATES = ("_spec_constants.j2",)
NAMES = ("auto", "triton", "torch")


class Launchable(Protocol):
    """A kernel of a generated module with its fixed arguments and constexprs bound, launched over a
    1-D grid with each launch's own arguments (its ``ARGS``), in their declared order."""

    def __call__(self, grid: int, *args: Any) -> None: ...


class Config(Protocol):
    """A call's launch configuration (the runtime's choice, never hashed into a kernel)."""

    split: bool     # run the reads of a call as a launch each (plan.launch_sequence's ``split``)
    kernel: str     # which of the file's kernels it launches (interface.Signature.kind); a "slices"
                    # configuration has a ``fallback`` for the calls its kernel does not serve

    def launch(self, V: int, element_size: int) -> dict[str, Any]:
        """``BLOCK_V`` (a constexpr of the head's kernel) and the backend's launch options, for a
        vocabulary of V a rank and logits of ``element_size`` bytes."""
        ...


@runtime_checkable
class Backend(Protocol):
    name: str
    sources: tuple[Path, ...]   # what its rendering reads besides the compiler stages (CODEGEN)
    exchange: bool              # whether its kernels can exchange vocab shards' stats in-kernel

    def render(self, plan: Plan, key: str, header: str, codegen: str,
               normalize: Mapping[str, str] | None = None) -> KernelSource:
        """The kernel file of ``plan``: its kernels take the interface of ``interface.signatures``."""
        ...

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError, saying what to do, for inputs on a device its kernels cannot run on."""
        ...

    def config(self, head: Any, k: ModuleType, V: int, dtype: torch.dtype, device: torch.device, *,
               sharded: bool) -> Config:
        """The launch configuration of a call of ``head`` (kernel module ``k``) over V vocabulary
        columns a rank of ``dtype`` logits."""
        ...

    def describe_config(self, plan: Plan) -> str:
        """For ``explain()``: the configuration chosen for a large vocabulary, and how."""
        ...

    def describe_costs(self, plan: Plan) -> str:
        """For ``explain()`` and the kernel header: what each read costs per vocabulary element."""
        ...

    def kernel(self, fn: Any, fixed: list[Any], constexprs: dict[str, Any], options: dict[str, Any]) -> Launchable:
        """Kernel ``fn`` of a generated module, its ``FIXED`` values (in order) and constexprs bound."""
        ...

    def prologue(self, count: bool) -> Launchable:
        """The one-program prologue of a call: ``(1, ws, n_zero, labels, mask, n_rows, ignore_index,
        count_slot)`` zeroes the workspace's first ``n_zero`` slots and, with ``count``, stores the
        number of valid rows at ``count_slot``."""
        ...

    def scale_rows(self, grad: torch.Tensor, upstream: torch.Tensor) -> None:
        """``grad`` [rows, V] times ``upstream`` (a scalar, or one value a row), in place."""
        ...

    def tune(self, heads: list[Any], vocabs: list[int], device: torch.device, rows: int,
             out: Path | None) -> None:
        """``python -m losscodegen tune``: measure launch configurations on this device."""
        ...


@functools.cache
def get(name: str = DEFAULT) -> Backend:
    """The backend ``losscodegen/backends/<name>/`` (its ``BACKEND``); only that folder is imported."""
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def resolve(name: str) -> str:
    """A head's ``backend=`` option as a backend's name: ``"auto"`` is Triton where it can run (a
    CUDA device, or Triton's interpreter with TRITON_INTERPRET=1, and triton importable), torch
    elsewhere: on a ROCm build of torch too, whose "cuda" device is an AMD GPU, for which the Triton
    kernels compile but have never run (docs/api.md, "Portable builds"): ``backend="triton"`` asks for them."""
    if name not in NAMES:
        raise ValueError(f"backend must be one of {NAMES}, got {name!r}")
    if name != "auto":
        return name
    import torch
    if not (torch.cuda.is_available() or _interpreting()) or (torch.version.hip and not _interpreting()):
        return "torch"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "torch"
    return "triton"
