"""The command line.

``python -m losscodegen generate [--manifest FILE] [--out DIR] [--check]``
    one kernel file per head of a manifest (default: the package's own, into its generated/ folder);
    with ``--check``, compare DIR with what would be written instead, and exit 1 naming what differs.
``python -m losscodegen check [--manifest FILE] [--device cpu|cuda] [--vocab V] [--rows N]``
    every head of a manifest against its float64 reference (losscodegen.testing.assert_parity), on
    random inputs of N rows of V logits (default: 500, or a class-weighted head's number of classes);
    a head that fails is named as ``file:line``, and the others are checked.
``python -m losscodegen tune [--manifest FILE] [--vocab V ...] [--rows N] [--out FILE]``
    on a GPU: measure the fastest launch configuration of every manifest head's plan state at each
    vocabulary, kept in ``$LOSSCODEGEN_CACHE/tiles.json`` (which the runtime reads) or written to
    ``--out`` (the form shipped as losscodegen/backends/triton/tiles.json).
``python -m losscodegen fuzz [--minutes N] [--seed S] [--device cpu|cuda]``
    the differential fuzzer (losscodegen/fuzz/): random formulas and heads under every plan,
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

A mistake (a manifest that cannot be read, a line of it that fails, ``--device cuda`` where there is
no CUDA, a bad option) is one line, ``file:line: message`` or ``--option: message``, and exit status
1, never a traceback; ``check`` reports a head that fails and goes on to the next.
"""
from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch

import losscodegen
from losscodegen import backends, load


def _restart_in_interpreter(needed: bool) -> None:
    """Run the kernels in Triton's interpreter (no GPU, or --device cpu). Triton reads the switch
    when it is imported, and `python -m losscodegen` has imported it already: start again."""
    if needed and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.execve(sys.executable, [sys.executable, "-m", "losscodegen", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "1"})


class _Parser(argparse.ArgumentParser):
    """argparse's, whose usage errors (``--vocab 0``, an unknown option) exit with status 1, as every
    other mistake on this command line does, not argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise SystemExit(f"{self.prog}: {message}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def _read_manifest(manifest: Path) -> str:
    try:
        return manifest.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise SystemExit(f"--manifest: cannot read {manifest} ({reason}): give a manifest file, one head a "
                         "line") from None


def manifest_heads(manifest: Path) -> list[tuple[str, losscodegen.HeadLoss]]:
    return [(line, head) for _, line, head in _manifest_entries(manifest)]


_HEAD = "__losscodegen_head__"   # (the name the manifest's expressions are handed to)


class _ManifestLoader(importlib.abc.SourceLoader):
    """Runs a manifest as a module (its own file name and line numbers in a traceback), each of its
    top-level expressions handed to ``_HEAD`` with its line number: the heads, in order."""

    def __init__(self, path: Path, source: str) -> None:
        self.path, self.source = path, source

    def get_filename(self, fullname: str) -> str:
        return str(self.path)

    def get_data(self, path: str) -> bytes:
        return self.source.encode()

    def source_to_code(self, data, path, *, _optimize=-1):
        tree = ast.parse(data, filename=path)
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.Expr):
                call = ast.Call(ast.Name(_HEAD, ast.Load()), [ast.Constant(node.lineno), node.value], [])
                tree.body[i] = ast.copy_location(ast.Expr(call), node)
        return compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True, optimize=_optimize)


def _manifest_entries(manifest: Path) -> list[tuple[int, str, losscodegen.HeadLoss]]:
    """Each head of the manifest with its line number and text; an error in a line exits naming
    ``file:line``."""
    source = _read_manifest(manifest)
    lines = source.splitlines()
    heads: list[tuple[int, str, losscodegen.HeadLoss]] = []

    def take(number: int, head: object) -> None:
        if not isinstance(head, losscodegen.HeadLoss):
            raise TypeError(f"a head line must make a HeadLoss, this one makes {type(head).__name__}")
        heads.append((number, lines[number - 1].split("#", 1)[0].strip(), head))
    loader = _ManifestLoader(manifest, source)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("losscodegen_manifest", loader))
    vars(module).update({name: getattr(losscodegen, name) for name in losscodegen.__all__},
                        S=losscodegen.symbols, **{_HEAD: take})
    try:
        loader.exec_module(module)
    except Exception as exc:
        raise SystemExit(f"{manifest}:{_line_of(exc, manifest)}: {type(exc).__name__}: {exc}") from exc
    return heads


def _line_of(exc: Exception, manifest: Path) -> int:
    """The manifest's line where ``exc`` was raised (its innermost frame in the manifest)."""
    if isinstance(exc, SyntaxError) and exc.filename == str(manifest):
        return exc.lineno or 0
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(manifest)]
    return frames[-1].lineno if frames else 0


