"""Compile every kernel a head launches for an H100 (sm_90), on a machine without a GPU.

Run as a script (tests/gpu/test_gpu_compile.py and tests/compiler/test_refusals.py do) without
TRITON_INTERPRET: each launch is compiled by Triton for sm_90 instead of being run, so what the
interpreter accepts but the GPU compiler refuses (a non-constexpr global, a type that changes inside a
loop) fails here, in CI. The heads are called with CPU tensors; their outputs are meaningless, since no
kernel runs.

    python bench/sm90_compile.py [manifest]     prints one line per compiled kernel variant
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
compiled: list[str] = []


def _compile_instead(self, *args, grid, warmup, **kwargs):
    """JITFunction.run for a machine without a GPU: bind the arguments as Triton would, compile
    for sm_90, launch nothing."""
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, specialization, options)
    triton_compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    flags = "+".join(k for k, v in kwargs.items() if v is True)
    compiled.append(f"{self.__name__} [{flags}]")


class _FakeExchange:
    """Stands in for symmetric memory (which needs GPUs): the launch is compiled, never run."""

    def next(self, rows, columns):
        return torch.zeros(rows * columns), torch.zeros(2, dtype=torch.int64), 1


def main(manifest: Path) -> None:
    JITFunction.run = _compile_instead
    from losscodegen import backends
    from losscodegen.backends.triton import dispatch, helpers
    # the Triton backend, which "auto" picks only where it can run (here it compiles, never runs)
    backends.resolve = lambda name: "triton" if name == "auto" else name
    # every launch through the JIT (its direct path needs a compiled kernel and a GPU)
    dispatch.Kernel.__call__ = dispatch.Kernel.jit
    helpers.INTERPRETED = True   # (CPU tensors without the interpreter: compiled, never run)
    import torch.distributed as dist

    from losscodegen import collectives
    from losscodegen.__main__ import manifest_heads
    from losscodegen.testing import random_inputs
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    for line, head in manifest_heads(manifest):
        logits, y, kw = random_inputs(head, rows=8, vocab=64)
        x = logits.requires_grad_()
        head(x, y, **kw).loss.backward()                                  # one device, gradient
        with torch.no_grad():
            head(x, y, **kw)                                               # values only
        head(x, y, process_group=dist.group.WORLD, **kw).loss.backward()  # vocab-parallel
        with mock.patch.object(collectives, "exchange", lambda group, device: _FakeExchange()):
            head(x, y, process_group=dist.group.WORLD, **kw).loss.backward()  # ... exchanging in-kernel
        print(f"{line}: {len(compiled)} kernels so far", flush=True)
    dist.destroy_process_group()
    print("\n".join(sorted(set(compiled))))


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "generated" / "manifest")
