"""Derivatives as torch autograd takes them, for lowering's gradient (lower.py): ``derive`` with
torch's value at every kink, and the reductions a gradient reads grouped under one row factor
(``shared_coefficients``), where sympy can cancel between their parts. A compiler stage: sympy only."""
from __future__ import annotations

import sympy as sp

from . import symbols as S


class _Extremum(sp.Function):
    """Max or Min of its arguments as torch differentiates them (torch.maximum/minimum for two,
    torch.amax/amin of the stacked arguments for more): the arguments that tie for the extremum
    share its gradient equally. Unlike sympy's Max/Min, it is never simplified away."""

    is_real = True
    holds = None  # a relational: is the first argument at least as extreme as the second?

    def fdiff(self, argindex=1):
        a = self.args[argindex - 1]
        others = self.args[:argindex - 1] + self.args[argindex:]
        ties = sp.Add(*[sp.Piecewise((1, sp.Eq(b, a)), (0, True)) for b in others])
        best = sp.And(*[self.holds(a, b) for b in others])
        return sp.Piecewise((1 / (1 + ties), best), (0, True))


class _Maximum(_Extremum):
    holds = staticmethod(lambda a, b: a >= b)


class _Minimum(_Extremum):
    holds = staticmethod(lambda a, b: a <= b)


class _Abs(sp.Function):
    """torch.abs, for differentiating: derivative sign(x), 0 at 0."""

    nargs = 1
    is_real = True

    def fdiff(self, argindex=1):
        return sp.sign(self.args[0])


class _Sign(sp.Function):
    """torch.sign, for differentiating: derivative 0 (sympy's is 2*DiracDelta)."""

    nargs = 1
    is_real = True

    def fdiff(self, argindex=1):
        return sp.S.Zero


_AS_TORCH = {sp.Max: _Maximum, sp.Min: _Minimum, sp.Abs: _Abs, sp.sign: _Sign}
_AS_SYMPY = {v: k for k, v in _AS_TORCH.items()}


def derive(expr: sp.Expr, x: sp.Symbol) -> sp.Expr:
    """``d expr / d x`` with torch autograd's value at every kink (docs/api.md): ``Abs`` as
    torch.abs (0 at 0), ``Max``/``Min`` as torch.maximum/minimum (torch.amax/amin of the stacked
    arguments for more than two: a tie shares the gradient equally), ``clamp`` as torch.clamp (1 on
    the closed interval), ``Piecewise`` as torch.where (the branch its condition picks), ``sign``
    as torch.sign (0), nothing through ``stop_gradient``. (sympy's own rules differ: Abs'(0) is 1
    through Piecewise, and it simplifies Min(Max(r, 1), 1) to the constant 1.)"""
    kinks = tuple(_AS_TORCH)
    d = expr.replace(lambda e: isinstance(e, kinks), lambda e: _AS_TORCH[type(e)](*e.args)).diff(x)
    return d.replace(lambda e: type(e) in _AS_SYMPY, lambda e: _AS_SYMPY[type(e)](*e.args))


def without_stop_gradient(expr: sp.Expr) -> sp.Expr:
    """The value of an expression, once its gradient is derived: ``stop_gradient(x)`` is ``x``
    (at every depth: one ``replace`` leaves the inner of two nested ones)."""
    while expr.has(S.stop_gradient):
        expr = expr.replace(S.stop_gradient, lambda x: x)
    return expr


def known(k: sp.Expr) -> bool:
    """Whether a row factor is known in every read: numbers, runtime parameters and tokens (not a
    loss weight, which holds the upstream gradient under reduction="none", nor a row statistic)."""
    return all(s.name.startswith((S.RUNTIME_PREFIX, S.TOKEN_PREFIX)) for s in k.free_symbols)


def shared_coefficients(reds, loss: sp.Expr, totals: dict[sp.Symbol, sp.Expr]):
    """The reductions the gradient reads, grouped where ``dL/dR_j = C * k_j`` with one row factor
    ``C`` and each ``k_j`` a polynomial in known factors: ``(domain, C, [(body_j, k_j)])``. A group
    is differentiated as one sum ``sum_i sum_j k_j body_j``, where sympy can cancel between the
    parts: JSD's two KL sums (weights beta and 1 - beta) have a gradient free of 1/m and of two
    row sums once ``beta*p + (1 - beta)*q`` over ``m`` is seen to be 1. ``totals``: ``dL/dR`` with
    the paths through nested sums (a reduction made since, by ``sum_of``, is read, not differentiated)."""
    groups: list[tuple[str, list[tuple[sp.Expr, sp.Expr]]]] = []
    for (domain, body), r in reds:
        c = totals.get(r, sp.S.Zero)
        if c == 0:
            continue
        for g_domain, members in groups:
            if g_domain == domain and known(sp.cancel(c / members[0][1])):
                members.append((body, c))
                break
        else:
            groups.append((domain, [(body, c)]))
    out = []
    for domain, members in groups:
        C = members[0][1]
        if len(members) > 1:
            try:
                C = sp.gcd_list([c for _, c in members])
            except sp.PolynomialError:
                C = sp.S.One
            ks = [sp.cancel(c / C) for _, c in members]
            if C == 1 or not all(known(k) and sp.fraction(sp.together(k))[1].is_number for k in ks):
                # 1/beta where beta may be 0 at run time: each reduction on its own
                out += [(domain, c, [(body, sp.S.One)]) for body, c in members]
                continue
            out.append((domain, C, [(body, k) for (body, _), k in zip(members, ks)]))
        else:
            out.append((domain, C, [(members[0][0], sp.S.One)]))
    return out


def _cost(expr: sp.Expr) -> tuple[int, int]:
    """(transcendental functions and divisions, all operations) of ``expr`` once its common
    subexpressions are computed once: a neutral count, for choosing between equal forms."""
    defs, (body,) = sp.cse(expr)
    counts = [(op.name, int(n)) for e in [d for _, d in defs] + [body]
              for op, n in sp.count_ops(e, visual=True).as_coefficients_dict().items() if op.is_Symbol]
    return (sum(n for name, n in counts if name in ("EXP", "LOG", "DIV", "TANH", "POW")),
            sum(n for _, n in counts))


def simpler(expr: sp.Expr) -> sp.Expr:
    """``expr`` over one denominator with its common factors out, where that costs fewer operations
    (a sum of parts of one group, where terms cancel), else ``expr``."""
    if not isinstance(expr, sp.Add):
        return expr
    candidate = sp.factor_terms(sp.together(expr))
    return candidate if _cost(candidate) < _cost(expr) else expr
