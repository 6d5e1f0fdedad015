"""Stage 4, emit: what every backend's rendering shares. The base printer of sympy expressions for
an array module (``ArrayPrinter``; ``TorchPrinter`` for the float64 reference), how a read keeps
``0 * log 0 = 0`` at -inf inputs (``neg_inf_handling``), the reads' printed summands, the plan's
expressions printed and grouped by phase (``phases``), and the generated file's header. The kernel
interface (``Signature``, ``FileSpec``, ``KernelSpec``, the flag slots, the seal) is interface.py's.

A backend's renderer (``losscodegen/backends/<name>/``) prints the plan with its own printer and
lays it out with its template.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import sympy as sp
from sympy.printing.pycode import PythonCodePrinter, _print_known_const, _print_known_func

from . import symbols as S
from .interface import FLAG_SLOTS, KernelSpec, token_arg, vector_arg, weight_name
from .lower import IS_ARGMAX, IS_Y, M, MT, TM, ZKM, ZM, ZYM
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
    if isinstance(expr, (sp.Max, sp.Min, sp.Abs, sp.sign)):
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
    if isinstance(expr, sp.Pow) and expr.exp.is_Integer and expr.exp < 0 and _at_least_a_positive_number(expr.base):
        return _finite_at_neg_inf(expr.base, elements, floored=floored)
    if isinstance(expr, sp.log) or (isinstance(expr, sp.Pow) and expr.exp.is_negative):
        # the log or a reciprocal of a sum plus TINY (no_underflow_nan): finite where the sum is
        arg = expr.args[0]
        return TINY in sp.Add.make_args(arg) and _finite_at_neg_inf(arg, elements, floored=floored)
    return False


def _at_least_a_positive_number(base: sp.Expr) -> bool:
    """Whether ``base`` is a positive number plus conditions of numbers >= 0 (a tie's share of a
    Max's or Min's gradient, ``1/(1 + [a == b])``): its reciprocal is finite wherever its conditions
    are decided, NaN inputs included (a comparison with NaN is false)."""
    parts = sp.Add.make_args(base)
    return any(p.is_number and p > 0 for p in parts) and all(
        (p.is_number and p >= 0) or (isinstance(p, sp.Piecewise) and all(v.is_number and v >= 0 for v, _ in p.args))
        for p in parts)


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
    vocab, topk = (*S.ELEMENT_SYMBOLS, ZM, TM), (*S.TOPK_SYMBOLS, ZKM)
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


_ELEMENTWISE = frozenset((*S.ELEMENT_SYMBOLS, *S.TOPK_SYMBOLS, ZM, TM, ZKM, IS_Y, IS_ARGMAX, X))


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


class Divisor(enum.StrEnum):
    """What a segment term's sum is divided by, each the segment kernel's variable of that name: the
    call's divisor or the valid segments (``div``), the one a row term's is (``div_rows``: a row term
    of segment statistics), or the sequences (``div_seq``: a term normalised by sequence)."""

    SEGMENTS = "div"
    ROWS = "div_rows"
    SEQUENCES = "div_seq"


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
      ``grad_means`` (the segment means a row term of segment statistics' direct path reads, each
      with whether it is a mean: its sum over the segment's count, else the raw sum); ``seg_stats``
      (every segment statistic: name, index, whether a mean);
    - the segments: ``segments`` (each segment term's value and gradients in the means),
      ``seg_coefs``, ``seg_mean_rows``, and the divisors they use (``uses_div``: the segments',
      ``uses_div_seq``: the sequences', ``uses_div_rows``: a row term's), ``seg_row_weights`` (each
      row term of segment statistics' weight in the gradient read: ``uses_seq_scale`` where one is
      divided by the sequences);
    - and what the template declares only where read: ``uses_label``, ``uses_zym``, ``uses_zkm``
      (the top-k entries relative to the row's maximum),
      ``uses_vocab_size``, ``uses_is_y``, ``uses_is_argmax``, ``uses_argmax`` (the first read keeps
      the argmax), ``grad_uses_teacher`` (the gradient read loads the teacher), ``uses_vocab_start``
      (an index placed in the vocab shard), ``flag_slots``;
    - the interface's names (interface.py's): ``token_loads``/``vector_loads`` (each input's value
      and its pointer argument), ``weights`` (each loss term's weight scalar).

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
    vocab, topk = (*S.ELEMENT_SYMBOLS, ZM, TM), (*S.TOPK_SYMBOLS, ZKM)
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
    # the segment statistics that are means (a sum divided by its segment's valid rows), not raw sums
    mean = set(seg_means) - set(spec.segment_raw)
    segments = []
    for seg in lw.segments:
        temps, (value, *grads) = statements([seg.formula, *seg.dformula], f"{seg.name}_u")
        segments.append(dict(name=seg.name, temps=temps, value=value, slot=lw.outputs.index(seg.name),
                             per_sequence=norm[seg.name] == "sequence",
                             # its divisor: a row term of segment statistics is divided as a row term is,
                             # unless normalised by sequence (each row then over its segment's rows: terms.bind)
                             div=Divisor.SEQUENCES if norm[seg.name] == "sequence" else Divisor.ROWS if seg.rows
                             else Divisor.SEGMENTS, weight=weight_name(seg.name),
                             grads=[(seg_means.index(U.name), g, U.name in mean) for U, g in zip(seg.means, grads)],
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
        # (a term by "sequence" is a segment term, but where its formula binds to 0, a parameter folded
        # at 0: segment_mean(0) is 0, its rows are 0 and left undivided; found by the fuzzer)
        finish=[(n, row_names.index(n), lw.outputs.index(n),
                 {"tokens": " * value_scale", "mean": " * count_scale", "sum": "", "sequence": ""}[norm[n]])
                for n in lw.outputs if n not in spec.segments],
        finish_loss=" + ".join(f"{weight_name(n)} * value_{n}" for n in spec.row_loss_terms),
        grad_weights=[(n, f"{weight_name(n)} * grad_scale" if norm[n] == "tokens" else weight_name(n))
                      for n in spec.row_loss_terms],
        coef_temps=coef_temps, coefs=list(zip([s.name for s, _ in lw.grad_coefs], coef_exprs)),
        grad_temps=grad_temps, grad_expr=grad_expr, teacher_grad=teacher_expr[0] if teacher_expr else None,
        grad_label=None if grad_label == 0 else printer.doprint(grad_label),
        topk_grad=None if lw.grad_topk == 0 else topk_grad_expr, topk_grad_temps=topk_grad_temps,
        grad_means=[(U.name, seg_means.index(U.name), U.name in mean) for seg in lw.segments if seg.rows
                    for U in seg.means],
        seg_stats=[(U, j, U in mean) for j, U in enumerate(seg_means)],
        # a row term of segment statistics' direct path: its weight over its divisor, as its value's
        seg_row_weights=[(n, f"{weight_name(n)} * {'seq_scale' if norm[n] == 'sequence' else 'grad_scale'}")
                         for n in spec.segment_row_terms],
        segments=segments, seg_coefs=[c.name for s in lw.segments for c in s.coefs],
        seg_mean_rows=[row_names.index(u) for u in seg_means],
        uses_label=any(e.has(S.label) for _, e in lw.row_values),
        uses_zym=any(e.has(ZYM) for _, e in lw.row_values + lw.grad_coefs),
        uses_zkm=lw.grad_topk.has(ZKM) or any(a.body.has(ZKM) for a in topk_exact),
        uses_vocab_size=any(e.has(S.vocab_size) for e in head_exprs),
        uses_is_y=grad_dense.has(IS_Y), uses_is_argmax=lw.grad_vocab.has(IS_ARGMAX),
        uses_argmax=lw.uses_argmax, grad_uses_teacher=lw.grad_uses_teacher,
        # a label, the argmax, a top-k id or a vector's entry placed in this vocab shard
        uses_vocab_start=lw.uses_labels or lw.uses_argmax or lw.uses_topk or bool(lw.vectors),
        floor_topk=neg_inf["topk"]["floor"] or neg_inf["topk"]["gone"],
        uses_ninf=neg_inf["exact"]["gone"] or neg_inf["grad"]["gone"],
        uses_value_scale="tokens" in norm.values(), uses_count_scale="mean" in norm.values(),
        uses_div=any(s["div"] is Divisor.SEGMENTS for s in segments),
        uses_div_seq=any(s["per_sequence"] for s in segments),
        uses_div_rows=any(s["div"] is Divisor.ROWS for s in segments),
        uses_seq_scale=any(norm[n] == "sequence" for n in spec.segment_row_terms),
        flag_slots={name: i for i, name in enumerate(FLAG_SLOTS)},
        # each input the kernels load, (the value's name in the formulas, its pointer argument)
        token_loads=[(S.token(t).name, token_arg(t).name) for t in spec.tokens],
        vector_loads=[(S.vector(v).name, vector_arg(v).name) for v in spec.vectors],
        weights={n: weight_name(n) for n in spec.row_loss_terms + spec.segments},
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
