"""The Triton backend's renderer: a plan printed as Triton code (``TritonPrinter``), laid out by the
Jinja2 template ``templates/head_loss.py.j2``, which includes one file a phase of the kernels
(``templates/triton/``: the row, its inputs, the stats read, the merge, the exact read, the row
values, the gradient, an ignored row, the finish, the segment kernel), each read top to bottom.

Every decision is made here in Python (and in ``emit.phases``); the templates only place the printed
statements into loops, loads and stores. They read the file's ``KernelSpec`` and the printed phases,
nothing of the ``Plan``. What any backend shares is in ``losscodegen/interface.py`` (the kernel
interface, the file's contract and seal) and ``losscodegen/emit.py`` (the phases, the header).
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping

import jinja2
import sympy as sp

from ... import program
from ... import symbols as S
from ...emit import (TINY, ArrayPrinter, KernelSource, Once, cse_arranged, cse_statements, phases, vanishes_at_neg_inf,
                     wrap)
from ...emit import online_exponent as _online_exponent, online_groups as _group_online, \
    printed_bodies as _printed, printed_gradient as _printed_gradient, stats_relative as _stats_relative
from ...interface import Signature, check_interface, kernel_spec, seal, weight_name
from ...lower import TM, ZM
from ...plan import Merge, Plan, pow2
from ...program import Dialect, MergeStep, OnlineGroup
from ...resources import TEMPLATES

_LOG2E = sp.Float(1 / math.log(2))
TEMPLATE = "head_loss.py.j2"
# the files it includes, one a phase of the kernels (templates/triton/, in the order they appear),
# and their macros
PHASES = tuple(f"triton/_{name}.j2" for name in (
    "macros", "dialect", "functions", "row", "inputs", "stats", "merge", "exact", "rows", "grad", "ignored",
    "finish", "segments")) + ("gluon/_dialect.j2", "gluon/_slices.j2")


class TritonPrinter(ArrayPrinter):
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

    def _print_expm1(self, expr) -> str:
        return f"_expm1({self._print(expr.args[0])})"   # the template's, as the two below

    def _print_expm1mx(self, expr) -> str:
        return f"_expm1mx({self._print(expr.args[0])})"

    def _print_log1p(self, expr) -> str:
        return f"_log1p({self._print(expr.args[0])})"

    def _print_tanh(self, expr: sp.tanh) -> str:
        # defined by the template: an error relative to the value (softcap's c*tanh(x/c) is ~x near 0,
        # where the saturating 2/(1 + exp(-2u)) - 1 keeps only an absolute error)
        return f"_tanh({self._print(expr.args[0])})"

    def _extremum(self, fn: str, args) -> str:
        # the GPU's min or max, one instruction where a compare and a select are two (NaN from
        # either operand, as torch.minimum and the reference); a number last (not a constexpr first)
        first, *rest = sorted(args, key=lambda a: bool(a.is_number))
        out = self._print(first)
        for a in rest:
            out = f"tl.{fn}({out}, {self._print(a)}, propagate_nan=tl.PropagateNan.ALL)"
        return out

    def _print_Min(self, expr: sp.Min) -> str:
        return self._extremum("minimum", expr.args)

    def _print_Max(self, expr: sp.Max) -> str:
        return self._extremum("maximum", expr.args)

    def _print_Pow(self, expr: sp.Pow, rational: bool = False) -> str:
        base, e = expr.args
        if e.is_Integer and int(e) < 0:
            return f"_rcp({self._print(base ** (-e))})"  # defined by the template (a fast reciprocal)
        if not e.is_number:
            return f"_pow({self._print(base)}, {self._print(e)})"   # (render's _POW_HELPER)
        return super()._print_Pow(expr, rational)

    def _print_Add(self, expr: sp.Add, order=None) -> str:
        # TINY last: Triton's interpreter makes TINY + x, a constexpr first, passed straight into a
        # call (_log(TINY + x)), a constexpr holding a tensor, which tl.log refuses. Added to a
        # product of the sum (a*b + (c*d + TINY)): two multiply-adds, where the sum and then TINY
        # is a multiply, a multiply-add and an add
        if TINY in expr.args:
            rest = expr - TINY
            products = [a for a in sp.Add.make_args(rest) if a.is_Mul]
            if len(products) >= 2:
                return f"{self._print(rest - products[-1])} + ({self._print(products[-1])} + TINY)"
            return f"{self._print(rest)} + TINY"
        return super()._print_Add(expr, order)

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
        if a.is_number:
            # (a constant stays exp: Min and Max compare their numeric arguments, and sympy cannot
            # compare a function it does not know; nothing per element to share in it anyway)
            return sp.exp(a)
        key = sp.expand(a)
        for b in args:
            rest = sp.expand(key - b)
            if b != key and rest != key and rest in args:
                return ExpFactor(args[b]) * ExpFactor(args[rest])
        return ExpFactor(args.get(key, a))
    return [e.replace(sp.exp, factor) for e in exprs]


def _statements(exprs: list[sp.Expr], prefix: str) -> tuple[list[str], list[str]]:
    """emit's ``Statements`` printed for Triton, the exponentials shared first (``_shared_exps``)."""
    return cse_statements(_TL, exprs, prefix, prepare=_shared_exps)


