"""``python -m losscodegen generate``: rewrite generated/ from generated/manifest.
``python -m losscodegen demo``: run a real head and print its losses and its plan.

The manifest holds one head per line, a Python expression over losscodegen's names, e.g.
``HeadLoss(CrossEntropy(), ZLoss(), metrics=(Entropy(),))``; ``#`` starts a comment.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import losscodegen
from losscodegen import load


def _interpreter_without_gpu() -> None:
    """No GPU: run the kernels in Triton's interpreter. Triton reads the switch when it is imported,
    and `python -m losscodegen` has imported the package (and Triton) already: start again."""
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.execve(sys.executable, [sys.executable, "-m", "losscodegen", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "1"})


def manifest_heads(manifest: Path) -> list[tuple[str, losscodegen.HeadLoss]]:
    namespace = {name: getattr(losscodegen, name) for name in losscodegen.__all__}
    heads = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                heads.append((line, eval(line, {"__builtins__": {}}, namespace)))
            except Exception as exc:
                raise SystemExit(f"{manifest}:{number}: {exc}") from exc
    return heads


def generate(out: Path, manifest: Path) -> list[Path]:
    """Write one kernel file per manifest head into ``out`` and remove files no head produces."""
    written = []
    for line, head in manifest_heads(manifest):
        path = out / f"head_loss_{head.key}.py"
        load.write_atomic(path, head.source().text)
        written.append(path)
        print(f"{path.name}  <-  {line}")
    for stale in sorted(set(out.glob("head_loss_*.py")) - set(written)):
        stale.unlink()
        print(f"removed {stale.name}")
    return written


def demo() -> None:
    """A real call: CE + z-loss + 0.5 forward KL with entropy and accuracy metrics, forward and backward."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, vocab = (4096, 128256) if device == "cuda" else (32, 4099)
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    teacher = torch.randn(rows, vocab, device=device, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    labels[::5] = -100
    head = losscodegen.HeadLoss(
        losscodegen.CrossEntropy(), losscodegen.ZLoss(weight=1e-4), losscodegen.ForwardKL(weight=0.5),
        metrics=(losscodegen.Entropy(), losscodegen.TokenAccuracy()))
    out = head(logits, labels, teacher_logits=teacher)
    out.loss.backward()
    print(f"{rows} x {vocab} bf16 logits on {device}")
    print(f"loss = {out.loss.item():.6f}")
    for name, value in {**out.terms, **out.metrics}.items():
        print(f"  {name:16s} {value.item():.6f}")
    print(f"grad: {tuple(logits.grad.shape)} {logits.grad.dtype}, |grad| = {logits.grad.float().norm():.6f}")
    print("\n" + head.explain())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m losscodegen")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="regenerate generated/ from generated/manifest")
    gen.add_argument("--out", type=Path, default=load.GENERATED)
    gen.add_argument("--manifest", type=Path, default=load.GENERATED / "manifest")
    sub.add_parser("demo", help="run a real head on random logits and print what it computes")
    args = parser.parse_args(argv)
    if args.command == "demo":
        _interpreter_without_gpu()
        demo()
    else:
        generate(args.out, args.manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
