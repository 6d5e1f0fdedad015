"""Launching a jitted kernel with little host work.

``kernel[grid](*args, **constexprs)`` spends most of its time in Triton's Python: it binds and
specialises every argument and builds a cache key from them, each call. On the H100 machine that is
36 µs for the head's kernel, of which the launch itself (Triton's C launcher) takes 10. A ``Kernel``
keeps what its launches compiled, keyed by what Triton specialises on that can change between calls:
each tensor's dtype and 16-byte alignment, which arguments are None, each integer's class (1, a
multiple of 16, 32 or 64 bits). A launch whose key it knows calls the compiled kernel's launcher
directly, with the arguments Triton itself gives it; one it does not know goes through
``kernel[grid]``, which compiles or finds the kernel, and is kept. Under Triton's interpreter every
launch goes through ``kernel[grid]``.

A register cap (the launch option ``maxnreg``, from the tile table) is measured on the heads of one
plan state and applies to every head of it: a heavier kernel can spill under it. A kernel whose
first binary spills more than ``SPILL_LIMIT`` registers a thread under the cap runs uncapped from
its next launch on.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import triton
from triton import knobs
from triton.runtime.jit import JITFunction


# Triton's interpreter patches triton.language while it runs a kernel: two threads interpreting at
# once break each other (InterpreterError), so interpreted launches run one at a time.
_INTERPRETING = threading.Lock()

# Registers a thread spills (Triton's n_spills: ptxas's local memory, in 4-byte words) past which a
# cap is dropped. Under caps of 64, ptxas for sm_90 (Triton 3.6) spills 8 for CE + z + entropy +
# accuracy's 16-warp tile, 8 for JSD's and 6 for the FKL mix's 8-warp tiles, which ran 2.5-6%, 4%
# and 1% faster capped on an H200; and 108 for the forward KL's 16-warp tile, 3.6x slower there
# (docs/performance.md, 2026-11-29).
SPILL_LIMIT = 32


def _spec(arg: Any) -> Any:
    # What Triton's specialisation of an argument depends on. A key finer than Triton's own only
    # keeps the same compiled kernel under two keys; a coarser one would be a wrong launch.
    if arg is None:
        return None
    cls = arg.__class__
    if cls is int:
        return arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31, arg < 2**63
    if cls is float or cls is bool:
        return cls
    return arg.dtype, arg.data_ptr() % 16 == 0        # a tensor


@contextlib.contextmanager
def _tree_sums() -> Iterator[None]:
    """Triton's interpreter summing a block as a GPU does, pairwise, while one of our kernels runs.
    Its ``tl.sum`` is numpy's, which adds along any axis but the last one element after another: the
    tile sums of a joined ``[BLOCK_V, 2, ...]`` tile (render.py's one reduction for all of a read's
    sums) then lose a half-ulp of their largest element for each small one added to it, up to
    ``BLOCK_V`` of them (a row of one finite logit under softcap: 60 elements of 3e-7 beside 0.6,
    an error of 1.7e-6, 9 times plain torch's; found by the fuzzer). A GPU sums a tile as a tree,
    as torch does: numpy's pairwise summation along a contiguous axis is that order of error, so
    that the CPU measures the kernel's arithmetic, not the emulator's order of additions."""
    import numpy
    from triton.runtime import interpreter
    ops = getattr(interpreter, "ReduceOps", None)
    plain = getattr(ops, "sum", None)
    if plain is None:       # (an interpreter laid out otherwise sums as it does)
        yield
        return

    def pairwise(self, input):
        data = input.handle.data
        if self.axis is None:
            total = numpy.sum(data.ravel())
            if self.keep_dims:
                total = numpy.reshape(total, (1,) * data.ndim)
        else:
            total = numpy.ascontiguousarray(numpy.moveaxis(data, self.axis, -1)).sum(-1)
            if self.keep_dims:
                total = numpy.expand_dims(total, self.axis)
        return self.to_tensor(numpy.asarray(total, dtype=data.dtype), input.dtype)
    ops.sum = pairwise
    try:
        yield
    finally:
        ops.sum = plain


class Kernel:
    """A jitted kernel launched over a 1-D grid: its last parameters are the constexprs (and launch
    options) given here by name; before them, the ``fixed`` values, the same at every launch (not
    part of the key); before those, the arguments of each launch, by position."""

    def __init__(self, fn: JITFunction, *fixed: Any, **constexprs: Any) -> None:
        self.fn, self.fixed, self.constexprs = fn, fixed, constexprs
        self._compiled: dict[tuple, Any] = {}
        self._direct = isinstance(fn, JITFunction)    # (not under the interpreter)
        if self._direct:
            names = fn.arg_names
            n_const = sum(n in constexprs for n in names)
            if any(n not in constexprs for n in names[len(names) - n_const:]):
                raise TypeError(f"{fn.__name__}: constexprs {sorted(constexprs)} must be its last parameters")
            self._positional = len(names) - n_const - len(fixed)
            self._tail = fixed + tuple(constexprs[n] for n in names[len(names) - n_const:])

    def jit(self, grid: int, *args: Any) -> Any:
        """A launch through Triton's JIT (which compiles, or finds, the kernel it returns)."""
        return self.fn[(grid,)](*args, *self.fixed, **self.constexprs)

    def __call__(self, grid: int, *args: Any) -> None:
        if not self._direct:
            import numpy   # (the interpreter's own dependency)
            # The interpreter computes each block in numpy, padded lanes and the side of a tl.where
            # that is not taken included (-inf - -inf, log(0)): numpy's warnings of that arithmetic,
            # which the kernel means, would read like errors in a user's output. A wrong value still
            # shows in the outputs, as on a GPU (which has no such warnings); numpy elsewhere still warns.
            with _INTERPRETING, numpy.errstate(all="ignore"), _tree_sums():
                self.jit(grid, *args)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        key = (device, *map(_spec, args))
        kernel = self._compiled.get(key)
        if kernel is None:
            if len(args) != self._positional:
                raise TypeError(f"{self.fn.__name__} takes {self._positional} arguments before its "
                                f"constexprs, got {len(args)}")
            kernel = self.jit(grid, *args)
            if self.constexprs.get("maxnreg") is not None and _spills(kernel) > SPILL_LIMIT:
                # (this launch ran, slower but right; every later one compiles without the cap)
                self.constexprs = {k: v for k, v in self.constexprs.items() if k != "maxnreg"}
                self._compiled.clear()
                return
            # (a Triton whose compiled kernel has no launcher of this form launches through the JIT)
            self._compiled[key] = kernel if hasattr(kernel, "packed_metadata") else False
            return
        if kernel is False:
            self.jit(grid, *args)
            return
        stream = driver.get_current_stream(device)
        args += self._tail
        enter, exit_ = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
        # (a profiler's hooks see these launches too)
        metadata = None if enter is None and exit_ is None else kernel.launch_metadata((grid, 1, 1), stream, *args)
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata, enter, exit_, *args)


def _spills(kernel: Any) -> int:
    """Registers a thread of a compiled kernel spills (0 where Triton does not say)."""
    getattr(kernel, "_init_handles", lambda: None)()     # (n_spills is read when the binary loads)
    return getattr(kernel, "n_spills", 0)


def _hook(hook: Any) -> Any:
    # None where no hook is set. Triton >= 3.7 keeps the hooks in a chain, empty unless a profiler
    # added one: passing an empty chain would build launch metadata and call it at every launch.
    return None if hook is None or getattr(hook, "calls", None) == [] else hook