# What a printed function costs on the special-function unit (SFU: 16 ops a clock a streaming
# multiprocessor on Hopper, against 128 fp32 adds or multiplies): exp and log are one exp2 / lg2 and
# a multiply by a constant; a reciprocal (count_ops' DIV) one rcp and a multiply; the template's
# tanh (libdevice's, for softcap in the transform) an exp2 and a reciprocal.
_SFU_OPS = {"EXP": 1, "EXPFACTOR": 1, "LOG": 1, "DIV": 1, "TANH": 2}


def _ops(exprs: list[sp.Expr]) -> tuple[int, int]:
    """(SFU ops, other arithmetic ops: add, multiply, compare, select) to evaluate ``exprs`` once."""
    sfu = other = 0
    for e in exprs:
        e = e.replace(lambda n: isinstance(n, Once), lambda n: sp.Dummy(real=True))   # once a tile
        # a rational coefficient (z/2) is a multiply, which count_ops would call a DIV
        e = e.xreplace({r: sp.Float(r) for r in e.atoms(sp.Rational) if not r.is_Integer})
        for op, n in sp.count_ops(e, visual=True).as_coefficients_dict().items():
            if op.is_Symbol:
                sfu += _SFU_OPS.get(op.name, 0) * int(n)
                other += int(n)
    return sfu, other


def element_costs(plan: Plan) -> dict[str, tuple[int, int]]:
    """Per vocabulary element, what each read's printed formulas cost: ``{read: (SFU ops, other
    ops)}`` (loads, conversions, the -inf floors and masks and the tile sums not counted)."""
    lw, scale = plan.lowered, sp.Symbol("s", real=True)
    body, (grad_vocab, _) = _printed(lw)
    grad_teacher = [_printed_gradient(lw.grad_teacher, (*S.ELEMENT_SYMBOLS, ZM, TM))] if lw.teacher_grad else []
    stats = [sp.exp(_online_exponent(alpha, beta)) for alpha, beta in _group_online(plan)
             if (alpha, beta) != (0, 0)]
    stats += [scale * body[a.name] for accs in _group_online(plan).values() for a in accs]
    costs = {"stats": _ops(stats + [value for _, value in _stats_relative(stats)])}
    exact = [body[a.name] for a in lw.accumulators if not a.online and a.domain == "vocab"]
    for read, exprs in (("exact", exact), ("gradient", [grad_vocab, *grad_teacher])):
        if any(e != 0 for e in exprs):
            # (what the loop computes: its temporaries of element values, the row values in them once)
            temps, reduced = cse_arranged(exprs, "c", prepare=_shared_exps)
            costs[read] = _ops([e for _, e, per_element in temps if per_element] + list(reduced))
    return costs


def describe_costs(plan: Plan) -> str:
    """``element_costs`` as the kernel header and ``explain()`` print it."""
    costs = element_costs(plan)
    total = tuple(sum(c[i] for c in costs.values()) for i in (0, 1))
    return "\n".join(
        ["per vocabulary element, from the printed formulas (SFU: exp2, lg2, rcp, 16 a clock a",
         "multiprocessor on Hopper; other: add, multiply, compare, select, 128 a clock):"]
        + [f"  {read} read: {sfu} SFU + {other} other" for read, (sfu, other) in costs.items()]
        + [f"  in all: {total[0]} SFU + {total[1]} other"])


def _tile_sums(sums: list[tuple[str, str]], masked: bool, lanes: bool = False) -> list[str]:
    """Statements that sum several per-element tensors (``(name, body)``) over a tile in few
    reductions: each run of a power-of-two count of them (the binary digits of the count) is joined
    pairwise into one ``[BLOCK_V, 2, ..., 2]`` tensor, summed over the tile once, and split back
    into ``<name>_tile``. ``masked``: each tensor 0 past the row's end (else its read takes the
    columns there as -inf inputs, where every summand is 0). ``lanes``: no reduction, each lane's
    own (the row-slices kernel's, whose lanes are merged after the read)."""
    leaves = [(f"tl.where(in_row, {body}, 0.0)" if masked else body, acc) for acc, body in sums]
    if lanes:
        return [f"{acc}_tile = {body}" for body, acc in leaves]
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


