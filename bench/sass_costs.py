"""What each read of a head's kernel costs per vocabulary element in the GPU's own instructions:
the kernel compiled for an H100 (sm_90) on a machine without a GPU, as bench/sm90_compile.py does,
its SASS disassembled, and each loop over the vocabulary's instructions counted, divided by the
elements a thread takes a tile (BLOCK_V / threads). The tile is the shipped H100 table's at 128256
(else the rule's), the launch the default call's (one launch: stats, exact, rows and gradient).

    python bench/sass_costs.py                   the benchmark heads (CE, GRPO + entropy + clip,
                                                 the FKL mix, JSD)
    python bench/sass_costs.py --sass DIR        also write each kernel's SASS into DIR
    python bench/sass_costs.py --gpu "NVIDIA H200"  the tile of that GPU's table (still sm_90)

Counts, per element and read: all instructions; the special-function unit's (MUFU: EX2, LG2, RCP,
...); the fp32 arithmetic (FADD, FMUL, FFMA, FMNMX, FSETP, FSEL, ...). The reductions, loads and
address arithmetic of a tile are in the total, shared by its elements (ncu's instructions per
element counts them alike).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

# the package of this checkout, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
GPU = "NVIDIA H100 80GB HBM3"
NVDISASM, CUOBJDUMP = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
                       for tool in ("nvdisasm", "cuobjdump"))
compiled: list[tuple[dict, object]] = []


def _compile_instead(self, *args, grid, warmup, **kwargs):
    """JITFunction.run without a GPU: compile for sm_90, keep the kernel, launch nothing."""
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, specialization, options)
    kernel = triton_compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    compiled.append((dict(kwargs), kernel))


def heads() -> dict:
    import losscodegen as lcg
    return {
        "CE": lcg.HeadLoss(lcg.CrossEntropy()),
        "GRPO+entropy+clip": lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())),
        "CE+z+0.5FKL+entropy": lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                            lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),)),
        "JSD": lcg.HeadLoss(lcg.JSD()),
    }


_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def loops(sass: str) -> list[list[str]]:
    """The innermost loops of a kernel's SASS (a backward branch's span), each as its opcodes."""
    insns, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(insns)
        found = _INSN.search(line)
        if found:
            insns.append(found.groups())
    spans = []
    for at, (op, rest) in enumerate(insns):
        target = re.search(r"\(?(\.L_x_\d+)\)?", rest)
        if op.startswith("BRA") and target and labels.get(target.group(1), at + 1) <= at:
            spans.append((labels[target.group(1)], at))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [[op for op, _ in insns[lo:hi + 1]] for lo, hi in sorted(set(inner))]


FP32 = ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "FSWZADD")


def summary(ops: list[str], per_thread: int) -> dict:
    kinds = Counter(op.split(".")[0] for op in ops)
    mufu = Counter(op for op in ops if op.startswith("MUFU"))
    return dict(total=len(ops) / per_thread, mufu=sum(mufu.values()) / per_thread,
                fp32=sum(kinds[k] for k in FP32) / per_thread,
                detail={k: round(v / per_thread, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                mufu_detail={k: round(v / per_thread, 2) for k, v in mufu.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sass", type=Path)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--gpu", default=GPU, help="whose table's tile (default: %(default)s)")
    args = parser.parse_args()
    JITFunction.run = _compile_instead
    from losscodegen import backends
    from losscodegen.backends.triton import dispatch, helpers, tiles
    from losscodegen.testing import random_inputs
    backends.resolve = lambda name: "triton" if name == "auto" else name
    dispatch.Kernel.__call__ = dispatch.Kernel.jit
    helpers.INTERPRETED = True
    bucket = max(1 << (args.vocab - 1).bit_length(), 4096)
    for name, head in heads().items():
        k = head.kernel
        state = "/".join(map(str, k.STATE))
        config = tiles.TABLE.get(f"{args.gpu}|{state}|{bucket}|2") or tiles.rule(k.STATE)
        config = dataclasses.replace(config, split=False)   # one launch
        head.tile_override = config
        logits, y, kw = random_inputs(head, rows=2, vocab=args.vocab)
        kw = {key: v.to(torch.bfloat16) if key == "teacher_logits" else v for key, v in kw.items()}
        compiled.clear()
        head(logits.to(torch.bfloat16).requires_grad_(), y, **kw).loss.backward()
        kwargs, kernel = next((kw_, kn) for kw_, kn in compiled if kw_.get("GRAD") and kw_.get("STATS"))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(NVDISASM), "-c", f.name], check=True, capture_output=True, text=True).stdout
            usage = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], check=True, capture_output=True,
                                   text=True).stdout
        registers = re.search(r"REG:(\d+)", usage).group(1)
        if args.sass:
            args.sass.mkdir(parents=True, exist_ok=True)
            (args.sass / f"{name}.sass").write_text(sass)
        per_thread = kwargs["BLOCK_V"] // (32 * kernel.metadata.num_warps)
        # the reads, in the kernel's order: the loops that compute exponentials (not the zero fill
        # of an ignored row's gradient, nor the last row's sum over the rows)
        reads = [ops for ops in loops(sass) if any(op.startswith("MUFU") for op in ops)]
        names = ["stats", "exact", "gradient"] if len(reads) == 3 else ["stats", "gradient"]
        print(f"{name}: tile {kwargs['BLOCK_V']}/{kernel.metadata.num_warps} ({per_thread} elements a thread), "
              f"{registers} registers")
        total = 0.0
        for read, ops in zip(names, reads):
            s = summary(ops, per_thread)
            total += s["total"]
            top = ", ".join(f"{k} {v:g}" for k, v in list(s["detail"].items())[:12])
            print(f"  {read:9s} {s['total']:6.2f} / element: MUFU {s['mufu']:.2f} {s['mufu_detail']}, "
                  f"fp32 {s['fp32']:.2f}; {top}")
        print(f"  in all    {total:6.2f} / element")
        head.tile_override = None


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
