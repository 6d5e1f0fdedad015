"""Numerically stable forms: the rewrites that make what the kernels print finite wherever the
formula's value is, on the rows late training produces (label probabilities that round to 1 or 0,
one-hot teachers, huge spreads), in every backend alike.

Two kinds. Row math rewritten where fp32 would cancel (``cancellations``: ``expm1``, ``expm1mx``,
``log1p``; tanh's derivative as exponentials, ``sech2``), applied by lower.py as it lowers. And the
derived expressions' final form (``stable_form``, the last pass of lower.py): powers of one base in a
product merged (sympy writes the derivative of ``x**a`` as ``a * x**a / x``, 0/0 where ``x`` is 0:
printed ``a * x**(a - 1)``, as torch's pow differentiates). ``vanishing_quotients`` and
``numerics_report`` name what is left that can still be 0/0, for ``explain()`` and a warning when a
user's term is declared. And, before lowering, exponents whose coefficient is known only at run time
written relative to the row maxima (``run_time_temperatures``), where ``exp(z / tau)`` would overflow.
"""
from __future__ import annotations

import sympy as sp

from . import symbols as S


class expm1(sp.Function):
    """``exp(x) - 1``, precise where it is small (no cancellation): ``exp(d) - 1`` as written."""

    nargs = 1
    is_real = True

    def fdiff(self, argindex=1):
        return sp.exp(self.args[0])


class expm1mx(sp.Function):
    """``exp(x) - 1 - x``, precise where it is small (~x**2/2): GRPO's KL ``e^d - d - 1``."""

    nargs = 1
    is_real = True

    def fdiff(self, argindex=1):
        return expm1(self.args[0])


class log1p(sp.Function):
    """``log(1 + x)``, precise where x is small."""

    nargs = 1
    is_real = True

    def fdiff(self, argindex=1):
        return 1 / (1 + self.args[0])


# the functions _cancellations writes (each printer prints them: emit.ArrayPrinter, TritonPrinter)
CANCELLATIONS = (expm1, expm1mx, log1p)


def cancellations(expr: sp.Expr) -> sp.Expr:
    """Row math rewritten where fp32 would cancel: ``c*exp(x) - c - c*x`` as ``c*expm1mx(x)``,
    ``c*exp(x) - c`` as ``c*expm1(x)`` (the rest of the sum kept as it is), ``log(1 + x)`` as
    ``log1p(x)``. (``e^d - d - 1`` at d = 1e-3 keeps 3 of fp32's digits; torch's own fp32 ones
    fewer or more, depending on its libm's exp.)"""
    def in_add(add: sp.Add) -> sp.Expr:
        for term in add.args:
            exps = [f for f in sp.Mul.make_args(term) if isinstance(f, sp.exp)]
            if len(exps) != 1:
                continue
            (e,), x = exps, exps[0].args[0]
            c = term / e
            rest = list(sp.Add.make_args(sp.expand(add - term)))
            for fn, parts in ((expm1mx, -c * (1 + x)), (expm1, -c)):
                wanted = list(sp.Add.make_args(sp.expand(parts)))
                if all(p in rest for p in wanted):
                    for p in wanted:
                        rest.remove(p)
                    return c * fn(x) + sp.Add(*rest)
        return add
    expr = expr.replace(lambda e: isinstance(e, sp.Add) and any(isinstance(a, sp.Mul) and a.has(sp.exp) or
                                                                isinstance(a, sp.exp) for a in e.args), in_add)
    return expr.replace(lambda e: isinstance(e, sp.log) and isinstance(e.args[0], sp.Add) and 1 in e.args[0].args,
                        lambda e: log1p(e.args[0] - 1))


def sech2(expr: sp.Expr) -> sp.Expr:
    """tanh's derivative ``c - c*tanh(u)**2`` (sympy's) as ``4c exp(-2|u|) / (1 + exp(-2|u|))**2``:
    at u = 7 it is 3e-6, and ``1 - tanh(u)**2`` in fp32 keeps 5% of it (an ulp of tanh near 1,
    6e-8, against 3e-6; torch's autograd in fp32 does the same), where the exponential form keeps
    every digit and never overflows. (For coefficients: nothing differentiates them again.)"""
    def rewrite(add: sp.Add) -> sp.Expr:
        if len(add.args) != 2:
            return add
        for c, other in (add.args, add.args[::-1]):
            tanhs = [f for f in sp.Mul.make_args(other) if f.is_Pow and f.exp == 2 and isinstance(f.base, sp.tanh)]
            if len(tanhs) == 1 and other / tanhs[0] + c == 0:
                e = sp.exp(-2 * _abs_of_real(tanhs[0].base.args[0]))
                return 4 * c * e / (1 + e) ** 2
        return add
    return expr.replace(lambda e: isinstance(e, sp.Add) and e.has(sp.tanh), rewrite)


