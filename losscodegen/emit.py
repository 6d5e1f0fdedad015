"""Stage 4, emit: what every backend's rendering shares. The base printer of sympy expressions for
an array module (``ArrayPrinter``; ``TorchPrinter`` for the float64 reference), how a read keeps
``0 * log 0 = 0`` at -inf inputs (``neg_inf_handling``), the generated file's header, the kernel
interface declared once (``signatures``, ``check_interface``), the flag slots, and the seal of a
kernel file.

A backend's renderer (``losscodegen/backends/<name>/``) prints the plan with its own printer and
lays it out with its template.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import sympy as sp
from sympy.printing.pycode import PythonCodePrinter, _print_known_const, _print_known_func

from . import symbols as S
from .lower import IS_ARGMAX, IS_Y, M, MT, TM, ZM, ZYM
from .plan import Plan


class ArrayPrinter(PythonCodePrinter):
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

    # lower.CANCELLATIONS, which lowering writes where fp32 would cancel
    def _print_expm1(self, expr) -> str:
        return self._call("expm1", expr.args[0])

    def _print_log1p(self, expr) -> str:
        return self._call("log1p", expr.args[0])

    def _print_expm1mx(self, expr) -> str:
        x = self.parenthesize(expr.args[0], 100)
        return f"({self._call('expm1', expr.args[0])} - {x})"

    def _print_Abs(self, expr: sp.Abs) -> str:
        return self._call("abs", expr.args[0])

    def _print_Once(self, expr) -> str:
        return f"({self._print(expr.args[0])})"   # (emit.Once: row values combined first)

    def _print_sign(self, expr: sp.sign) -> str:
        a = self._print(expr.args[0])
        return f"{self.module}.where({a} > 0, 1.0, {self.module}.where({a} < 0, -1.0, 0.0))"

    def _print_tanh(self, expr: sp.tanh) -> str:
        return self._call("tanh", expr.args[0])

    def _print_Pow(self, expr: sp.Pow, rational: bool = False) -> str:
        base, e = expr.args
        if not e.is_number:
            # an exponent known at run time: pow's own (1 at a = 0, a signed power of x < 0 for an
            # integer a), where exp(a * log(x)) is NaN
            return self._call("pow", base, e)
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

    def _print_Add(self, expr: sp.Add, order=None) -> str:
        # a top-k logit relative to the row's maximum, c*(z_k - m), computed before the rest: where
        # the rest goes first, (rest - c*m) + c*z_k rounds at |m| (on a spread row of |m| = 4000,
        # 1e-4: a top-k KL 300 times further from float64 than torch's, found by the fuzzer)
        for a in expr.args:
            c, x = a.as_coeff_Mul()
            if x == S.topk_logit and -c * M in expr.args and len(expr.args) > 2:
                rest = sp.Add(*[b for b in expr.args if b not in (a, -c * M)])
                relative = f"({self._print(S.topk_logit - M)})"
                return f"{relative if c == 1 else f'{self._print(c)}*{relative}'} + {self._print(rest)}"
        return super()._print_Add(expr, order)

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
    if _name.startswith("_print_") and _name not in vars(ArrayPrinter) \
            and getattr(PythonCodePrinter, _name) in (_print_known_func, _print_known_const):
        setattr(ArrayPrinter, _name, ArrayPrinter._print_unsupported)


class TorchPrinter(ArrayPrinter):
    module = "torch"


# The smallest normal fp32 (a backend's TINY): see no_underflow_nan.
TINY = sp.Symbol("TINY", positive=True)


def _underflows(s: sp.Expr, elements: tuple[sp.Symbol, ...]) -> bool:
    """Whether ``s`` is a sum of exponentials of the elements times factors free of them: never 0 in
    exact arithmetic, but 0 (or subnormal) in fp32 wherever each of its exponentials underflows."""
    def term(t: sp.Expr) -> bool:
        factors = sp.Mul.make_args(t)
        return (any(isinstance(f, sp.exp) and f.has(*elements) for f in factors)
                and all(isinstance(f, sp.exp) or not f.has(*elements) for f in factors))
    return all(term(t) for t in sp.Add.make_args(s))


def no_underflow_nan(expr: sp.Expr, elements: tuple[sp.Symbol, ...]) -> sp.Expr:
    """``expr`` with each log and reciprocal of a sum of exponentials of the elements (see
    _underflows) taken of that sum plus TINY. JSD's mixture ``beta p + (1 - beta) q`` underflows
    where p and q both do (finite logits some 100 below their rows' maxima), and ``p (log p -
    log M)`` is then 0 * inf, NaN; so is the gradient's ``p / M``. Plus TINY is the sum itself in
    fp32 wherever the sum is above 2^-102 (TINY is below half its ulp), and below, the log and the
    reciprocal are finite (at most 88 and 2^126), so the summand's exponential factors that
    underflowed with the sum make it 0 where it was NaN; a sum that is negative stays negative (its
    log NaN). One addition per element, shared by the log and the reciprocal."""
    def guarded(e: sp.Expr) -> sp.Expr | None:
        if isinstance(e, sp.log) and _underflows(e.args[0], elements):
            return sp.log(e.args[0] + TINY)
        if isinstance(e, sp.Pow) and e.exp.is_negative and _underflows(e.base, elements):
            return (e.base + TINY) ** e.exp
        return None
    return expr.replace(lambda e: guarded(e) is not None, guarded)


def _exp_terms(s: sp.Expr, elements: tuple[sp.Symbol, ...]) -> list[tuple[sp.Expr, sp.Expr]] | None:
    """``[(c_k, a_k)]`` with ``s = sum_k c_k*exp(a_k)``, each ``c_k`` free of the elements, or None."""
    out = []
    for t in sp.Add.make_args(s):
        exps = [f for f in sp.Mul.make_args(t) if isinstance(f, sp.exp) and f.has(*elements)]
        if len(exps) != 1:
            return None
        c = sp.Mul(*[f for f in sp.Mul.make_args(t) if f is not exps[0]])
        if c.has(*elements):
            return None
        out.append((c, exps[0].args[0]))
    return out


def mixtures_in_log_space(expr: sp.Expr, elements: tuple[sp.Symbol, ...]) -> sp.Expr:
    """``expr`` with each log of a mixture of two exponentials, ``log(c1 exp(a1) + c2 exp(a2))``
    (JSD's ``log(beta p + (1 - beta) q)``), taken from the larger exponent: ``h + log(c_h + c_l u)``
    with ``h = a1 if a1 >= a2 else a2`` and ``u = exp(-|a1 - a2|)``, as torch's logsumexp does. The
    log of the sum itself errs by the rounding of both exponentials, an ulp of 1 in ``log(p / M)``
    where the gradient ``beta p (log(p / M) - KL)`` cancels to a few percent of it; from the larger
    exponent, ``a1 - h`` is exactly 0. ``h`` and the coefficients are picked by the one comparison
    (a max would be a second one). Where both ``exp(a1)`` and ``exp(a2)`` are in ``expr`` outside
    the log they become ``exp(h)`` and ``exp(h) u``: two exponentials for the pair, as before, and
    one more for ``u``; where only one is, it stays itself (one exponential either way, and neither
    a select nor a product). Applied after no_underflow_nan (whose plus TINY marks the logs of sums
    of exponentials), and plus TINY still, where ``c_h`` is 0 (beta = 0) and ``u`` underflows."""
    for log in sorted(expr.atoms(sp.log), key=sp.default_sort_key):
        if TINY not in sp.Add.make_args(log.args[0]):   # (not a sum of exponentials: no_underflow_nan)
            continue
        terms = _exp_terms(log.args[0] - TINY, elements)
        if terms is None or len(terms) != 2:
            continue
        (c1, a1), (c2, a2) = terms
        # (all from the one difference: a1 >= a2 where a1 - a2 >= 0, as fp32 rounds too)
        first = sp.Ge(a1 - a2, 0)
        pick = lambda x, y: sp.Piecewise((x, first), (y, True))  # noqa: E731
        h, u = pick(a1, a2), sp.exp(-sp.Abs(a1 - a2))
        expr = expr.xreplace({log: h + sp.log(pick(c1, c2) + pick(c2, c1) * u + TINY)})
        for a, b in ((a1, a2), (a2, a1)):   # a - h, a log-ratio (log(p / M)): min(a - b, 0), one op
            ratio = {*sp.Add.make_args(a), -h}
            expr = expr.replace(lambda n: isinstance(n, sp.Add) and ratio <= set(n.args),
                                lambda n: sp.Add(*(set(n.args) - ratio)) + sp.Min(a - b, 0))
        if expr.has(sp.exp(a1)) and expr.has(sp.exp(a2)):
            expr = expr.xreplace({sp.exp(a1): sp.exp(h) * pick(1, u), sp.exp(a2): sp.exp(h) * pick(u, 1)})
    return expr


def _exponent_coefficients(f: sp.Expr, elements: tuple[sp.Symbol, ...]) -> list[sp.Expr] | None:
    """``[a, b, ...]`` of ``f = exp(a*z + b*t + row)``, each a number >= 0 (so that ``f`` is 0 where
    the elements with a non-zero one are -inf), or None."""
    if not isinstance(f, sp.exp):
        return None
    arg = sp.expand(f.args[0])
    coefs = [arg.coeff(v) for v in elements]
    rest = arg - sum(c * v for c, v in zip(coefs, elements))
    return coefs if all(c.is_number and c >= 0 for c in coefs) and not rest.has(*elements) else None


def _finite_at_neg_inf(expr: sp.Expr, elements: tuple[sp.Symbol, ...], *, floored: bool) -> bool:
    """Whether ``expr`` stays free of NaN where element symbols are -inf (``floored``: where they are
    the template's FLOOR, a very negative finite number, instead): built by sums, products and
    positive integer powers from factors free of them, ``exp(a*z + b*t + row)`` with ``a, b >= 0``
    (which are then 0), and, when floored, the element symbols themselves."""
    if not expr.has(*elements):
        return True
    if expr in elements:
        return floored
    if isinstance(expr, (sp.Max, sp.Min, sp.Abs)):
        return all(_finite_at_neg_inf(a, elements, floored=floored) for a in expr.args)
    if isinstance(expr, sp.Piecewise):   # (a condition that reads a NaN is false, never NaN)
        return all(_finite_at_neg_inf(v, elements, floored=floored) for v, _ in expr.args)
    if isinstance(expr, sp.exp) and isinstance(expr.args[0], sp.Max):
        return all(_finite_at_neg_inf(sp.exp(a), elements, floored=floored) for a in expr.args[0].args)
    if isinstance(expr, sp.exp) and isinstance(expr.args[0], sp.Piecewise):
        return all(_finite_at_neg_inf(sp.exp(a), elements, floored=floored) for a, _ in expr.args[0].args)
    if isinstance(expr, sp.exp) and (-expr.args[0]).func is sp.Abs:   # in [0, 1] unless NaN
        return _finite_at_neg_inf(-expr.args[0], elements, floored=floored)
    if isinstance(expr, sp.exp):
        return _exponent_coefficients(expr, elements) is not None
    if isinstance(expr, (sp.Add, sp.Mul)):
        return all(_finite_at_neg_inf(a, elements, floored=floored) for a in expr.args)
    if isinstance(expr, sp.Pow) and expr.exp.is_Integer and expr.exp > 0:
        return _finite_at_neg_inf(expr.base, elements, floored=floored)
    if isinstance(expr, sp.log) or (isinstance(expr, sp.Pow) and expr.exp.is_negative):
        # the log or a reciprocal of a sum plus TINY (no_underflow_nan): finite where the sum is
        arg = expr.args[0]
        return TINY in sp.Add.make_args(arg) and _finite_at_neg_inf(arg, elements, floored=floored)
    return False


def vanishes_at_neg_inf(expr: sp.Expr, elements: tuple[sp.Symbol, ...], *, floored: bool) -> bool:
    """Whether ``expr`` is exactly 0 where every element symbol is -inf (``floored``: FLOOR): each of
    its addends a product of factors that stay finite there (_finite_at_neg_inf) with one
    ``exp(a*z + b*t + row)``, ``a, b >= 0`` not both 0, which is then 0. A read whose tile sums all
    vanish so can take the columns past the row's end as -inf inputs, instead of masking each sum."""
    def vanishing(f: sp.Expr) -> bool:
        coefs = _exponent_coefficients(f, elements)
        return coefs is not None and any(c > 0 for c in coefs)
    def degree(f: sp.Expr) -> int:
        # of the elements, outside functions: FLOOR**3 overflows fp32 to -inf, and 0 * -inf is NaN
        if f in elements:
            return 1
        if isinstance(f, sp.Pow) and f.exp.is_Integer and f.exp > 0:
            return int(f.exp) * degree(f.base)
        if isinstance(f, (sp.Mul, sp.Add)):
            parts = [degree(a) for a in f.args]
            return sum(parts) if isinstance(f, sp.Mul) else max(parts)
        return 0
    return all(any(vanishing(f) for f in sp.Mul.make_args(t)) and degree(t) <= 2
               and _finite_at_neg_inf(t, elements, floored=floored) for t in sp.Add.make_args(expr))


def neg_inf_handling(exprs: list[sp.Expr], elements: tuple[sp.Symbol, ...]) -> dict[str, bool]:
    """How a read whose per-element expressions are ``exprs`` keeps the ``0 * log 0 = 0`` convention
    at -inf input elements, as cheaply as it can (each is an instruction or more per element):
    ``floor`` -inf inputs to FLOOR where a product with an element would be 0 * -inf; and drop the
    elements where every input is -inf (``gone``: a padded or masked vocabulary entry) where even
    floored inputs leave a NaN (JSD's log of a mixture that is 0 there)."""
    return dict(floor=not all(_finite_at_neg_inf(e, elements, floored=False) for e in exprs),
                gone=not all(_finite_at_neg_inf(e, elements, floored=True) for e in exprs))


# ---- what every backend's reads print: the summands with their numeric guards, the online groups --------

# the running maxima as the exponents' reference: m_ref is 0 while every logit so far is -inf
M_REF, MT_REF = sp.Symbol("m_ref", real=True), sp.Symbol("m_t_ref", real=True)


def online_groups(plan: Plan) -> dict[tuple, list]:
    """The first read's online accumulators over the vocabulary, grouped by their exponent (alpha,
    beta): a group shares one rescale and one exponential a tile."""
    groups: dict[tuple, list] = {}
    for acc in plan.lowered.accumulators:
        if acc.online and acc.domain == "vocab":
            groups.setdefault((acc.alpha, acc.beta), []).append(acc)
    return groups


def printed_bodies(lw) -> tuple[dict[str, sp.Expr], tuple[sp.Expr, sp.Expr]]:
    """Each sum's summand and the gradient's vocabulary and top-k parts as printed: a sum of
    exponentials under a log or a reciprocal plus TINY (no_underflow_nan), and in the gradient, the
    log of a mixture of two exponentials from the larger exponent (mixtures_in_log_space)."""
    vocab, topk = (*S.ELEMENT_SYMBOLS, ZM, TM), S.TOPK_SYMBOLS
    # the log of a mixture from the larger exponent in the gradient only, where log(p / M) enters a
    # difference that cancels (JSD's beta p (log(p / M) - KL)); in a sum its error averages out, and
    # there the plain log is 12 operations an element fewer (measured: JSD 4.74 ms with both reads
    # so, against 4.51 with neither, on an H100 at 8192 x 128256)
    body = {a.name: no_underflow_nan(a.body, topk if a.domain == "topk" else vocab) for a in lw.accumulators}
    return body, (printed_gradient(lw.grad_vocab, vocab), printed_gradient(lw.grad_topk, topk))


def printed_gradient(grad: sp.Expr, elements: tuple[sp.Symbol, ...]) -> sp.Expr:
    """A per-element gradient as printed (``printed_bodies``): dL/dz_i, its top-k part, dL/dt_i."""
    return mixtures_in_log_space(no_underflow_nan(grad, elements), elements)


def label_part(grad: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """The gradient over the vocabulary as the part every element has and the label's: where
    ``is_y`` enters only as ``is_y * c`` with ``c`` a row value (cross-entropy's ``g1*is_y``), a
    kernel adds ``c`` at the label's column once a row rather than a compare and a multiply-add an
    element; otherwise ``(grad, 0)``."""
    terms = sp.Add.make_args(grad)
    label = sp.Add(*(t / IS_Y for t in terms if t.has(IS_Y)))
    if label.has(IS_Y) or any(_elementwise(s) for s in label.free_symbols):
        return grad, sp.S.Zero
    return sp.Add(*(t for t in terms if not t.has(IS_Y))), label


def _topk_summand(acc, body: sp.Expr) -> sp.Expr:
    """A top-k sum's summand, ``exp(alpha*(z_k - m)) * body``; 0 where the row's logits (a vocab
    shard's) are all -inf, whose ``m`` is -inf too (``exp(z_k - m)`` is inf there, and the merged sums
    NaN; found by the fuzzer on 2 ranks). A sum of the teacher's weights alone (alpha 0) still counts."""
    summand = sp.exp(acc.alpha * (S.topk_logit - M)) * body
    # (unevaluated: sympy knows a real m is above -oo)
    shard_has_logits = sp.StrictGreaterThan(M, -sp.oo, evaluate=False)
    return summand if acc.alpha == 0 else sp.Piecewise((summand, shard_has_logits), (0, True), evaluate=False)


def online_exponent(alpha: sp.Expr, beta: sp.Expr) -> sp.Expr:
    """The exponent of an online group's elements, against the running maxima: in the elements
    relative to them (zm = z - m_ref, tm = t - m_t_ref), which the relative sums' bodies read too,
    so that the exponent and the bodies share one subtraction an element."""
    return alpha * ZM + beta * TM


def stats_relative(exprs: list[sp.Expr]) -> list[tuple[sp.Symbol, sp.Expr]]:
    """The first read's relative elements that ``exprs`` read, each with its value."""
    return [(e, value) for e, value in ((ZM, S.logit - M_REF), (TM, S.teacher_logit - MT_REF))
            if any(x.has(e) for x in exprs)]


# ---- what every backend's kernels compute, printed and grouped by the phase that computes it ------

# the logits' transform, of the raw logit x: the scale, then softcap's tanh
X = sp.Symbol("x", real=True)
LOGIT_SCALE = sp.Symbol("logit_scale", positive=True)
SOFTCAP = sp.Symbol("softcap", positive=True)

# A backend's statements of a group of expressions: (``prefix0 = code`` for each common
# subexpression, in order; then each expression's code, written with them)
Statements = Callable[[list[sp.Expr], str], tuple[list[str], list[str]]]


def _elementwise(s: sp.Symbol) -> bool:
    """Whether a symbol of the printed formulas is a value per element (a tile in a read's loop):
    the elements, relative ones and indicators among them, and the per-class vectors."""
    return s in _ELEMENTWISE or s.name.startswith(S.VECTOR_PREFIX)


_ELEMENTWISE = frozenset((*S.ELEMENT_SYMBOLS, *S.TOPK_SYMBOLS, ZM, TM, IS_Y, IS_ARGMAX, X))


class Once(sp.Function):
    """Row values combined before they meet an element: ``a*b*x`` is computed left to right, so
    where the element sorts first (``d0*g0*beta``) the row values are multiplied into the element
    one at a time, an operation an element each; ``Once(g0*beta)*d0`` is their product, printed in
    parentheses, computed once a tile."""
    nargs = 1


def _reuse_negations(temps: list[tuple[sp.Symbol, sp.Expr]],
                     exprs: list[sp.Expr]) -> tuple[list[tuple[sp.Symbol, sp.Expr]], list[sp.Expr]]:
    """``temps`` and ``exprs`` with each sum that holds a temporary's terms, or their negations,
    written with the temporary. sympy's cse shares the terms of sums as they stand, so ``d1 = L - t``
    leaves ``-L + d0 + t`` (an ``|a1 - a2|`` whose sympy sign is the other) as two operations
    where ``d0 - d1`` is one."""
    known: list[tuple[sp.Symbol, set[sp.Expr]]] = []

    def shorter(node: sp.Add) -> sp.Expr:
        args = set(node.args)
        for s, terms in known:
            for sign in (1, -1):
                part = {sign * a for a in terms}
                if part <= args:
                    return sp.Add(*(args - part)) + sign * s
        return node

    def rewrite(e: sp.Expr) -> sp.Expr:
        return e.replace(lambda n: isinstance(n, sp.Add), shorter)
    out = []
    for s, e in temps:
        out.append((s, rewrite(e)))
        if isinstance(e, sp.Add):
            known.append((s, set(e.args)))
    return out, [rewrite(e) for e in exprs]


def _arranged(e: sp.Expr, elementwise: Callable[[sp.Expr], bool]) -> sp.Expr:
    """``e`` arranged for fewer operations an element, each an identity: a factor that is an element
    value common to every term of a sum taken out where a term's remaining product holds a row
    value (``d5*g0*beta*X + d5*g1`` is ``d5*(Once(g0*beta)*X + g1)``, a multiply-add and a multiply
    instead of three multiplies and a multiply-add), and the row values among a sum's or a
    product's operands combined first (``Once``)."""
    def arrange(node: sp.Expr) -> sp.Expr:
        if isinstance(node, sp.Add):
            node = _factored(node, elementwise)
        if not isinstance(node, (sp.Add, sp.Mul)):
            return node
        # (a product's sign is no operand: -g0*x is (-g0)*x, a row value negated)
        row = [a for a in node.args if not elementwise(a) and not (node.is_Mul and a == -1)]
        if len(row) >= 2 and any(elementwise(a) for a in node.args):
            return node.func(Once(node.func(*row)), *[a for a in node.args if a not in row])
        return node
    return e.replace(lambda n: isinstance(n, (sp.Add, sp.Mul)), arrange)


def _factored(node: sp.Add, elementwise: Callable[[sp.Expr], bool]) -> sp.Expr:
    """A sum with the element values common to all its terms taken out, where a term's remaining
    product holds a row value (which then meets the sum as one multiply-add), else the sum."""
    terms = [sp.Mul.make_args(t) for t in node.args]
    common = [f for f in terms[0] if elementwise(f) and all(f in t for t in terms[1:])]
    if not common:
        return node
    rests = [sp.Mul(*[f for f in t if f not in common]) for t in terms]
    if not any(isinstance(r, sp.Mul) and any(not elementwise(f) for f in r.args) for r in rests):
        return node
    return sp.Mul(*common, sp.Add(*rests))


def cse_arranged(exprs: list[sp.Expr], prefix: str,
                 prepare: Callable[[list[sp.Expr]], list[sp.Expr]] | None = None
                 ) -> tuple[list[tuple[sp.Symbol, sp.Expr, bool]], list[sp.Expr]]:
    """sympy's common subexpressions (``prefix0``, ...) of ``exprs`` (after ``prepare``, a backend's
    rewrite that lets more of them be shared), the negations of sums shared too
    (``_reuse_negations``), each arranged for fewer operations an element (``_arranged``):
    ``[(temporary, its value, whether it is a value per element)]`` and ``exprs`` written with them."""
    temps, reduced = sp.cse(prepare(exprs) if prepare else exprs, symbols=sp.numbered_symbols(prefix, real=True),
                            order="canonical")
    temps, reduced = _reuse_negations(temps, reduced)
    per_element: set[sp.Symbol] = set()

    def elementwise(e: sp.Expr) -> bool:
        return any(_elementwise(s) or s in per_element for s in e.free_symbols)
    arranged = []
    for s, e in temps:
        arranged.append((s, _arranged(e, elementwise), elementwise(e)))
        if elementwise(e):
            per_element.add(s)
    return arranged, [_arranged(e, elementwise) for e in reduced]


def cse_statements(printer: ArrayPrinter, exprs: list[sp.Expr], prefix: str,
                   prepare: Callable[[list[sp.Expr]], list[sp.Expr]] | None = None) -> tuple[list[str], list[str]]:
    """``Statements`` with ``printer``: ``cse_arranged``'s temporaries, then the results."""
    temps, reduced = cse_arranged(exprs, prefix, prepare)
    return [f"{s} = {printer.doprint(e)}" for s, e, _ in temps], [printer.doprint(e) for e in reduced]


@dataclass(frozen=True)
class Phases:
    """A plan's expressions as one backend prints them, grouped by the phase of its kernels that
    computes them. ``context`` holds them under the names every backend's template reads:

    - the reads: ``transform``/``dtransform`` (the logits' transform and its derivative),
      ``stats_relative`` (the first read's elements relative to the running maxima), ``topk_online``
      (the top-k entries' online summands), ``exact_temps``/``exact`` (the exact read's summands),
      ``topk_temps``/``topk_exact`` (the exact sums of the top-k entries), ``normalizers``, and
      ``neg_inf`` (each read's handling of -inf inputs, ``neg_inf_handling``; ``floor_topk``: the
      top-k entries' -inf as FLOOR, ``uses_ninf``: a later read compares inputs with -inf);
    - the rows: ``row_temps``/``rows`` (each row value), ``finish``/``finish_loss`` (each output's
      reduction over the rows and its normalisation: ``uses_value_scale`` where an output is
      divided as tokens are, ``uses_count_scale`` by the valid rows), ``grad_weights``;
    - the gradient: ``coef_temps``/``coefs`` (its per-row coefficients), ``grad_temps``/``grad_expr``
      (over the vocabulary, but for the label's part), ``grad_label`` (the label's part, added at
      its column: ``label_part``; None where the label's column has no part of its own, or a
      top-k part, whose ids may hold the label, is there), ``topk_grad_temps``/``topk_grad`` (None
      without a top-k part),
      ``grad_means`` (the segment means a row term of segment statistics' direct path reads);
    - the segments: ``segments`` (each segment term's value and gradients in the means),
      ``seg_coefs``, ``seg_mean_rows``, and the divisors they use (``uses_div``: the segments',
      ``uses_div_seq``: the sequences', ``uses_div_rows``: a row term's), ``seg_row_weights`` (each
      row term of segment statistics' weight in the gradient read: ``uses_seq_scale`` where one is
      divided by the sequences);
    - and what the template declares only where read: ``uses_label``, ``uses_zym``,
      ``uses_vocab_size``, ``uses_is_y``, ``uses_is_argmax``, ``uses_argmax`` (the first read keeps
      the argmax), ``grad_uses_teacher`` (the gradient read loads the teacher), ``uses_vocab_start``
      (an index placed in the vocab shard), ``flag_slots``.

    With the ``KernelSpec``, this is all a template reads: nothing of the ``Plan`` or ``Lowered``.

    ``body``, ``grad_vocab`` (but for the label's part) and ``grad_topk`` are the sympy expressions
    printed (``printed_bodies``), for what a backend prints itself (its first read's layout)."""

    body: dict[str, sp.Expr]
    grad_vocab: sp.Expr
    grad_topk: sp.Expr
    context: dict[str, Any]
    grad_teacher: sp.Expr = sp.S.Zero   # dL/dt_i, in the variant that writes it (``Lowered.teacher_grad``)


def phases(plan: Plan, spec: KernelSpec, printer: ArrayPrinter, statements: Statements) -> Phases:
    """The plan's expressions printed with ``printer`` (``statements`` for a group with common
    subexpressions), by phase; the same grouping for every backend."""
    lw = plan.lowered
    vocab, topk = (*S.ELEMENT_SYMBOLS, ZM, TM), S.TOPK_SYMBOLS
    transform = LOGIT_SCALE * (SOFTCAP * sp.tanh(X / SOFTCAP) if plan.softcap else X)
    body, (grad_vocab, grad_topk) = printed_bodies(lw)
    grad_dense, grad_label = label_part(grad_vocab) if grad_topk == 0 else (grad_vocab, sp.S.Zero)
    stats_exprs = [e for (alpha, beta), accs in online_groups(plan).items()
                   for e in [online_exponent(alpha, beta)] + [body[a.name] for a in accs]]
    exact = [a for a in lw.accumulators if not a.online and a.domain == "vocab"]
    topk_exact = [a for a in lw.accumulators if not a.online and a.domain == "topk"]
    exact_temps, exact_bodies = statements([body[a.name] for a in exact], "e")
    tk_temps, tk_bodies = statements([body[a.name] for a in topk_exact], "k")
    row_temps, row_exprs = statements([e for _, e in lw.row_values], "r")
    coef_temps, coef_exprs = statements([e for _, e in lw.grad_coefs], "c")
    # (apart: the vocabulary's temporaries live in its loop, the top-k entries' outside it; dL/dt_i,
    # where the kernel writes it, shares the loop's, exp(tm - L_N) among them)
    grad_teacher = [printed_gradient(lw.grad_teacher, vocab)] if lw.teacher_grad else []
    grad_temps, (grad_expr, *teacher_expr) = statements([grad_dense, *grad_teacher], "d")
    topk_grad_temps, (topk_grad_expr,) = statements([grad_topk], "dk")

    row_names, seg_means, norm = list(spec.row_values), list(spec.segment_means), spec.normalization
    segments = []
    for seg in lw.segments:
        temps, (value, *grads) = statements([seg.formula, *seg.dformula], f"{seg.name}_u")
        segments.append(dict(name=seg.name, temps=temps, value=value, slot=lw.outputs.index(seg.name),
                             per_sequence=norm[seg.name] == "sequence",
                             # its divisor: a row term of segment statistics is divided as a row term is,
                             # unless normalised by sequence (each row then over its segment's rows: terms.bind)
                             div="div_seq" if norm[seg.name] == "sequence" else "div_rows" if seg.rows else "div",
                             grads=[(seg_means.index(U.name), g) for U, g in zip(seg.means, grads)],
                             # a row term of segment statistics: its row values, read row by row
                             rows=[(p.name, row_names.index(p.name)) for p in seg.rows],
                             valid=row_names.index(seg.valid) if seg.valid else None))
    head_exprs = ([a.body for a in lw.accumulators] + [e for _, e in lw.grad_coefs + lw.row_values]
                  + [lw.grad_vocab, lw.grad_topk, lw.grad_teacher])
    neg_inf = dict(stats=neg_inf_handling([body[a.name] for a in lw.accumulators
                                           if a.online and a.domain == "vocab"], vocab),
                   exact=neg_inf_handling([body[a.name] for a in exact], vocab),
                   grad=neg_inf_handling([grad_vocab, *grad_teacher], vocab),
                   topk=neg_inf_handling([sp.exp(a.alpha * S.topk_logit) * body[a.name] for a in lw.accumulators
                                          if a.domain == "topk"] + [grad_topk], topk))
    context = dict(
        transform=printer.doprint(transform), dtransform=printer.doprint(transform.diff(X)),
        stats_relative=[(e.name, printer.doprint(value)) for e, value in stats_relative(stats_exprs)],
        topk_online=[(a.name, printer.doprint(_topk_summand(a, body[a.name])))
                     for a in lw.accumulators if a.online and a.domain == "topk"],
        exact=list(zip([a.name for a in exact], exact_bodies)), exact_temps=exact_temps,
        topk_exact=list(zip([a.name for a in topk_exact], tk_bodies)), topk_temps=tk_temps,
        normalizers=[(name, printer.doprint(value)) for n in lw.normalizers
                     for name, value in ((n.log_acc.name, sp.log(sp.Symbol(n.acc, real=True))),
                                         (n.symbol.name, n.alpha * M + n.beta * MT + n.log_acc))],
        neg_inf=neg_inf,
        row_temps=row_temps, rows=list(zip(row_names, row_exprs)),
        finish=[(n, row_names.index(n), lw.outputs.index(n),
                 {"tokens": " * value_scale", "mean": " * count_scale", "sum": ""}[norm[n]])
                for n in lw.outputs if n not in spec.segments],
        finish_loss=" + ".join(f"weight_{n} * value_{n}" for n in spec.row_loss_terms),
        grad_weights=[(n, f"weight_{n} * grad_scale" if norm[n] == "tokens" else f"weight_{n}")
                      for n in spec.row_loss_terms],
        coef_temps=coef_temps, coefs=list(zip([s.name for s, _ in lw.grad_coefs], coef_exprs)),
        grad_temps=grad_temps, grad_expr=grad_expr, teacher_grad=teacher_expr[0] if teacher_expr else None,
        grad_label=None if grad_label == 0 else printer.doprint(grad_label),
        topk_grad=None if lw.grad_topk == 0 else topk_grad_expr, topk_grad_temps=topk_grad_temps,
        grad_means=[(U.name, seg_means.index(U.name)) for seg in lw.segments if seg.rows for U in seg.means],
        # a row term of segment statistics' direct path: its weight over its divisor, as its value's
        seg_row_weights=[(n, f"weight_{n} * {'seq_scale' if norm[n] == 'sequence' else 'grad_scale'}")
                         for n in spec.segment_row_terms],
        segments=segments, seg_coefs=[c.name for s in lw.segments for c in s.coefs],
        seg_mean_rows=[row_names.index(u) for u in seg_means],
        uses_label=any(e.has(S.label) for _, e in lw.row_values),
        uses_zym=any(e.has(ZYM) for _, e in lw.row_values + lw.grad_coefs),
        uses_vocab_size=any(e.has(S.vocab_size) for e in head_exprs),
        uses_is_y=grad_dense.has(IS_Y), uses_is_argmax=lw.grad_vocab.has(IS_ARGMAX),
        uses_argmax=lw.uses_argmax, grad_uses_teacher=lw.grad_uses_teacher,
        # a label, the argmax, a top-k id or a vector's entry placed in this vocab shard
        uses_vocab_start=lw.uses_labels or lw.uses_argmax or lw.uses_topk or bool(lw.vectors),
        floor_topk=neg_inf["topk"]["floor"] or neg_inf["topk"]["gone"],
        uses_ninf=neg_inf["exact"]["gone"] or neg_inf["grad"]["gone"],
        uses_value_scale="tokens" in norm.values(), uses_count_scale="mean" in norm.values(),
        uses_div=any(s["div"] == "div" for s in segments), uses_div_seq=any(s["per_sequence"] for s in segments),
        uses_div_rows=any(s["div"] == "div_rows" for s in segments),
        uses_seq_scale=any(norm[n] == "sequence" for n in spec.segment_row_terms),
        flag_slots={name: i for i, name in enumerate(FLAG_SLOTS)},
    )
    return Phases(body, grad_dense, grad_topk, context, *grad_teacher)


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
    whether the head has loss terms reduced over rows (which take per-row upstream gradients, on the
    loss and on their rows; a row term of segment statistics takes the one on the loss)."""
    lw = plan.lowered
    segments = [seg.name for seg in lw.segments]
    args = ["x_ptr", "x_stride", "grad_ptr", "grad_stride", "y_ptr", "mask_ptr"]
    if lw.uses_teacher:
        args += ["t_ptr", "t_stride"]
    if lw.teacher_grad:     # (the variant for teacher logits that require grad: their gradient)
        args += ["tgrad_ptr", "tgrad_stride"]
    args += [f"tok_{tok}_ptr" for tok in lw.tokens]
    args += [f"vec_{vec}_ptr" for vec in lw.vectors]
    if lw.uses_topk:
        args += ["topk_id_ptr", "topk_lp_ptr", "topk_stride", "K"]
    if segments:
        args += ["seg_ptr", "n_seg", "off_seg_sums", "off_seg_coefs"]
    args += ["ws_ptr", "off_rows", "off_loss_rows", "off_stats", *(["off_exact"] if plan.exact else []),
             "gathered_ptr", "peers_ptr", "epoch", "div_ptr", "flag_ptr",
             *(["up_loss_ptr"] if row_terms or any(seg.rows for seg in lw.segments) else []),
             *(["up_rows_ptr"] if row_terms else []), "row_offset", "n_rows"]
    fixed = ["world", *(["scalars_ptr"] if reads_scalars else []), "logit_scale", "softcap", "V", "vocab_start",
             "n_vocab", "ignore_index"]
    constexprs = ["SUM", "PER_ROW", "STATS", "EXCHANGE", "MERGE", "EXACT", "STORE_STATS", "ROWS", "GRAD",
                  "BLOCK_V", "BLOCK_K", "BLOCK_R"]
    varying = ("row_offset", "n_rows", "epoch", "off_rows", "off_loss_rows", "off_stats", "off_exact",
               "vocab_start", "n_vocab", "n_seg", "off_seg_sums", "off_seg_coefs")
    out = {"head_loss": Signature(f"head_loss_{key}", tuple(args), tuple(fixed), tuple(constexprs),
                                  tuple(a for a in varying if a in args + fixed))}
    if segments:
        by_rows = any(seg.rows for seg in lw.segments)   # row terms of segment statistics
        seg_args = ("ws_ptr", "off_seg_sums", "off_seg_coefs", "n_seg",
                    *(("div_ptr",) if set(segments) - set(per_sequence) else ()),
                    *(("seg_ptr", "off_rows", "off_loss_rows", "n_rows") if by_rows else ()))
        # (PER_ROW: reduction="none", where a row term of batch quantiles adds its rows to the per-row loss)
        out["segments"] = Signature(f"segments_{key}", seg_args, ("scalars_ptr",),
                                    ("SUM", *(("PER_ROW",) if by_rows else ()), "BLOCK_S"),
                                    ("n_seg", "off_seg_sums", "off_seg_coefs",
                                     *(("off_rows", "off_loss_rows", "n_rows") if by_rows else ())))
    return out


def _recorded(constant: str, *, only_with: str = "") -> Any:
    """A field of ``FileSpec``: written as the module constant ``constant``; ``only_with``: the field
    whose value decides whether the file writes it at all (the segment kernel's interface)."""
    return field(metadata={"constant": constant, "only_with": only_with})


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise TypeError(f"a list of names, not {value!r}")
    return tuple(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"True or False, not {value!r}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string, not {value!r}")
    return value


def _pairs(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError(f"a dict of names, not {value!r}")
    return tuple(value.items())


def _state(value: Any) -> tuple[str, int, int]:
    if not (isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], str)
            and all(isinstance(n, int) for n in value[1:])):
        raise TypeError(f"(streams, running sums, exact sums), not {value!r}")
    return value


def _quantiles(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], float) for p in value):
        raise TypeError(f"a list of (name, q) pairs, not {value!r}")
    return tuple(value)


# how a constant's value is read back into its field, by the field's type
_READERS: dict[str, Callable[[Any], Any]] = {
    "str": _text, "bool": _flag, "tuple[str, ...]": _names, "tuple[tuple[str, str], ...]": _pairs,
    "tuple[str, int, int]": _state, "tuple[tuple[str, float], ...]": _quantiles}


@dataclass(frozen=True)
class FileSpec:
    """What the runtime reads of a head's kernel file, whatever its backend: each field one constant
    of the file (named in the field's ``constant``), which both backends' templates write
    (``templates/_spec_constants.j2``, from a ``KernelSpec``), and which ``load`` reads back into
    this, the module's ``SPEC`` (``FileSpec.read``). The runtime reads these fields, never a
    constant by its name."""

    key: str = _recorded("KEY")                         # the head's key: its kernels are head_loss_<key>, segments_<key>
    outputs: tuple[str, ...] = _recorded("OUTPUTS")     # the terms, then the metrics
    row_values: tuple[str, ...] = _recorded("ROW_VALUES")  # row terms, metrics, segment terms' row quantities
    columns: tuple[str, ...] = _recorded("COLUMNS")     # the first read's packed per-row stats
    exact: tuple[str, ...] = _recorded("EXACT")         # the exact read's sums
    tokens: tuple[str, ...] = _recorded("TOKENS")       # per-row inputs (S.token), each passed as tok_<name>_ptr
    vectors: tuple[str, ...] = _recorded("VECTORS")     # per-class [V] inputs (S.vector), each passed as vec_<name>_ptr
    uses_labels: bool = _recorded("USES_LABELS")        # which inputs its kernels read
    uses_teacher: bool = _recorded("USES_TEACHER")
    uses_topk: bool = _recorded("USES_TOPK")
    row_loss_terms: tuple[str, ...] = _recorded("ROW_LOSS_TERMS")  # loss terms reduced over rows (the others are segment terms)
    normalize: tuple[tuple[str, str], ...] = _recorded("NORMALIZE")  # each output's: tokens, sequence, sum or mean
    scalars: tuple[str, ...] = _recorded("SCALARS")     # the fp32 runtime scalars: each loss term's weight, then parameters
    segments: tuple[str, ...] = _recorded("SEGMENTS")   # segment terms
    segment_means: tuple[str, ...] = _recorded("SEGMENT_MEANS")  # the row values whose per-segment sums they read, in order
    segment_row_terms: tuple[str, ...] = _recorded("SEGMENT_ROW_TERMS")  # the segment terms that are row terms of segment statistics
    segment_sorted: tuple[str, ...] = _recorded("SEGMENT_SORTED")  # the segment means that are sorted sums (S.segment_sorted)
    # those that are batch quantiles (S.row_quantile), each with its q
    segment_quantiles: tuple[tuple[str, float], ...] = _recorded("SEGMENT_QUANTILES")
    state: tuple[str, int, int] = _recorded("STATE")    # what decides the tile: Plan.state
    # each kernel's interface (emit.signatures): each launch's arguments, the fixed ones, the constexprs
    args: tuple[str, ...] = _recorded("ARGS")
    fixed: tuple[str, ...] = _recorded("FIXED")
    constexprs: tuple[str, ...] = _recorded("CONSTEXPRS")
    segment_args: tuple[str, ...] = _recorded("SEGMENT_ARGS", only_with="segments")
    segment_fixed: tuple[str, ...] = _recorded("SEGMENT_FIXED", only_with="segments")
    segment_constexprs: tuple[str, ...] = _recorded("SEGMENT_CONSTEXPRS", only_with="segments")

    @property
    def normalization(self) -> dict[str, str]:
        return dict(self.normalize)

    @property
    def teacher_grad(self) -> bool:
        """Whether the head's kernel writes dL/dteacher_logits (its variant for teacher logits that
        require grad, whose interface takes the gradient's pointer)."""
        return "tgrad_ptr" in self.args

    @property
    def has_exact(self) -> bool:
        """Whether a launch after the first read's merge computes sums (the exact read's, or top-k
        sums of the final normalisers): plan.launch_sequence's ``has_exact``."""
        return bool(self.exact)

    @property
    def slots(self) -> dict[str, int]:
        """The workspace's fixed slots after each output's value: the loss, the valid-row count, the
        finished-row count; ``fixed``: where the regions given per call start."""
        n = len(self.outputs)
        return dict(loss=n, count=n + 1, done=n + 2, fixed=n + 3)

    @property
    def segment_raw(self) -> tuple[str, ...]:
        """The segment statistics the segment step writes as they are read (sorted sums, quantiles),
        not as sums that the count divides."""
        return self.segment_sorted + tuple(name for name, _ in self.segment_quantiles)

    @classmethod
    def read(cls, module: Any) -> FileSpec:
        """The contract a kernel module's constants record. A constant missing (or written where its
        ``only_with`` field is empty), of the wrong type, or disagreeing with what the others imply
        (``DERIVED_CONSTANTS``) is a ValueError naming it."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            const, only_with = f.metadata["constant"], f.metadata["only_with"]
            written = not only_with or bool(values[only_with])
            if not written:
                if hasattr(module, const):
                    raise ValueError(f"the constant {const} is written, with no {only_with.upper()}")
                values[f.name] = ()
                continue
            if not hasattr(module, const):
                raise ValueError(f"no constant {const} (FileSpec.{f.name}): the file is not one this "
                                 "version of losscodegen writes")
            try:
                values[f.name] = _READERS[f.type](getattr(module, const))
            except TypeError as e:
                raise ValueError(f"the constant {const} (FileSpec.{f.name}) is not {e}") from None
        spec = cls(**values)
        for const, derive in DERIVED_CONSTANTS.items():
            if getattr(module, const, None) != derive(spec):
                raise ValueError(f"the constant {const} is {getattr(module, const, 'missing')!r}, where "
                                 f"the file's other constants make it {derive(spec)!r}")
        return spec


# The constants a file writes that follow from its FileSpec's fields: checked when it is read.
DERIVED_CONSTANTS: dict[str, Callable[[FileSpec], Any]] = {
    "HAS_EXACT": lambda s: s.has_exact, "LOSS": lambda s: s.slots["loss"], "COUNT": lambda s: s.slots["count"],
    "DONE": lambda s: s.slots["done"], "FIXED_SLOTS": lambda s: s.slots["fixed"]}


@dataclass(frozen=True)
class KernelSpec(FileSpec):
    """A head's kernel file's contract (``FileSpec``, what it records), derived from its plan once,
    here, for every backend, with what the renderers alone read: each renderer takes the file's
    contract from it, and its template writes the ``FileSpec`` part as the file's constants. Two
    backends' files of one head agree on all of it by construction."""

    head_scalars: tuple[str, ...] = ()     # the scalars the head's kernel reads
    segment_scalars: tuple[str, ...] = ()  # those the segment kernel reads
    signatures: tuple[Signature, ...] = ()  # the head's kernel, then the segment kernel if any

    @property
    def sigs(self) -> dict[str, Signature]:
        """``emit.signatures``' form: by kernel kind (``head_loss``, ``segments``)."""
        return dict(zip(("head_loss", "segments"), self.signatures))

    @property
    def recorded(self) -> FileSpec:
        """What the file records of it: what ``FileSpec.read`` gives back from the file."""
        return FileSpec(**{f.name: getattr(self, f.name) for f in fields(FileSpec)})


def kernel_spec(plan: Plan, key: str, normalize: dict[str, str] | None = None) -> KernelSpec:
    """The contract of a plan's kernel file. ``normalize``: each loss term's normalisation ("tokens"
    where not given; a "sequence" term is a segment term); metrics are means over the valid rows."""
    lw = plan.lowered
    segments = tuple(seg.name for seg in lw.segments)
    loss_terms = [w.name[len("w_"):] for w in lw.weights]
    row_loss_terms = tuple(n for n in loss_terms if n not in segments)
    norm = {n: (dict(normalize or {}).get(n, "tokens") if n in loss_terms else "mean") for n in lw.outputs}
    head_exprs = ([a.body for a in lw.accumulators] + [e for _, e in lw.grad_coefs + lw.row_values]
                  + [lw.grad_vocab, lw.grad_topk, lw.grad_teacher])
    seg_exprs = [e for seg in lw.segments for e in (seg.formula, *seg.dformula)]

    def names(exprs: list[sp.Expr]) -> set[str]:
        return {s.name for e in exprs for s in e.free_symbols}
    scalars = tuple(f"weight_{n}" for n in loss_terms) + tuple(sorted(
        n for n in names(head_exprs + seg_exprs) if n.startswith(S.RUNTIME_PREFIX)))
    segment_row_terms = tuple(seg.name for seg in lw.segments if seg.rows)
    # (a row term of segment statistics has its direct path in the head's gradient, its weight with it)
    head_scalars = tuple(n for n in scalars if n in names(head_exprs)
                         | {f"weight_{t}" for t in row_loss_terms + segment_row_terms})
    sigs = signatures(plan, key, bool(head_scalars), tuple(n for n in segments if norm[n] == "sequence"),
                      bool(row_loss_terms))
    head_sig, seg_sig = sigs["head_loss"], sigs.get("segments", Signature("", (), (), ()))
    return KernelSpec(
        key=key, outputs=tuple(lw.outputs), row_values=tuple(n for n, _ in lw.row_values),
        columns=tuple(c.name for c in plan.columns), exact=tuple(plan.exact), tokens=tuple(lw.tokens),
        vectors=tuple(lw.vectors), uses_labels=lw.uses_labels, uses_teacher=lw.uses_teacher,
        uses_topk=lw.uses_topk, row_loss_terms=row_loss_terms, normalize=tuple(norm.items()), scalars=scalars,
        segments=segments, segment_means=tuple(U.name for seg in lw.segments for U in seg.means),
        segment_row_terms=segment_row_terms, state=plan.state,
        args=head_sig.args, fixed=head_sig.fixed, constexprs=head_sig.constexprs,
        segment_args=seg_sig.args, segment_fixed=seg_sig.fixed, segment_constexprs=seg_sig.constexprs,
        head_scalars=head_scalars,
        segment_scalars=tuple(n for n in scalars if n in names(seg_exprs) | {f"weight_{t}" for t in segments}),
        signatures=tuple(sigs.values()),
        segment_sorted=tuple(U.name for seg in lw.segments for U in seg.sorted),
        segment_quantiles=tuple((U.name, q) for seg in lw.segments for U, q in seg.quantiles))


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
        out_of_scope = _read_out_of_scope(fn, module_names | set(params))
        if out_of_scope:
            raise ValueError(f"{sig.name} reads {out_of_scope} where no assignment reaches (a value "
                             "computed inside a loop is gone after it, in Triton's compiler; its "
                             "interpreter, which runs the loop as Python, would not say so)")


def _read_out_of_scope(fn: ast.FunctionDef, known: set[str]) -> list[str]:
    """The names (with their line) a kernel reads where, in Triton's scoping, nothing defines them:
    a name first assigned inside a loop does not outlive the loop. (The branches of an ``if`` are
    taken as both defining what either does: most conditions are constexprs.)"""
    found: list[str] = []

    def read(node: ast.AST, defined: set[str]) -> None:
        found.extend(f"{n.id} (line {n.lineno})" for n in ast.walk(node)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in defined)

    def stored(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def block(stmts: list[ast.stmt], defined: set[str]) -> set[str]:
        for st in stmts:
            if isinstance(st, (ast.For, ast.While)):
                read(st.iter if isinstance(st, ast.For) else st.test, defined)
                block(st.body, defined | (stored(st.target) if isinstance(st, ast.For) else set()))
            elif isinstance(st, ast.If):
                read(st.test, defined)
                defined = defined | block(st.body, set(defined)) | block(st.orelse, set(defined))
            elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                if st.value is not None:
                    read(st.value, defined)
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name) and st.target.id not in defined:
                    found.append(f"{st.target.id} (line {st.lineno})")
                for t in targets:   # (a subscript or attribute target reads its base)
                    if not isinstance(t, ast.Name):
                        read(t, defined)
                defined = defined | set().union(*(stored(t) for t in targets))
            else:
                read(st, defined)
        return defined

    block(fn.body, set(known))
    return sorted(set(found))


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


