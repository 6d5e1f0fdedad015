"""The command line.

``python -m losscodegen generate [--manifest FILE] [--out DIR] [--check]``
    one kernel file per head of a manifest (default: the package's own, into its generated/ folder);
    with ``--check``, compare DIR with what would be written instead, and exit 1 naming what differs.
``python -m losscodegen check [--manifest FILE] [--device cpu|cuda] [--vocab V] [--rows N]``
    every head of a manifest against its float64 reference (losscodegen.testing.assert_parity), on
    random inputs of N rows of V logits (a head with class weights needs V = their length).
``python -m losscodegen tune [--manifest FILE] [--vocab V ...] [--rows N] [--out FILE]``
    on a GPU: measure the fastest launch configuration of every manifest head's plan state at each
    vocabulary, kept in ``$LOSSCODEGEN_CACHE/tiles.json`` (which the runtime reads) or written to
    ``--out`` (the form shipped as losscodegen/backends/triton/tiles.json).
``python -m losscodegen fuzz [--minutes N] [--seed S] [--device cpu|cuda]``
    the differential fuzzer (losscodegen/fuzz.py): random formulas and heads under every plan,
    against the float64 reference; each mismatch printed as a minimal regression test.
``python -m losscodegen build [--manifest FILE] [--targets sm_90a,sm_100a,...|all] [--vocab V]``
    every kernel variant of a manifest's heads compiled for GPUs this machine need not have
    (losscodegen/backends/triton/portable.py); exit 1 if one fails or cannot launch on a target.
``python -m losscodegen demo``
    a real head on random logits: its losses, gradient and plan.

A manifest is Python, a line at a time: each line that is an expression is a head, e.g.
``HeadLoss(CrossEntropy(), ZLoss(), metrics=(Entropy(),))``; other lines (``from mylosses import
Focal``, ``Tsallis = declare_term(...)``) run first, in order, in a namespace holding losscodegen's
public names and ``S`` (its symbols). ``#`` starts a comment.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path

import torch

import losscodegen
from losscodegen import backends, load


def _restart_in_interpreter(needed: bool) -> None:
    """Run the kernels in Triton's interpreter (no GPU, or --device cpu). Triton reads the switch
    when it is imported, and `python -m losscodegen` has imported it already: start again."""
    if needed and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.execve(sys.executable, [sys.executable, "-m", "losscodegen", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "1"})


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def manifest_heads(manifest: Path) -> list[tuple[str, losscodegen.HeadLoss]]:
    namespace = {name: getattr(losscodegen, name) for name in losscodegen.__all__}
    namespace["S"] = losscodegen.symbols
    heads = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            tree = ast.parse(line)
            if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
                head = eval(line, namespace)
                if not isinstance(head, losscodegen.HeadLoss):
                    raise TypeError(f"a head line must make a HeadLoss, this one makes {type(head).__name__}")
                heads.append((line, head))
            else:
                exec(line, namespace)
        except Exception as exc:
            raise SystemExit(f"{manifest}:{number}: {type(exc).__name__}: {exc}") from exc
    return heads


def generate(out: Path, manifest: Path, *, check: bool = False) -> int:
    """Write (or with ``check``, compare) one kernel file per manifest head in ``out``, and remove
    (or name) files no head produces. Returns the number of differences found by ``check``."""
    wanted = {}
    for line, head in manifest_heads(manifest):
        wanted[load.file_name(head.key)] = (line, head.source(backends.get()).text)
    if not check and out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is not a folder: give --out the folder to write the kernels into")
    differences = 0
    for name, (line, text) in wanted.items():
        path = out / name
        if check:
            if not path.exists() or path.read_text() != text:
                differences += 1
                print(f"{'missing' if not path.exists() else 'stale'}: {path}  <-  {line}")
        else:
            try:
                load.write_file(path, text)
            except OSError as e:
                raise SystemExit(f"--out {out}: cannot write {path} ({e.strerror or e}); "
                                 "give --out a writable folder") from e
            print(f"{name}  <-  {line}")
    for extra in sorted(set(p.name for p in out.glob("head_loss_*.py")) - set(wanted)):
        if check:
            differences += 1
            print(f"not in the manifest: {out / extra}")
        else:
            (out / extra).unlink()
            print(f"removed {extra}")
    if check:
        print(f"{out}: {'up to date' if not differences else f'{differences} file(s) differ'} "
              f"({len(wanted)} heads in {manifest})")
    return differences


def check(manifest: Path, device: str, *, rows: int = 24, vocab: int = 500) -> int:
    """Every manifest head against its float64 reference, on ``rows`` x ``vocab`` logits; the
    number of heads that fail."""
    from losscodegen.testing import assert_parity
    failures = 0
    for line, head in manifest_heads(manifest):
        try:
            # (a manifest builds its class weights on the host: the head's buffers follow the logits)
            assert_parity(head.to(device), rows=rows, vocab=vocab, device=device)
            print(f"ok    {line}")
        except (AssertionError, ValueError) as e:   # (ValueError: inputs of these sizes do not fit it)
            failures += 1
            print(f"FAIL  {line}\n      {type(e).__name__}: {e}")
    print(f"{failures} of the manifest's heads failed" if failures else "every head matches its reference")
    return failures


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
    parser = argparse.ArgumentParser(prog="python -m losscodegen",
                                     description="losscodegen's kernels from the command line: generate them, "
                                     "check them against float64, tune their launches, see one run",
                                     epilog="`python -m losscodegen COMMAND --help` describes each command's options")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write (or --check) one kernel file per head of a manifest")
    manifest_help = "the heads, one a line (default: the package's own, generated/manifest)"
    gen.add_argument("--manifest", type=Path, default=load.GENERATED / "manifest", help=manifest_help)
    gen.add_argument("--out", type=Path, default=None, help="the folder to write into (default: the manifest's)")
    gen.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 if stale")
    chk = sub.add_parser("check", help="parity of every head of a manifest with its float64 reference")
    chk.add_argument("--manifest", type=Path, default=load.GENERATED / "manifest", help=manifest_help)
    chk.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="where to run the kernels (default: cuda if available; cpu runs Triton's interpreter)")
    chk.add_argument("--vocab", type=_positive, default=500,
                     help="logits' columns (a class-weighted head: the length of its class weights)")
    chk.add_argument("--rows", type=_positive, default=24, help="rows of random inputs")
    tun = sub.add_parser("tune", help="measure launch configurations on this GPU (kept for later calls)")
    tun.add_argument("--manifest", type=Path, default=load.GENERATED / "manifest", help=manifest_help)
    tun.add_argument("--vocab", type=int, nargs="+", default=[32000, 64128, 128256, 262144],
                     help="the vocabulary sizes to measure at (default: %(default)s)")
    tun.add_argument("--rows", type=int, default=8192, help="rows of logits per measured call (default: %(default)s)")
    tun.add_argument("--out", type=Path, default=None, help="write this table instead of the user's")
    fz = sub.add_parser("fuzz", help="random formulas, heads and plans against the float64 reference")
    fz.add_argument("--minutes", type=float, default=1.0, help="how long to run (default: %(default)s)")
    fz.add_argument("--seed", type=int, default=0,
                    help="the first case's seed; the same seed tries the same cases (default: %(default)s)")
    fz.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where the heads run (default: cuda if available; cpu runs Triton's interpreter, "
                         "the torch backend and vocab-parallel plans on gloo ranks)")
    bld = sub.add_parser("build", help="compile every kernel of a manifest for GPUs this machine need not have")
    bld.add_argument("--manifest", type=Path, default=load.GENERATED / "manifest", help=manifest_help)
    bld.add_argument("--targets", default="all",
                     help="comma-separated: sm_90a, sm_100a, sm_120a, gfx942, gfx950, or all (default)")
    bld.add_argument("--vocab", type=_positive, default=128256,
                     help="the vocabulary the tiles are chosen for (default: %(default)s)")
    sub.add_parser("demo", help="run a real head on random logits and print what it computes")
    args = parser.parse_args(argv)
    if args.command == "demo":
        _restart_in_interpreter(not torch.cuda.is_available())
        demo()
        return 0
    if args.command == "fuzz":
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        _restart_in_interpreter(device == "cpu")
        from losscodegen import fuzz
        return int(bool(fuzz.fuzz(seconds=60 * args.minutes, seed=args.seed, device=device).mismatches))
    if args.command == "check":
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        _restart_in_interpreter(device == "cpu")
        return int(check(args.manifest, device, rows=args.rows, vocab=args.vocab) > 0)
    if args.command == "build":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):   # (it compiles for GPUs: start again without)
            os.execve(sys.executable, [sys.executable, "-m", "losscodegen", *sys.argv[1:]],
                      {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        portable = backends.get("triton").portable
        try:
            targets = portable.parse_targets(args.targets)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        results = portable.build(manifest_heads(args.manifest), targets, vocab=args.vocab,
                                 on_compiled=lambda r: print(r.line(), flush=True))
        print("\n".join(portable.summary(results, targets)))
        return int(any(r.problem is not None for r in results))
    if args.command == "tune":
        if not torch.cuda.is_available():
            raise SystemExit("python -m losscodegen tune measures on a GPU; none is available")
        heads = [head for _, head in manifest_heads(args.manifest)]
        backends.get().tune(heads, args.vocab, torch.device("cuda"), args.rows, args.out)
        return 0
    differences = generate(args.out or args.manifest.parent, args.manifest, check=args.check)
    return int(differences > 0)


if __name__ == "__main__":
    sys.exit(main())
