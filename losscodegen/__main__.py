"""``python -m losscodegen generate``: rewrite generated/ from generated/manifest.

The manifest holds one head per line, a Python expression over losscodegen's names, e.g.
``HeadLoss(CrossEntropy(), ZLoss(), metrics=(Entropy(),))``; ``#`` starts a comment.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import losscodegen
from losscodegen import load


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m losscodegen")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="regenerate generated/ from generated/manifest")
    gen.add_argument("--out", type=Path, default=load.GENERATED)
    gen.add_argument("--manifest", type=Path, default=load.GENERATED / "manifest")
    args = parser.parse_args(argv)
    generate(args.out, args.manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