class TritonDialect(Dialect):
    """The phase program in Triton: a program's row of scalars; each shard's stats loaded from the
    gathered buffer (``part``, a rank's at ``part + r * step``) in a loop over the ranks."""

    printer = _TL
    load_hint = ""      # the merge's loads' options

    def summand(self, group: OnlineGroup, body: sp.Expr) -> str:
        # (times the group's exponential of the tile, ``s<index>``)
        return self.print(sp.Symbol(f"s{group.index}", real=True) * body if group.exponent != 0 else body)

    def row_value(self, index: int) -> str:
        return f"v{index}"

    def merge(self, steps: tuple[MergeStep, ...]) -> dict[str, list[str]]:
        """``init`` (before the loop over ranks), ``maxima`` (a first loop), ``sums`` (a second)."""
        init, maxima, sums = [], [], ["at = part + r * step"]
        for c in steps:
            load = f"tl.load(at + {c.at}{self.load_hint})"
            if c.rule is Merge.MAX:
                init.append(f"{c.name} = float(\"-inf\")")
                maxima.append(f"{c.name} = tl.maximum({c.name}, tl.load(part + r * step + {c.at}{self.load_hint}))")
                sums.append(f"{c.name}_r = {load}")
            elif c.rule is Merge.SUM:
                init.append(f"{c.name} = 0.0")
                sums.append(f"{c.name} += {load}")
            elif c.rule is Merge.SCALED:
                init.append(f"{c.name} = 0.0")
                if c.moved is not None:
                    base = f"tl.load(at + {c.base_at}{self.load_hint})"
                    load = f"({load} + {self.where(f'{base} > 0.0', f'({self.print(c.moved)}) * {base}', '0.0')})"
                sums.append(f"{c.name} += {load} * {self.print(sp.exp(c.rescale))}")
            elif c.rule is Merge.ARGMAX:
                init += [f"{c.name} = 0.0", "best = float(\"-inf\")"]
                sums += [f"{c.name} = {self.where('m_r > best', load, c.name)}", "best = tl.maximum(best, m_r)"]
        return dict(init=init, maxima=maxima, sums=sums)


class SlicesDialect(TritonDialect):
    """The phase program in the row-slices kernel: the G programs of a row are its shards, their stats
    in the launch's buffer (written by the other programs of the launch: read past L1)."""

    load_hint = ', cache_modifier=".cg"'



_DIALECT, _SLICES = TritonDialect(), SlicesDialect()


def _parameters(sig: Signature) -> list[str]:
    """A jitted kernel's parameters in its declared order, wrapped: each launch's, the fixed ones,
    then the constexprs (Triton's ``name: tl.constexpr``)."""
    return (wrap([f"{a}, " for a in sig.args], "    ") + wrap([f"{a}, " for a in sig.fixed], "    ")
            + wrap([f"{a}: tl.constexpr, " for a in sig.constexprs], "    "))


# The file's _pow, printed for x ** a with an exponent known at run time (TritonPrinter._print_Pow),
# in the files that have one (the others' text unchanged)
_POW_HELPER = """


@triton.jit
def _pow(x, a):
    # x ** a as torch.pow: 1 at a = 0; 0 (a > 0) or inf (a < 0) at x = 0; for x < 0, the signed
    # power where a is an integer, NaN otherwise (exp(a * log(x)), NaN for every x < 0 and at 0**0)
    r = tl.exp2(a * tl.log2(tl.abs(x)))
    odd = (a - 2.0 * tl.floor(0.5 * a)) == 1.0
    r = tl.where(x < 0.0, tl.where(a == tl.floor(a), tl.where(odd, -r, r), float("nan")), r)
    return tl.where(a == 0.0, 1.0, r)"""