def in_order(items) -> list:
    """A set of sympy expressions in sympy's canonical order: a set's own order follows the hashes of
    the symbols' names, which change with each process (PYTHONHASHSEED); a Dummy made while iterating
    one takes its index from that order, and sympy's rewrites of what holds it can differ with it
    (the same fuzzed formula lowered two ways in two processes). The generated code must not."""
    return sorted(items, key=sp.default_sort_key)


def _abs_of_real(u: sp.Expr) -> sp.Expr:
    """``|u|`` of a value the kernel computes (real): sympy, not knowing that ``log(acc)`` is real,
    writes ``Abs(exp(v))`` as ``exp(re(v))`` and expands ``re(tanh(...))`` into sinh, cosh and arg,
    which no backend prints (found by the fuzzer: ``exp(tanh(exp(tanh(lse))))``). Each exponential
    stands in as a positive symbol while sympy takes the absolute value."""
    positive = {x: sp.Dummy(positive=True) for x in in_order(u.atoms(sp.exp))}
    return sp.Abs(u.xreplace(positive)).xreplace({d: x for x, d in positive.items()})




def stable_form(expr: sp.Expr) -> sp.Expr:
    """``expr`` with each product's powers of one base, up to its sign, made one power: sympy
    differentiates ``x**a`` into ``a * x**a / x`` (and, as ``(-x)**-1`` is ``-1/x``, the two need
    not even share a base), which is 0/0 where ``x`` is 0 for any ``a > 1``: the focal loss's
    ``(1 - p_y)**gamma`` at ``p_y = 1``. ``b**a * (-b)**n`` (``n`` an integer) is ``(-1)**n * b**(a + n)``,
    which is finite there and is torch's own pow derivative. (Applied last: ``sympy.expand`` splits
    ``b**(a - 1)`` back into ``b**a / b``.)"""
    def merged(mul: sp.Mul) -> sp.Expr:
        factors = [f.as_base_exp() for f in mul.args]
        for i, (b, a) in enumerate(factors):
            if a.is_Integer:
                continue   # (an anchor: a power sympy cannot merge with an integer power of -b itself)
            for j, (c, n) in enumerate(factors):
                if j != i and n.is_Integer and sp.expand(b + c) == 0:
                    rest = [bb ** ee for k, (bb, ee) in enumerate(factors) if k not in (i, j)]
                    return merged_all(sp.Mul(sp.S.NegativeOne ** n, b ** (a + n), *rest))
        return mul

    def merged_all(e: sp.Expr) -> sp.Expr:
        return merged(e) if isinstance(e, sp.Mul) else e

    def masked(mul: sp.Mul) -> sp.Expr:
        # a * b**(a - 1) with a known only at run time, 0 where a is 0 (torch's pow backward masks
        # it so), where b**(a - 1) alone is inf at b = 0 and the product NaN: the focal loss at a
        # tensor gamma of 0 is cross-entropy, at p_y = 1 too
        for f in mul.args:
            if f.is_Pow and not f.exp.is_number and (f.exp + 1) in mul.args:
                a = f.exp + 1
                rest = [g for g in mul.args if g is not f and g != a]
                return sp.Mul(*rest, sp.Piecewise((0, sp.Eq(a, 0)), (a * f, True)))
        return mul
    expr = expr.replace(lambda e: isinstance(e, sp.Mul), merged)
    return expr.replace(lambda e: isinstance(e, sp.Mul) and any(f.is_Pow and not f.exp.is_number for f in e.args),
                        masked)


def shared_exponentials(expr: sp.Expr) -> sp.Expr:
    """A row value's ``a*exp(E) + b*exp(E)`` as ``exp(E)*(a + b)``: apart, where ``exp(E)`` overflows
    (a sum of ``z*exp(z/T)`` relative to the row maximum is ``acc0*exp(m/T) + m*acc1*exp(m/T)``) the
    two inf products of opposite signs make NaN where torch's own sum is inf (and a clamp of it 2;
    found by the fuzzer). Row values only: the gradient's forms keep their order of operations."""
    def shared(add: sp.Add) -> sp.Expr:
        terms = [sp.Mul.make_args(a) for a in add.args]
        common = [f for f in terms[0] if isinstance(f, sp.exp) and not f.args[0].is_number
                  and all(f in t for t in terms[1:])]
        if not common:
            return add
        rest = sp.Add(*[sp.Mul(*[f for f in t if f not in common]) for t in terms])
        return sp.Mul(*common, rest, evaluate=False)
    return expr.replace(lambda e: isinstance(e, sp.Add), shared)