def generate(out: Path, manifest: Path, *, check: bool = False) -> int:
    """Write (or with ``check``, compare) one kernel file per manifest head in ``out``, and remove
    (or name) files no head produces. Returns the number of differences found by ``check``."""
    wanted = {}
    for number, line, head in _manifest_entries(manifest):
        try:
            wanted[load.file_name(head.key)] = (line, head.source(backends.get()).text)
        except Exception as e:   # (nothing written yet: the folder is left as it was)
            raise SystemExit(f"{manifest}:{number}: {type(e).__name__} generating its kernel: {e}") from e
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


DEFAULT_VOCAB = 500


def _vocab(head: losscodegen.HeadLoss, vocab: int | None) -> int:
    """The logits' width to check ``head`` at: ``--vocab``, else the length of its class weights (a
    class-weighted term runs at that vocabulary only), else ``DEFAULT_VOCAB``."""
    classes = sorted({int(t.class_weight.shape[0]) for t in head.loss_terms if t.class_weight is not None})
    if vocab is None:
        return classes[0] if classes else DEFAULT_VOCAB
    if classes and vocab not in classes:
        raise ValueError(f"--vocab {vocab}: this head's class weights have {classes[0]} classes, one a column "
                         f"of the logits: leave --vocab out (check then takes {classes[0]}) or give --vocab "
                         f"{classes[0]}")
    return vocab


def check(manifest: Path, device: str, *, rows: int = 24, vocab: int | None = None) -> int:
    """Every manifest head against its float64 reference, on ``rows`` x ``vocab`` logits (``_vocab``);
    the number of heads that fail. A head that fails, whatever the error (its kernel not generated,
    inputs of these sizes that do not fit it, a mismatch), is reported as ``file:line`` and the next
    one is checked."""
    from losscodegen.testing import assert_parity
    failures = 0
    for number, line, head in _manifest_entries(manifest):
        try:
            # (a manifest builds its class weights on the host: the head's buffers follow the logits)
            assert_parity(head.to(device), rows=rows, vocab=_vocab(head, vocab), device=device)
            print(f"ok    {line}")
        except Exception as e:
            failures += 1
            print(f"FAIL  {line}\n      {manifest}:{number}: {type(e).__name__}: {e}")
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
    where = " in Triton's interpreter" if head.backend_name == "triton" and device == "cpu" else ""
    print(f"{rows} x {vocab} bf16 logits on {device}: the {head.backend_name} backend{where}")
    print(f"loss = {out.loss.item():.6f}")
    for name, value in {**out.terms, **out.metrics}.items():
        print(f"  {name:16s} {value.item():.6f}")
    print(f"grad: {tuple(logits.grad.shape)} {logits.grad.dtype}, |grad| = {logits.grad.float().norm():.6f}")
    print("\n" + head.explain())


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m losscodegen",
                     description="losscodegen's kernels from the command line: generate them, check them "
                     "against float64, tune their launches, see one run",
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
    chk.add_argument("--vocab", type=_positive, default=None,
                     help=f"logits' columns (default: {DEFAULT_VOCAB}, or a class-weighted head's number of classes)")
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
    # (mistakes found before a restart in the interpreter, as a message and exit status 1)
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device: cuda is not available here (torch.cuda.is_available() is False): "
                         "give --device cpu, or leave --device out")
    if getattr(args, "manifest", None) is not None:
        _read_manifest(args.manifest)
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