def render(plan: Plan, key: str, header: str, codegen: str,
           normalize: Mapping[str, str] | None = None) -> KernelSource:
    """The kernel file of a plan. ``normalize``: each loss term's normalisation ("tokens" where not
    given; a "sequence" term arrives as a segment term); metrics are means over the valid rows."""
    lw = plan.lowered
    name = f"head_loss_{key}"
    # (the later reads see elements relative to their maxima: zm = z - m is -inf where z is)
    vocab = (*S.ELEMENT_SYMBOLS, ZM, TM)
    # the file's contract (interface.kernel_spec), and the plan's expressions printed by phase (emit.phases):
    # the same for every backend
    spec = kernel_spec(plan, key, dict(normalize or {}))
    printed = phases(plan, spec, _TL, _statements)
    body, common = printed.body, printed.context
    row_names, seg_names = list(spec.row_values), list(spec.segments)
    row_loss_terms, scalars, sigs = list(spec.row_loss_terms), list(spec.scalars), spec.sigs

    online = _DIALECT.online(program.online(plan, body))
    exact = [a for a in lw.accumulators if not a.online and a.domain == "vocab"]

    # Runtime scalars (each loss term's weight, then the runtime parameters) come from one fp32
    # buffer, each loaded where a block first needs it.
    reads_exprs = [a.body for a in lw.accumulators]
    grad_exprs = [e for _, e in lw.grad_coefs] + [lw.grad_vocab, lw.grad_topk, lw.grad_teacher]
    seg_exprs = [e for seg in lw.segments for e in (seg.formula, *seg.dformula)]

    def loads(exprs: list[sp.Expr], weights: list[str] = ()) -> list[str]:
        used = {s.name for e in exprs for s in e.free_symbols} | set(map(weight_name, weights))
        return [f"{n} = tl.load(scalars_ptr + {i})" for i, n in enumerate(scalars) if n in used]
    scalar_loads = dict(reads=loads(reads_exprs), rows=loads([e for _, e in lw.row_values], row_loss_terms),
                        grad=loads(grad_exprs, row_loss_terms + list(spec.segment_row_terms)),
                        finish=loads([], row_loss_terms), segments=loads(seg_exprs, seg_names))

    # whether a read takes the columns past the row's end as -inf inputs (``pad``: one select an
    # element for the logits, none for the teacher, where masking costs one for each running max and
    # each tile sum), given what it does for -inf input elements (emit.neg_inf_handling). Only where
    # that saves two selects or more: measured on the H100 at 8192 x 128256 against masking, CE (one
    # saved) 3.5% slower, GRPO + entropy + clip (two) 1.1% faster, CE + z + FKL + entropy (five) 2.5%
    # faster
    neg_inf = common["neg_inf"]
    stats_sums = [sp.exp(_online_exponent(a.alpha, a.beta)) * body[a.name] for a in lw.accumulators
                  if a.online and a.domain == "vocab"]
    masks = dict(stats=len(stats_sums) + 1 + lw.uses_teacher + lw.uses_argmax, exact=len(exact))
    # (not where a sum reads a vector: its entries past the row's end load as 0, where a summand
    # need not vanish, softmax * log(u) is 0 * -inf; found by the fuzzer)
    pad = {read: masks[read] - 1 >= 2 and not neg_inf[read]["gone"] and all(
        vanishes_at_neg_inf(e, vocab, floored=neg_inf[read]["floor"]) and not S.vectors_in(e) for e in exprs)
        for read, exprs in (("stats", stats_sums), ("exact", [body[a.name] for a in exact]))}

    # a read whose expressions read the logits (and the teacher's) only relative to their maxima
    # floors zm = z - m rather than z, so that logit_scale*x - m is one multiply-add an element
    relative_floor = {read: neg_inf[read]["floor"] and not any(e.has(*S.ELEMENT_SYMBOLS) for e in exprs)
                      for read, exprs in (("exact", [body[a.name] for a in exact]),
                                          ("grad", [printed.grad_vocab, printed.grad_teacher]))}

    # x ** a for an exponent known only at run time (a tensor parameter), where a formula has one
    run_time_powers = any(isinstance(n, sp.Pow) and not n.exp.is_number
                          for e in reads_exprs + grad_exprs + seg_exprs + [e for _, e in lw.row_values]
                          for n in sp.preorder_traversal(e))
    ctx = dict(
        common,
        pow_helper=_POW_HELPER if run_time_powers else "",
        header="\n#   ".join([f"{header}\n#\n# cost:", *describe_costs(plan).splitlines()]), spec=spec, sigs=sigs,
        key=key, codegen=codegen, sweeps={w.name: w for w in plan.sweeps}, dialect="triton/_dialect.j2",
        online=online,
        stats_tile_sums=_tile_sums([acc for group in online for acc in group["accs"]], not pad["stats"]),
        exact_tile_sums=_tile_sums(common["exact"], not pad["exact"]),
        rows_p2=pow2(len(row_names)), pad=pad, relative_floor=relative_floor, merge=_DIALECT.merge(program.merge(plan)), scalar_loads=scalar_loads,
        per_row_loss=_DIALECT.row_loss(program.row_loss(spec.row_loss_terms, spec.row_values), weight_name),
        # the row-slices kernel's own printing of the same phases, where the file has one
        slices=dict(merge=_SLICES.merge(program.merge(plan)), dialect="gluon/_dialect.j2",
                    streams=("x", "t") if lw.uses_teacher else ("x",),
                    stats_tile_sums=_tile_sums([acc for group in online for acc in group["accs"]],
                                               not pad["stats"], lanes=True),
                    exact_tile_sums=_tile_sums(common["exact"], not pad["exact"], lanes=True))
        if "slices" in sigs else None,
    )
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tuple_lines"] = lambda names: wrap([f"{n!r}, " for n in names], "    ")
    env.filters["parameters"] = _parameters
    text = env.get_template(TEMPLATE).render(**ctx)
    check_interface(text, sigs)
    return KernelSource(name, key, seal(text))