def compensated_sums(lowered) -> tuple[str, ...]:
    """The normalisers' online sums that the first read adds up compensated (a second fp32 part
    holding what each tile's addition rounds away): those whose log a cancellation reads,
    ``expm1(zym - log(acc))`` (``log(1 - p_y)``) or ``1 - exp(zkm - L_N)``. On a confident row the
    sum is 1 (the maximum) plus a rest of 1e-6 spread over the vocabulary, and a tile's share of the
    rest is below half an ulp of 1: added tile after tile, the rest is rounded away (p = 1,
    ``log(1 - p) = -inf``) where torch's one tree sum over the row keeps it. A head that reads no
    such cancellation keeps the plain sum (its kernel unchanged). A condition's cancellation
    (ClipFraction's ``|expm1(log ratio)| > eps``) compares with a threshold and is left out."""
    forms = [e for _, e in lowered.row_values] + [e for _, e in lowered.grad_coefs] + [
        lowered.grad_vocab, lowered.grad_topk] + [a.body for a in lowered.accumulators if not a.online]

    def values(e: sp.Basic):
        if isinstance(e, sp.logic.boolalg.Boolean):
            return
        yield e
        for a in e.args:
            yield from values(a)

    def reads_log_of(node: sp.Expr, n) -> bool:
        return node.has(n.log_acc) or node.has(sp.log(sp.Symbol(n.acc, real=True)))

    def cancels(node: sp.Expr, n) -> bool:
        if isinstance(node, CANCELLATIONS):
            return reads_log_of(node.args[0], n)
        return isinstance(node, sp.Add) and any(t.is_number for t in node.args) and any(
            isinstance(f, sp.exp) and reads_log_of(f.args[0], n) for t in node.args for f in sp.Mul.make_args(t))
    return tuple(n.acc for n in lowered.normalizers
                 if any(cancels(node, n) for e in forms for node in values(e)))


def _may_vanish(base: sp.Expr) -> bool:
    """Whether a divisor can be 0 on a finite row: a cancellation (``expm1``, ``log1p``, a log, a
    difference with an exponential in it), not a sum of exponentials (every normaliser's, kept
    above 0) nor a parameter (refused where it makes a formula undefined: terms._check_defined)."""
    if base.has(expm1, expm1mx, log1p, sp.log):
        return True
    return isinstance(base, sp.Add) and base.has(sp.exp) and any(a.could_extract_minus_sign() for a in base.args)


def vanishing_quotients(expr: sp.Expr) -> list[sp.Expr]:
    """The divisors left in ``expr`` (after ``stable_form``) that can be 0 on a finite row together
    with a factor of their numerator (a factor that holds the divisor itself): there the printed
    value is 0/0, NaN, where the formula's may be finite. (A divisor alone at 0 is a true
    singularity of the formula, ``log(1 - p)`` at ``p = 1``, as infinite in torch: not listed.)"""
    found = []
    for node in sp.preorder_traversal(expr):
        if not isinstance(node, sp.Mul):
            continue
        for f in node.args:
            if f.is_Pow and f.exp.is_number and f.exp < 0 and _may_vanish(f.base) and f.base not in found \
                    and any(g is not f and g.has(f.base) for g in node.args):
                found.append(f.base)
    return found


def numerics_report(lowered) -> list[str]:
    """What ``explain()`` says of a lowered head's numerics, and a declared term's warning: each
    quotient its printed forms may evaluate as 0/0 on a finite row (``vanishing_quotients``), with
    the expression that holds it; empty where there is none."""
    exprs = [(name, e) for name, e in lowered.row_values] + [(str(s), e) for s, e in lowered.grad_coefs] + [
        ("dL/dz_i", lowered.grad_vocab), ("dL/dz_k", lowered.grad_topk), ("dL/dt_i", lowered.grad_teacher)] + [
        (a.name, a.body) for a in lowered.accumulators if not a.online]
    holders: dict[sp.Expr, list[str]] = {}
    for name, e in exprs:
        for base in vanishing_quotients(e):
            holders.setdefault(base, []).append(name)
    return [f"the derived forms ({', '.join(names)}) divide by {base} with a factor that vanishes with it: "
            f"0/0 (NaN) on rows where {base} is 0, though the formula may be finite there"
            for base, names in holders.items()]


# the row maximum of the teacher logits (the first read's m_t), which a shifted exponent of t reads
TEACHER_MAX = sp.Symbol("t_max", real=True)
MAXIMA = {S.logit: S.stop_gradient(S.row_max), S.teacher_logit: S.stop_gradient(TEACHER_MAX),
           S.topk_logit: S.stop_gradient(S.row_max)}


