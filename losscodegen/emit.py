"""Stage 4, emit: sympy expressions printed as Triton (and torch) code, laid out by a Jinja2 template.

Every decision is made here in Python; ``templates/head_loss.py.j2`` only places the printed
statements into loops, loads and stores.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import itertools
import math
import re
from dataclasses import dataclass
from typing import Mapping

import jinja2
import sympy as sp
from sympy.printing.pycode import PythonCodePrinter, _print_known_const, _print_known_func

from . import symbols as S
from .lower import IS_Y, M, MT, TM, ZM, ZYM
from .plan import Plan, pow2
from .resources import TEMPLATES

X = sp.Symbol("x", real=True)
_LOG2E = sp.Float(1 / math.log(2))
LOGIT_SCALE = sp.Symbol("logit_scale", positive=True)
SOFTCAP = sp.Symbol("softcap", positive=True)


class _ArrayPrinter(PythonCodePrinter):
    """Prints an expression for an array module (``tl`` or ``torch``); one ``_print_X`` per construct."""

    module = ""

    def _call(self, fn: str, *args: sp.Expr) -> str:
        return f"{self.module}.{fn}(" + ", ".join(self._print(a) for a in args) + ")"

    def _print_Symbol(self, expr: sp.Symbol) -> str:
        return expr.name

    def _print_Integer(self, expr: sp.Integer) -> str:
        return f"{int(expr)}.0"

    def _print_Rational(self, expr: sp.Rational) -> str:
        return repr(float(expr))

    def _print_Float(self, expr: sp.Float) -> str:
        return repr(float(expr))

    def _print(self, expr, **kwargs) -> str:
        if isinstance(expr, (sp.Pow, sp.Function)) and expr.is_number:
            try:
                return repr(float(expr))   # sqrt(pi), erf(1): a number, not a call on one
            except TypeError:
                pass                       # not a plain number: LSE(1, 0)
        return super()._print(expr, **kwargs)

    def _print_NumberSymbol(self, expr: sp.NumberSymbol) -> str:
        return repr(float(expr))   # pi, E, ...: a number, not math.pi (no math module in a kernel)

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def _print_unsupported(self, expr: sp.Expr) -> str:
        # PythonCodePrinter prints math.<fn>(...) (wrong on tensors) for the functions it knows: each
        # one this printer supports (symbols.FUNCTIONS) has its own _print_ method here, and
        # declare_term refuses the others before anything is printed
        raise NotImplementedError(f"no {self.module} printing for {type(expr).__name__}: {expr}")

    def _print_sin(self, expr: sp.sin) -> str:
        return self._call("sin", expr.args[0])

    def _print_cos(self, expr: sp.cos) -> str:
        return self._call("cos", expr.args[0])

    def _print_erf(self, expr: sp.erf) -> str:
        return self._call("erf", expr.args[0])

    def _print_exp(self, expr: sp.exp) -> str:
        return self._call("exp", expr.args[0])

    def _print_log(self, expr: sp.log) -> str:
        return self._call("log", expr.args[0])

    def _print_Abs(self, expr: sp.Abs) -> str:
        return self._call("abs", expr.args[0])

    def _print_sign(self, expr: sp.sign) -> str:
        a = self._print(expr.args[0])
        return f"{self.module}.where({a} > 0, 1.0, {self.module}.where({a} < 0, -1.0, 0.0))"

    def _print_tanh(self, expr: sp.tanh) -> str:
        return self._call("tanh", expr.args[0])

    def _print_Pow(self, expr: sp.Pow, rational: bool = False) -> str:
        base, e = expr.args
        if e.is_Integer and 0 < int(e) <= 4:
            return "(" + " * ".join([self.parenthesize(base, 100)] * int(e)) + ")"
        if e.is_Integer and int(e) > 4:
            # |b|**n as exp(n*log|b|), times b's sign for an odd n: exp(n*log(b)) is NaN for b < 0
            magnitude = sp.exp(sp.Mul(e, sp.log(sp.Abs(base)), evaluate=False), evaluate=False)
            return self._print(sp.Mul(sp.sign(base), magnitude, evaluate=False) if int(e) % 2 else magnitude)
        if e.is_Integer and int(e) < 0:
            return f"(1.0 / ({self._print(base ** (-e))}))"
        if e == sp.S.Half:
            return self._call("sqrt", base)
        return self._call("exp", e * sp.log(base))

    def _minmax(self, args, op: str) -> str:
        out = self._print(args[0])
        for a in args[1:]:
            b = self._print(a)
            out = f"{self.module}.where({out} {op} {b}, {out}, {b})"
        return out

    def _print_Min(self, expr: sp.Min) -> str:
        return self._minmax(expr.args, "<")

    def _print_Max(self, expr: sp.Max) -> str:
        return self._minmax(expr.args, ">")

    def _print_clamp(self, expr: S.clamp) -> str:
        x, lo, hi = expr.args  # a bound that never binds (infinite, or 0 below an exp) is left out
        out = x if sp.Ge(x, lo) == sp.true else sp.Max(x, lo, evaluate=False)
        return self._print(out if sp.Le(x, hi) == sp.true else sp.Min(out, hi, evaluate=False))

    def _print_Infinity(self, expr) -> str:
        return 'float("inf")'

    def _print_NegativeInfinity(self, expr) -> str:
        return 'float("-inf")'

    def _print_Piecewise(self, expr: sp.Piecewise) -> str:
        out = None
        for value, cond in reversed(expr.args):
            if out is None or cond == sp.true:
                out = self._print(value)
            else:
                out = f"{self.module}.where({self._print(cond)}, {self._print(value)}, {out})"
        return out

    def _print_Relational(self, expr) -> str:
        return f"({self._print(expr.lhs)} {expr.rel_op} {self._print(expr.rhs)})"

    def _print_And(self, expr) -> str:
        return "(" + " & ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr) -> str:
        return "(" + " | ".join(self._print(a) for a in expr.args) + ")"

    def _print_Not(self, expr) -> str:
        return f"(~{self._print(expr.args[0])})"

    def _print_ITE(self, expr) -> str:
        a, b, c = expr.args
        return self._print(sp.Or(sp.And(a, b), sp.And(sp.Not(a), c)))

    def _print_BooleanTrue(self, expr) -> str:
        return "True"

    def _print_BooleanFalse(self, expr) -> str:
        return "False"


for _name in dir(PythonCodePrinter):
    if _name.startswith("_print_") and _name not in vars(_ArrayPrinter) \
            and getattr(PythonCodePrinter, _name) in (_print_known_func, _print_known_const):
        setattr(_ArrayPrinter, _name, _ArrayPrinter._print_unsupported)


class TritonPrinter(_ArrayPrinter):
    module = "tl"

    def _print_exp(self, expr: sp.exp) -> str:
        # exp(E) = exp2(log2(e) * E), E summed before the multiply (a common numeric factor taken
        # out first): log2(e) folded into each term of E would round each term on its own, an
        # error of an ulp of |z| or |m| in an exponent that is itself small. The one exception: an
        # element relative to its maximum (zm <= 0) plus row terms (-log(acc) <= 0, the same sign:
        # nothing cancels) is log2(e) * zm + log2(e) * row, one fused multiply-add per element with
        # the row's product computed once
        arg = sp.factor_terms(expr.args[0])
        terms = sp.Add.make_args(arg)
        rel = [a for a in terms if a.has(ZM, TM)]
        if rel and len(rel) < len(terms) and not arg.has(*S.ELEMENT_SYMBOLS, *S.TOPK_SYMBOLS):
            row = [a for a in terms if a not in rel]
            return (f"tl.exp2({float(_LOG2E)!r} * {self.parenthesize(sp.Add(*rel), 100)}"
                    f" + {float(_LOG2E)!r} * {self.parenthesize(sp.Add(*row), 100)})")
        return f"tl.exp2({float(_LOG2E)!r} * {self.parenthesize(arg, 100)})"

    _print_ExpFactor = _print_exp

    def _print_log(self, expr: sp.log) -> str:
        return f"_log({self._print(expr.args[0])})"  # defined by the template (a fast base-2 log)

    def _print_tanh(self, expr: sp.tanh) -> str:
        # defined by the template: an error relative to the value (softcap's c*tanh(x/c) is ~x near 0,
        # where the saturating 2/(1 + exp(-2u)) - 1 keeps only an absolute error)
        return f"_tanh({self._print(expr.args[0])})"

    def _print_Pow(self, expr: sp.Pow, rational: bool = False) -> str:
        base, e = expr.args
        if e.is_Integer and int(e) < 0:
            return f"_rcp({self._print(base ** (-e))})"  # defined by the template (a fast reciprocal)
        return super()._print_Pow(expr, rational)

    def _print_Mul(self, expr: sp.Mul) -> str:
        # a / b as a * _rcp(b): the printer's division is the IEEE one, a long routine (measured on
        # the H100: JSD with its runtime beta 4.84 ms against 4.50 with a reciprocal)
        num = [f for f in expr.args if not (f.is_Pow and f.exp.is_Integer and f.exp < 0)]
        den = [f for f in expr.args if f.is_Pow and f.exp.is_Integer and f.exp < 0]
        if not den:
            return super()._print_Mul(expr)
        rcp = f"_rcp({self._print(sp.Mul(*[f.base ** -f.exp for f in den]))})"
        if not num:
            return rcp
        return f"{self.parenthesize(sp.Mul(*num), 50)}*{rcp}"


class TorchPrinter(_ArrayPrinter):
    module = "torch"


_TL = TritonPrinter()


class ExpFactor(sp.Function):
    """``exp`` that sympy leaves alone: it folds ``exp(a) * exp(b)`` into ``exp(a + b)``, one more
    special-function op per element where ``exp(a)`` and ``exp(b)`` are computed anyway (JSD's
    ``p q / M`` with a runtime beta: 5 instead of 4 per element in each of two reads)."""
    nargs = 1


def _shared_exps(exprs: list[sp.Expr]) -> list[sp.Expr]:
    """``exprs`` with each ``exp(a + b)`` whose ``exp(a)`` and ``exp(b)`` are there too written as
    their product (``ExpFactor``s, which common-subexpression elimination then shares)."""
    args: dict[sp.Expr, sp.Expr] = {}   # each exponent, expanded -> as written (printed as written)
    for e in exprs:
        for x in sorted(e.atoms(sp.exp), key=sp.default_sort_key):
            args.setdefault(sp.expand(x.args[0]), x.args[0])

    def factor(a: sp.Expr) -> sp.Expr:
        key = sp.expand(a)
        for b in args:
            rest = sp.expand(key - b)
            if b != key and rest != key and rest in args:
                return ExpFactor(args[b]) * ExpFactor(args[rest])
        return ExpFactor(args.get(key, a))
    return [e.replace(sp.exp, factor) for e in exprs]


def _statements(exprs: list[sp.Expr], prefix: str) -> tuple[list[str], list[str]]:
    """Common subexpressions first (``prefix0 = ...``), then the printed results."""
    temps, reduced = sp.cse(_shared_exps(exprs), symbols=sp.numbered_symbols(prefix, real=True),
                            order="canonical")
    return ([f"{s} = {_TL.doprint(e)}" for s, e in temps], [_TL.doprint(e) for e in reduced])


def _tile_sums(sums: list[tuple[str, str]]) -> list[str]:
    """Statements that sum several per-element tensors (``(name, body)``) over a tile in few
    reductions: each run of a power-of-two count of them (the binary digits of the count) is joined
    pairwise into one ``[BLOCK_V, 2, ..., 2]`` tensor, summed over the tile once, and split back
    into ``<name>_tile``."""
    leaves = [(f"tl.where(in_row, {body}, 0.0)", acc) for acc, body in sums]
    lines: list[str] = []
    parts = itertools.count()

    def split(tree, var: str) -> None:
        names = [f"part{next(parts)}" if isinstance(t, tuple) else f"{t}_tile" for t in tree]
        lines.append(f"{names[0]}, {names[1]} = tl.split({var})")
        for t, name in zip(tree, names):
            if isinstance(t, tuple):
                split(t, name)
    while leaves:
        size = 1 << (len(leaves).bit_length() - 1)
        run, leaves = leaves[:size], leaves[size:]
        if len(run) == 1:
            lines.append(f"{run[0][1]}_tile = tl.sum({run[0][0]}, 0)")
            continue
        while len(run) > 1:
            run = [(f"tl.join({a}, {b})", (ta, tb)) for (a, ta), (b, tb) in zip(run[::2], run[1::2])]
        var = f"part{next(parts)}"
        lines.append(f"{var} = tl.sum({run[0][0]}, 0)")
        split(run[0][1], var)
    return lines


def _finite_at_neg_inf(expr: sp.Expr, elements: tuple[sp.Symbol, ...], *, floored: bool) -> bool:
    """Whether ``expr`` stays free of NaN where element symbols are -inf (``floored``: where they are
    the template's FLOOR, a very negative finite number, instead): built by sums, products and
    positive integer powers from factors free of them, ``exp(a*z + b*t + row)`` with ``a, b >= 0``
    (which are then 0), and, when floored, the element symbols themselves."""
    if not expr.has(*elements):
        return True
    if expr in elements:
        return floored
    if isinstance(expr, sp.exp):
        arg = sp.expand(expr.args[0])
        coefs = [arg.coeff(v) for v in elements]
        rest = arg - sum(c * v for c, v in zip(coefs, elements))
        return all(c.is_number and c >= 0 for c in coefs) and not rest.has(*elements)
    if isinstance(expr, (sp.Add, sp.Mul)):
        return all(_finite_at_neg_inf(a, elements, floored=floored) for a in expr.args)
    if isinstance(expr, sp.Pow) and expr.exp.is_Integer and expr.exp > 0:
        return _finite_at_neg_inf(expr.base, elements, floored=floored)
    return False


def _neg_inf(exprs: list[sp.Expr], elements: tuple[sp.Symbol, ...]) -> dict[str, bool]:
    """How a read whose per-element expressions are ``exprs`` keeps the ``0 * log 0 = 0`` convention
    at -inf input elements, as cheaply as it can (each is an instruction or more per element):
    ``floor`` -inf inputs to FLOOR where a product with an element would be 0 * -inf; and drop the
    elements where every input is -inf (``gone``: a padded or masked vocabulary entry) where even
    floored inputs leave a NaN (JSD's log of a mixture that is 0 there)."""
    return dict(floor=not all(_finite_at_neg_inf(e, elements, floored=False) for e in exprs),
                gone=not all(_finite_at_neg_inf(e, elements, floored=True) for e in exprs))


def header(bound, plan: Plan) -> str:
    """The generated file's opening comment: the formulas, what lowering made of them, the plan."""
    lines = ["# Generated by losscodegen -- do not edit; `python -m losscodegen generate` rewrites it.",
             "#", "# terms (per-row formulas):"]
    lines += [f"#   {'metric' if m else 'loss  '} {n} = {f}" for n, f, m in bound]
    lines += [f"# softcap: {plan.softcap}", "#", "# lowered:"]
    lines += ["#   " + line for line in str(plan.lowered).splitlines()]
    lines += ["#", "# plan:"] + ["#   " + line for line in str(plan).splitlines()]
    return "\n".join(lines)


@dataclass(frozen=True)
class KernelSource:
    name: str
    key: str
    text: str

    def __str__(self) -> str:
        return f"{self.name} ({len(self.text.splitlines())} lines)"


@dataclass(frozen=True)
class Signature:
    """One jitted kernel's interface, the single declaration of its arguments: the template writes
    the kernel's signature from it, the generated file records it (``ARGS``, ``FIXED``,
    ``CONSTEXPRS``) and launch.py passes every argument by these names."""

    name: str                    # the jitted function
    args: tuple[str, ...]        # each launch's own, first
    fixed: tuple[str, ...]       # then those that are the same at every launch of a head on one vocab shard
    constexprs: tuple[str, ...]  # then the constexprs
    unspecialized: tuple[str, ...] = ()  # integer arguments that change between calls: no variant each

    @property
    def names(self) -> tuple[str, ...]:
        return self.args + self.fixed + self.constexprs

    def lines(self, indent: str) -> list[str]:
        """The parameters, wrapped: each launch's, the fixed ones, then the constexprs."""
        return (wrap([f"{a}, " for a in self.args], indent) + wrap([f"{a}, " for a in self.fixed], indent)
                + wrap([f"{a}: tl.constexpr, " for a in self.constexprs], indent))


def wrap(items: list[str], indent: str, width: int = 100) -> list[str]:
    """``items`` joined into lines of at most ``width`` characters, each starting with ``indent``."""
    out, line = [], indent
    for item in items:
        if len(line) + len(item) > width and line.strip():
            out.append(line.rstrip())
            line = indent
        line += item
    if line.strip():
        out.append(line.rstrip())
    return out


def signatures(plan: Plan, key: str, reads_scalars: bool, per_sequence: tuple[str, ...] = (),
               row_terms: bool = True) -> dict[str, Signature]:
    """The interface of each kernel of a head's file, in signature order. ``reads_scalars``: whether
    the head's kernel reads runtime scalars (the segment kernel always does: its terms' weights);
    ``per_sequence``: the segment terms normalised by sequence (which take no divisor); ``row_terms``:
    whether the head has loss terms reduced over rows (which take per-row upstream gradients)."""
    lw = plan.lowered
    segments = [seg.name for seg in lw.segments]
    args = ["x_ptr", "x_stride", "grad_ptr", "grad_stride", "y_ptr", "mask_ptr"]
    if lw.uses_teacher:
        args += ["t_ptr", "t_stride"]
    args += [f"tok_{tok}_ptr" for tok in lw.tokens]
    if lw.uses_topk:
        args += ["topk_id_ptr", "topk_lp_ptr", "topk_stride", "K"]
    if segments:
        args += ["seg_ptr", "n_seg", "off_seg_sums", "off_seg_coefs"]
    args += ["ws_ptr", "off_rows", "off_loss_rows", "off_stats", *(["off_exact"] if plan.exact else []),
             "gathered_ptr", "peers_ptr", "epoch", "div_ptr", "flag_ptr",
             *(["up_loss_ptr", "up_rows_ptr"] if row_terms else []), "row_offset", "n_rows"]
    fixed = ["world", *(["scalars_ptr"] if reads_scalars else []), "logit_scale", "softcap", "V", "vocab_start",
             "n_vocab", "ignore_index"]
    constexprs = ["SUM", "PER_ROW", "STATS", "EXCHANGE", "MERGE", "EXACT", "STORE_STATS", "ROWS", "GRAD",
                  "BLOCK_V", "BLOCK_K", "BLOCK_R"]
    varying = ("row_offset", "n_rows", "epoch", "off_rows", "off_loss_rows", "off_stats", "off_exact",
               "vocab_start", "n_vocab", "n_seg", "off_seg_sums", "off_seg_coefs")
    out = {"head_loss": Signature(f"head_loss_{key}", tuple(args), tuple(fixed), tuple(constexprs),
                                  tuple(a for a in varying if a in args + fixed))}
    if segments:
        seg_args = ("ws_ptr", "off_seg_sums", "off_seg_coefs", "n_seg",
                    *(("div_ptr",) if set(segments) - set(per_sequence) else ()))
        out["segments"] = Signature(f"segments_{key}", seg_args, ("scalars_ptr",),
                                    ("SUM", "BLOCK_S"), ("n_seg", "off_seg_sums", "off_seg_coefs"))
    return out


def check_interface(text: str, sigs: dict[str, Signature]) -> None:
    """Refuse a rendered kernel file whose kernels disagree with their declared interface: a kernel
    whose parameters are not the declaration's, or that reads a name it neither takes, assigns, nor
    finds in the file or the builtins (a template that renamed or dropped an argument). Raised here,
    when the file is generated, not when a launch first compiles it."""
    tree = ast.parse(text)
    module_names = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            module_names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module_names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            module_names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for sig in sigs.values():
        fn = functions.get(sig.name)
        if fn is None:
            raise ValueError(f"the template wrote no kernel {sig.name}")
        params = tuple(a.arg for a in fn.args.args)
        if params != sig.names:
            raise ValueError(f"{sig.name}: the template's parameters {params} are not its declared "
                             f"interface {sig.names} (emit.signatures)")
        known = module_names | set(params) | {n.id for n in ast.walk(fn)
                                              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        unknown = sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                         - known)
        if unknown:
            raise ValueError(f"{sig.name} reads {unknown}, which is no argument of its declared interface "
                             f"(emit.signatures) and nothing it assigns")
        unused = sorted(set(sig.args + sig.fixed) - {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)})
        if unused:
            raise ValueError(f"{sig.name}: declared arguments {unused} are never read by the template")


def _group_online(plan: Plan) -> dict[tuple, list]:
    """The first read's online accumulators over the vocabulary, grouped by their exponent (alpha,
    beta): a group shares one rescale and one exponential a tile."""
    groups: dict[tuple, list] = {}
    for acc in plan.lowered.accumulators:
        if acc.online and acc.domain == "vocab":
            groups.setdefault((acc.alpha, acc.beta), []).append(acc)
    return groups


def _merge(plan: Plan) -> dict[str, list[str]]:
    """Statements merging the packed stats of the vocab shards, by each column's rule: the maxima
    over ranks first, then the sums, each rank's running sums rescaled from its maxima to the
    global ones, and the argmax of the first rank that holds the maximum."""
    at = {c.name: i for i, c in enumerate(plan.columns)}
    init, maxima, sums = [], [], ["at = part + r * step"]
    rank_max = {M: sp.Symbol("m_r", real=True), MT: sp.Symbol("m_t_r", real=True)}
    for c in plan.columns:
        if c.merge == "max":
            init.append(f"{c.name} = float(\"-inf\")")
            maxima.append(f"{c.name} = tl.maximum({c.name}, tl.load(part + r * step + {at[c.name]}))")
            sums.append(f"{c.name}_r = tl.load(at + {at[c.name]})")
    for c in plan.columns:
        if c.merge == "sum":
            init.append(f"{c.name} = 0.0")
            sums.append(f"{c.name} += tl.load(at + {at[c.name]})")
        elif c.merge == "scaled":
            shift = c.alpha * (rank_max[M] - M) + c.beta * (rank_max[MT] - MT)
            init.append(f"{c.name} = 0.0")
            sums.append(f"{c.name} += tl.load(at + {at[c.name]}) * {_TL.doprint(sp.exp(shift))}")
        elif c.merge == "argmax":
            init += [f"{c.name} = 0.0", "best = float(\"-inf\")"]
            sums += [f"{c.name} = tl.where(m_r > best, tl.load(at + {at[c.name]}), {c.name})",
                     "best = tl.maximum(best, m_r)"]
    return dict(init=init, maxima=maxima, sums=sums)


# The kernel's flag buffer: one slot a kind of bad value, in this order (validation.py reads them).
FLAG_SLOTS = ("label", "segment_id", "topk_id", "topk_repeated")
_TEXT_HASH = re.compile(rb'\nTEXT_HASH = "([0-9a-f]{64})"\n\Z')


def seal(text: str) -> str:
    """A kernel file's text ending with the sha256 of everything before that line: a loader tells a
    damaged file (truncated, edited, not text) from an intact one before running it."""
    text = text if text.endswith("\n") else text + "\n"
    text += "# TEXT_HASH: the sha256 of this file up to its last line (a file that does not match is never used)\n"
    return f'{text}TEXT_HASH = "{hashlib.sha256(text.encode()).hexdigest()}"\n'


def intact(data: bytes) -> bool:
    """Whether a kernel file's bytes match the hash ``seal`` wrote at their end."""
    found = _TEXT_HASH.search(data)
    return found is not None and hashlib.sha256(data[:found.start() + 1]).hexdigest() == found.group(1).decode()


def emit(plan: Plan, key: str, header: str, codegen: str,
         normalize: Mapping[str, str] | None = None) -> KernelSource:
    """The kernel file of a plan. ``normalize``: each loss term's normalisation ("tokens" where not
    given; a "sequence" term arrives as a segment term); metrics are means over the valid rows."""
    lw = plan.lowered
    name = f"head_loss_{key}"
    transform = LOGIT_SCALE * (SOFTCAP * sp.tanh(X / SOFTCAP) if plan.softcap else X)
    # the running maxima as the exponents' reference: m_ref is 0 while every logit so far is -inf
    mn, mtn = sp.Symbol("m_ref", real=True), sp.Symbol("m_t_ref", real=True)
    # (the later reads see elements relative to their maxima: zm = z - m is -inf where z is)
    vocab, topk = (*S.ELEMENT_SYMBOLS, ZM, TM), S.TOPK_SYMBOLS

    online = []
    for i, ((alpha, beta), accs) in enumerate(_group_online(plan).items()):
        exponent = alpha * (S.logit - mn) + beta * (S.teacher_logit - mtn)
        rescale = alpha * (M - mn) + beta * (MT - mtn)
        scale = sp.Symbol(f"s{i}", real=True) if exponent != 0 else sp.S.One
        online.append(dict(
            scale=None if exponent == 0 else _TL.doprint(sp.exp(exponent)),
            rescale=None if rescale == 0 else _TL.doprint(sp.exp(rescale)),
            index=i, accs=[(a.name, _TL.doprint(scale * a.body)) for a in accs]))
    topk_online = [(a.name, _TL.doprint(sp.exp(a.alpha * (S.topk_logit - M)) * a.body))
                   for a in lw.accumulators if a.online and a.domain == "topk"]
    exact = [a for a in lw.accumulators if not a.online and a.domain == "vocab"]
    exact_temps, exact_bodies = _statements([a.body for a in exact], "e")
    topk_exact = [a for a in lw.accumulators if not a.online and a.domain == "topk"]
    tk_temps, tk_bodies = _statements([a.body for a in topk_exact], "k")
    row_temps, row_exprs = _statements([e for _, e in lw.row_values], "r")
    coef_temps, coef_exprs = _statements([e for _, e in lw.grad_coefs], "c")
    grad_temps, (grad_expr, topk_grad_expr) = _statements([lw.grad_vocab, lw.grad_topk], "d")

    row_names = [n for n, _ in lw.row_values]
    seg_names = [seg.name for seg in lw.segments]
    loss_terms = [w.name[len("w_"):] for w in lw.weights]
    row_loss_terms = [n for n in loss_terms if n not in seg_names]
    seg_means = [U.name for seg in lw.segments for U in seg.means]
    seg_fns = []
    for seg in lw.segments:
        temps, (value, *grads) = _statements([seg.formula, *seg.dformula], f"{seg.name}_u")
        seg_fns.append(dict(name=seg.name, temps=temps, value=value, slot=lw.outputs.index(seg.name),
                            grads=[(seg_means.index(U.name), g) for U, g in zip(seg.means, grads)]))
    n_out = len(lw.outputs)

    # Runtime scalars (each loss term's weight, then the runtime parameters) come from one fp32
    # buffer, each loaded where a block first needs it.
    norm = {n: (dict(normalize or {}).get(n, "tokens") if n in loss_terms else "mean") for n in lw.outputs}
    reads_exprs = [a.body for a in lw.accumulators]
    grad_exprs = [e for _, e in lw.grad_coefs] + [lw.grad_vocab, lw.grad_topk]
    seg_exprs = [e for seg in lw.segments for e in (seg.formula, *seg.dformula)]
    scalars = [f"weight_{n}" for n in loss_terms] + sorted(
        {s.name for e in reads_exprs + grad_exprs + seg_exprs + [e for _, e in lw.row_values]
         for s in e.free_symbols if s.name.startswith(S.RUNTIME_PREFIX)})

    def loads(exprs: list[sp.Expr], weights: list[str] = ()) -> list[str]:
        used = {s.name for e in exprs for s in e.free_symbols} | {f"weight_{w}" for w in weights}
        return [f"{n} = tl.load(scalars_ptr + {i})" for i, n in enumerate(scalars) if n in used]
    scalar_loads = dict(reads=loads(reads_exprs), rows=loads([e for _, e in lw.row_values], row_loss_terms),
                        grad=loads(grad_exprs, row_loss_terms), finish=loads([], row_loss_terms),
                        segments=loads(seg_exprs, seg_names))
    for seg in seg_fns:
        seg["per_sequence"] = norm[seg["name"]] == "sequence"
    sigs = signatures(plan, key, any(scalar_loads[b] for b in ("reads", "rows", "grad", "finish")),
                      tuple(seg["name"] for seg in seg_fns if seg["per_sequence"]), bool(row_loss_terms))

    ctx = dict(
        header=header, sigs=sigs, key=key, codegen=codegen, plan=plan, lw=lw,
        sweeps={w.name: w for w in plan.sweeps},
        transform=_TL.doprint(transform), dtransform=_TL.doprint(transform.diff(X)),
        online=online, topk_online=topk_online,
        stats_tile_sums=_tile_sums([acc for group in online for acc in group["accs"]]),
        exact=list(zip([a.name for a in exact], exact_bodies)), exact_temps=exact_temps,
        exact_tile_sums=_tile_sums(list(zip([a.name for a in exact], exact_bodies))),
        topk_exact=list(zip([a.name for a in topk_exact], tk_bodies)), topk_temps=tk_temps,
        normalizers=[(name, _TL.doprint(value)) for n in lw.normalizers
                     for name, value in ((n.log_acc.name, sp.log(sp.Symbol(n.acc, real=True))),
                                         (n.symbol.name, n.alpha * M + n.beta * MT + n.log_acc))],
        row_temps=row_temps, rows=list(zip(row_names, row_exprs)),
        rows_p2=pow2(len(row_names)),
        coef_temps=coef_temps, coefs=list(zip([s.name for s, _ in lw.grad_coefs], coef_exprs)),
        grad_temps=grad_temps, grad_expr=grad_expr,
        topk_grad=None if lw.grad_topk == 0 else topk_grad_expr,
        # what each read does for -inf input elements (see _neg_inf)
        neg_inf=dict(stats=_neg_inf([a.body for a in lw.accumulators if a.online and a.domain == "vocab"], vocab),
                     exact=_neg_inf([a.body for a in exact], vocab), grad=_neg_inf([lw.grad_vocab], vocab),
                     topk=_neg_inf([sp.exp(a.alpha * S.topk_logit) * a.body for a in lw.accumulators
                                    if a.domain == "topk"] + [lw.grad_topk], topk)),
        uses_is_y=lw.grad_vocab.has(IS_Y),
        columns=[c.name for c in plan.columns], exact_columns=list(plan.exact),
        merge=_merge(plan),
        row_loss_terms=row_loss_terms, scalars=scalars, scalar_loads=scalar_loads, normalize=norm,
        grad_weights=[(n, f"weight_{n} * grad_scale" if norm[n] == "tokens" else f"weight_{n}")
                      for n in row_loss_terms],
        per_row_loss=" + ".join(f"weight_{n} * v{row_names.index(n)}" for n in row_loss_terms) or "0.0",
        finish=[(n, row_names.index(n), lw.outputs.index(n),
                 {"tokens": " * value_scale", "mean": " * count_scale", "sum": ""}[norm[n]])
                for n in lw.outputs if n not in seg_names],
        finish_loss=" + ".join(f"weight_{n} * value_{n}" for n in row_loss_terms),
        slots=dict(loss=n_out, count=n_out + 1, done=n_out + 2, fixed=n_out + 3),
        flag_slots={name: i for i, name in enumerate(FLAG_SLOTS)},
        seg_coefs=[c.name for s in lw.segments for c in s.coefs],
        segments=seg_fns, seg_means=seg_means, seg_mean_rows=[row_names.index(u) for u in seg_means],
        uses_label=any(e.has(S.label) for _, e in lw.row_values),
        uses_zym=any(e.has(ZYM) for _, e in lw.row_values + lw.grad_coefs),
        uses_vocab_size=any(e.has(S.vocab_size) for e in [lw.grad_vocab, lw.grad_topk]
                            + [e for _, e in lw.row_values + lw.grad_coefs]
                            + [a.body for a in lw.accumulators]),
    )
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tuple_lines"] = lambda names: wrap([f"{n!r}, " for n in names], "    ")
    text = env.get_template("head_loss.py.j2").render(**ctx)
    check_interface(text, sigs)
    return KernelSource(name, key, seal(text))