def run_time_temperatures(formula: sp.Expr) -> sp.Expr:
    """A formula whose exponents of the elements have coefficients known only at run time (a tensor
    temperature, a per-row token ``exp(z / tau)``, ``lse_at(token)``) rewritten relative to the row
    maxima, the same function: ``LSE(a, b)`` as ``a*m + b*m_t + log sum_i exp(a*(z_i - m) + b*(t_i - m_t))``,
    and in every sum each ``exp(a*z + b*t + r)`` as ``exp(a*m + b*m_t + r) * exp(a*(z - m) + b*(t - m_t))``
    with the first factor taken out of the sum (with every other row factor of its summand, so that a
    sum read inside another becomes the other's row factor). Such a sum is an exact one (its exponent
    is not known when the kernel is built): a read after the stats, where ``z - m <= 0``, so that no
    exponential overflows for ``a, b >= 0`` (a temperature > 0; a negative one is exact until its
    exponent passes 88, then inf). The maxima are stopped: the formula does not depend on them, so
    the gradient is the formula's own. Other formulas are returned as they are (their lowering, and
    so their kernels, unchanged)."""
    def run_time_lse(e: sp.Expr) -> bool:
        return isinstance(e, S.LSE) and any(not a.is_number for a in e.args)

    def run_time_exp(e: sp.Expr) -> bool:
        if not isinstance(e, sp.exp):
            return False
        # (a coefficient that reads an element itself is no temperature: exp(z**2) stays as written)
        arg = e.args[0]
        return any(not arg.diff(x).is_number and not arg.diff(x).has(*MAXIMA) for x in MAXIMA)

    if not any(run_time_lse(e) for e in formula.atoms(S.LSE)) and not any(
            run_time_exp(e) for red in formula.atoms(S.vsum, S.topk_sum) for e in red.atoms(sp.exp)):
        return formula
    m, m_t = MAXIMA[S.logit], MAXIMA[S.teacher_logit]
    formula = formula.replace(run_time_lse, lambda e: e.args[0] * m + e.args[1] * m_t + sp.log(S.vsum(
        sp.exp(e.args[0] * (S.logit - m) + e.args[1] * (S.teacher_logit - m_t)))))

    def shifted(red: sp.Expr) -> sp.Expr:
        # each element relative to its row maximum, x = d + max (d = x - max <= 0): a linear exponent
        # splits into exp(a*d) and a row factor, and a linear factor's max part is a row factor too
        # (it cancels the normaliser's a*m in the row math, where fp32 would round both)
        at = {x: sp.Dummy(f"d{x}", real=True) for x in ((S.logit, S.teacher_logit) if isinstance(red, S.vsum)
                                                         else (S.topk_logit,))}
        elements = (*at.values(), *S.vectors_in(red), S.topk_logprob)
        # the sums read inside it (row values here, though they hold the element symbols)
        inner = {r: sp.Dummy(real=True) for r in in_order(red.args[0].atoms(S.vsum, S.topk_sum))}
        body = red.args[0].xreplace(inner)
        linear = {e: e.args[0] for e in in_order(body.atoms(sp.exp))
                  if all(not e.args[0].diff(x).has(*at) for x in at)}
        body = body.xreplace({e: sp.exp(sp.expand(a.xreplace({x: d + MAXIMA[x] for x, d in at.items()})))
                              for e, a in linear.items()})
        body = body.xreplace({x: d + MAXIMA[x] for x, d in at.items()})
        out = []
        for addend in sp.Add.make_args(sp.expand(body, power_exp=False, log=False)):
            factors = []
            for f in sp.Mul.make_args(addend):
                if isinstance(f, sp.exp) and all(not f.args[0].diff(d).has(*at.values()) for d in at.values()):
                    parts = sp.Add.make_args(f.args[0])
                    factors += [sp.exp(sp.Add(*[p for p in parts if p.has(*elements)])),
                                sp.exp(sp.Add(*[p for p in parts if not p.has(*elements)]))]
                else:
                    factors.append(f)
            row, element = sp.Mul(*factors).as_independent(*elements, as_Add=False)
            out.append(row * type(red)(element.xreplace({d: x - MAXIMA[x] for x, d in at.items()})))
        # the maxima's exponential shared by every part, outside their sum: a ratio of two sums of one
        # temperature cancels it (exp(m / tau) overflows)
        shared = [{f for f in sp.Mul.make_args(o) if isinstance(f, sp.exp)} for o in out]
        common = sp.Mul(*set.intersection(*shared)) if shared else sp.S.One
        return (common * sp.Add(*[o / common for o in out])).xreplace({d: r for r, d in inner.items()})
    formula = formula.replace(lambda e: isinstance(e, (S.vsum, S.topk_sum)), shifted)
    # and the maxima's own parts as addends of the row math, where they cancel: (m*R + S)/R is m + S/R
    sums = {r: sp.Dummy(real=True) for r in in_order(formula.atoms(S.vsum, S.topk_sum))}
    return sp.expand(formula.xreplace(sums), power_exp=False, log=False).xreplace({d: r for r, d in sums.items()})
