"""Stage 2, lower: from row-level formulas to reductions, row math and the derived gradient.

Input: the bound terms of a head. Output: a ``Lowered`` value that says

* which accumulators the kernel keeps per row. An *online* accumulator is
  ``A = sum_i exp(alpha*(z_i - m) + beta*(t_i - m_t)) * h(z_i, t_i)`` with ``h`` free of anything the
  first read has not seen yet, so it can be kept with online-softmax rescaling while the max ``m``
  grows; its true value is ``exp(alpha*m + beta*m_t) * A``. An *exact* accumulator needs the final
  log-normalisers inside a non-exponential function (JSD's ``log(beta*p + (1-beta)*q)``) and costs
  a second read. The same two kinds exist over the K top-k teacher entries (a gather, no loop).
* each term's row value as an expression in those row statistics;
* the gradient ``dL/dz_i = sum_n a_n*alpha_n*exp(alpha_n*z_i + beta_n*t_i - N_n) + b*[i == y]
  + sum_k c_k * dg_k/dz_i``, every coefficient derived by sympy from the formulas.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import symbols as S
from .derive import derive, shared_coefficients, simpler, without_stop_gradient
from .stable import (CANCELLATIONS, MAXIMA, TEACHER_MAX, cancellations, in_order, run_time_temperatures, sech2,
                     shared_exponentials, stable_form)

# Row statistics of the first read.
M = sp.Symbol("m", real=True)          # max_i z_i
MT = sp.Symbol("m_t", real=True)       # max_i t_i
IS_Y = sp.Symbol("is_y", real=True)    # element: [i == y]
IS_ARGMAX = sp.Symbol("is_argmax", real=True)  # element: [i == argmax_j z_j] (first index of the max)
ZM = sp.Symbol("zm", real=True)        # element: z_i - m, exact in fp32 near the max (the reads after the first)
TM = sp.Symbol("tm", real=True)        # element: t_i - m_t
ZYM = sp.Symbol("zym", real=True)      # row: z_y - m
ZKM = sp.Symbol("zkm", real=True)      # top-k entry: z_k - m

# row symbols known before the first read (not the target logit: on a vocab shard it is known only
# after the shards' stats are merged, so a vocabulary sum that reads it is an exact one)
_BEFORE_STATS = {S.label, S.vocab_size}
# row inputs that move with the logits, and the element indicator their derivative puts on z_i
_Z_DEPENDENT_ROW = {S.target_logit: IS_Y, S.row_max: IS_ARGMAX}
_ELEMENT = (S.logit, S.teacher_logit, S.topk_logit, S.topk_logprob)  # what varies along a reduction


@dataclass(frozen=True)
class Accumulator:
    """One per-row sum the kernel keeps. ``online``: true value ``exp(alpha*m + beta*m_t) * A``."""

    name: str
    domain: str          # "vocab" | "topk"
    online: bool
    alpha: sp.Expr
    beta: sp.Expr
    body: sp.Expr        # h (online) or the whole summand (exact)

    def __str__(self) -> str:
        where = "sum_i" if self.domain == "vocab" else "sum_k"
        if not self.online:
            why = "needs the final normalisers"
            if any(not e.args[0].diff(x).is_number for e in self.body.atoms(sp.exp) for x in (ZM, TM)):
                why = "an exponent's coefficient known at run time, relative to the final maxima"
            return f"{self.name} = {where} {self.body}    [exact: {why}]"
        var = ("z", "t") if self.domain == "vocab" else ("z_k", "t")
        scale = " + ".join(f"{c}*({v} - {mx})" for c, v, mx in
                           ((self.alpha, var[0], "m"), (self.beta, var[1], "m_t")) if c != 0)
        factor = f"exp({scale})" if scale else "1"
        body = f"({self.body})" if isinstance(self.body, sp.Add) else self.body
        return f"{self.name} = {where} {factor} * {body}    [online]"


@dataclass(frozen=True)
class Normalizer:
    """``symbol = log sum_i exp(alpha*z_i + beta*t_i) = alpha*m + beta*m_t + log(acc)``."""

    symbol: sp.Symbol
    alpha: sp.Expr
    beta: sp.Expr
    acc: str

    @property
    def value(self) -> sp.Expr:
        return self.alpha * M + self.beta * MT + sp.log(sp.Symbol(self.acc, real=True))

    @property
    def log_acc(self) -> sp.Symbol:
        """``log(acc)``, the normaliser less its maxima, a row value of the kernel's later reads."""
        return sp.Symbol(f"L_{self.symbol.name}", real=True)


@dataclass(frozen=True)
class SegmentTerm:
    """A term ``F(U_1..U_r)`` of per-segment means ``U_j = mean(u_j)`` of row quantities ``u_j``.

    With ``rows``, a row term of segment statistics: ``F(P, U)`` per row, ``P`` the row quantities
    it reads besides the means (each written as a row value), summed over the valid rows and
    divided as a row term is; the segment kernel evaluates it row by row once the means are known,
    and adds each row's ``dF/dU_j`` into its segment's ``dL/du_j``."""

    name: str
    means: tuple[sp.Symbol, ...]       # U_j
    formula: sp.Expr                   # F(U) (or F(P, U))
    dformula: tuple[sp.Expr, ...]      # dF/dU_j
    coefs: tuple[sp.Symbol, ...]       # per-row dL/du_j fed back to the gradient launch
    rows: tuple[sp.Symbol, ...] = ()   # P_k, each held by the row value of its name
    valid: str = ""                    # the row value that is 1 on a valid row
    # the U_j that are sorted segment sums (segment_sorted): the segment step sorts their sums over the
    # segments before the segment kernel, which reads them as sums, and takes dF/dU_j back to the
    # segment each came from (sort's gradient)
    sorted: tuple[sp.Symbol, ...] = ()
    # the U_j that are batch quantiles (row_quantile), each with its q: the segment step writes the
    # quantile over the valid rows in every segment's slot; detached (dF/dU_j is 0)
    quantiles: tuple[tuple[sp.Symbol, float], ...] = ()


@dataclass(frozen=True)
class Lowered:
    outputs: tuple[str, ...]                     # the terms, then the metrics, as the head reports them
    accumulators: tuple[Accumulator, ...]
    normalizers: tuple[Normalizer, ...]
    row_values: tuple[tuple[str, sp.Expr], ...]  # per-row outputs: term values and segment quantities
    segments: tuple[SegmentTerm, ...]
    weights: tuple[sp.Symbol, ...]               # runtime weight/divisor of each gradient term
    grad_coefs: tuple[tuple[sp.Symbol, sp.Expr], ...]
    grad_vocab: sp.Expr                          # dL/dz_i, in z, t, is_y and the coefficients
    grad_topk: sp.Expr                           # dL/dz_{id_k}, sparse part
    tokens: tuple[str, ...]
    uses_labels: bool
    uses_teacher: bool
    uses_topk: bool
    uses_argmax: bool
    uncombined: int = 0                          # accumulators before sums of one weight were combined
    vectors: tuple[str, ...] = ()                # per-class [V] inputs (S.vector), loaded in every read
    # the variant that also writes dL/dt_i (``lower(..., teacher_grad=True)``: teacher logits that
    # require grad), in z, t and the coefficients; the default kernel computes and writes none
    teacher_grad: bool = False
    grad_teacher: sp.Expr = sp.S.Zero

    @property
    def grad_uses_teacher(self) -> bool:
        return self.teacher_grad or self.grad_vocab.has(S.teacher_logit, TM)

    @property
    def has_exact(self) -> bool:
        return any(not a.online and a.domain == "vocab" for a in self.accumulators)

    def __str__(self) -> str:
        lines = ["row values:"]
        lines += [f"  {name} = {expr}" for name, expr in self.row_values]
        for seg in self.segments:
            kind = "row term of segment statistics (row by row, in the segment kernel)" if seg.rows \
                else "segment term"
            lines.append(f"  {kind} {seg.name} = {seg.formula}")
            if seg.sorted:
                lines.append(f"    sorted over the segments (the segment step, torch.sort on the device): "
                             f"{', '.join(U.name for U in seg.sorted)}")
            if seg.quantiles:
                lines.append(f"    quantiles over the valid rows (the segment step, torch.sort on the device; "
                             f"detached): {', '.join(f'{U.name} (q={q})' for U, q in seg.quantiles)}")
        topk = ", zkm = z_k - m" if self.uses_topk else ""
        lines.append(f"normalisers (zm = z - m, tm = t - m_t, zym = z_y - m{topk}, L_N = N - its maxima):")
        lines += [f"  {n.symbol} = {n.value}" for n in self.normalizers]
        count = f"accumulators ({len(self.accumulators)}"
        if self.uncombined > len(self.accumulators):
            count += f"; {self.uncombined} before combining the sums that share a weight"
        lines.append(count + "):")
        lines += [f"  {a}" for a in self.accumulators]
        lines.append("gradient (derived by sympy):")
        lines += [f"  {s} = {e}" for s, e in self.grad_coefs]
        lines.append(f"  dL/dz_i = {self.grad_vocab}")
        if self.grad_topk != 0:
            lines.append(f"  dL/dz_(id_k) += {self.grad_topk}")
        if self.teacher_grad:
            lines.append(f"  dL/dt_i = {self.grad_teacher}")
        return "\n".join(lines)


def _num(x) -> sp.Expr:
    x = sp.sympify(x)
    return sp.nsimplify(x, rational=True) if isinstance(x, sp.Float) else x


class _Lowering:
    def __init__(self) -> None:
        self.norms: dict[tuple, sp.Symbol] = {}
        self.norm_of: dict[sp.Symbol, tuple] = {}
        self.reductions: dict[tuple[str, sp.Expr], sp.Symbol] = {}
        self.red_of: dict[sp.Symbol, tuple[str, sp.Expr]] = {}
        self.accs: dict[tuple, Accumulator] = {}

    # -- abstraction: LSE(..) and vsum(..) become placeholder symbols ------------------------------
    def norm(self, alpha, beta) -> sp.Symbol:
        key = (_num(alpha), _num(beta))
        if not all(k.is_number and k >= 0 for k in key) or key == (0, 0):
            raise ValueError(f"log-normaliser LSE{key}: temperatures must be positive numbers")
        if key not in self.norms:
            sym = sp.Symbol(f"N{len(self.norms)}", real=True)
            self.norms[key], self.norm_of[sym] = sym, key
        return self.norms[key]

    def reduction(self, domain: str, body: sp.Expr) -> sp.Symbol:
        key = (domain, body)
        if key not in self.reductions:
            sym = sp.Symbol(f"R{len(self.reductions)}", real=True)
            self.reductions[key], self.red_of[sym] = sym, key
        return self.reductions[key]

    def sum_of(self, domain: str, body: sp.Expr) -> sp.Expr:
        """The reduction of ``body``, read where it can be as a row constant times one already
        declared (JSD's gradient sum through LSE(z) is -beta times its KL(p||m) sum), or the
        reduction of ``body`` as it is."""
        if body == 0:
            return sp.S.Zero
        for (d, b), r in self.reductions.items():
            if d == domain:
                k = sp.cancel(sp.together(body) / b)
                if not k.has(*_ELEMENT, *S.vectors_in(k)) and k != 0:
                    return k * r
        return self.reduction(domain, body)

    def abstract(self, expr: sp.Expr) -> sp.Expr:
        expr = expr.replace(S.LSE, self.norm)
        # (declare_term has already refused nested reductions)
        for fn, domain in ((S.vsum, "vocab"), (S.topk_sum, "topk")):
            expr = expr.replace(fn, lambda body, _domain=domain: self.reduction(_domain, body))
        return expr

    # -- reductions -> accumulators ----------------------------------------------------------------
    def acc(self, domain: str, online: bool, alpha, beta, body) -> sp.Symbol:
        key = (domain, online, alpha, beta, body)
        if key not in self.accs:
            self.accs[key] = Accumulator(f"acc{len(self.accs)}", domain, online, alpha, beta, body)
        return sp.Symbol(self.accs[key].name, real=True)

    def online_piece(self, piece: sp.Expr, domain: str):
        """``row * exp(alpha*z + beta*t) * h`` with h computable in the first read, or None."""
        if domain == "vocab":   # (a per-class vector varies along the vocabulary as the logits do)
            elem, z, t = (S.logit, S.teacher_logit, *S.vectors_in(piece)), S.logit, S.teacher_logit
        else:
            elem, z, t = (S.topk_logit, S.topk_logprob), S.topk_logit, None
        row, part = piece.as_independent(*elem, as_Add=False)
        exponent, rest = sp.S.Zero, sp.S.One
        for f in sp.Mul.make_args(part):
            if isinstance(f, sp.exp) and f.args[0].has(z) or (t is not None and isinstance(f, sp.exp)):
                exponent += f.args[0]
            else:
                rest *= f
        exponent = sp.expand(exponent)
        alpha = exponent.coeff(z)
        beta = exponent.coeff(t) if t is not None else sp.S.Zero
        const = sp.expand(exponent - alpha * z - (beta * t if t is not None else 0))
        if const.has(*elem) or not (alpha.is_number and beta.is_number) or alpha < 0 or beta < 0:
            return None
        allowed = set(elem) | _BEFORE_STATS
        if any(s not in allowed and not s.name.startswith((S.TOKEN_PREFIX, S.RUNTIME_PREFIX))
               for s in rest.free_symbols):
            return None
        factor = _merge_exp(row * sp.exp(const) * sp.exp(alpha * M + beta * MT))
        if domain == "topk" and alpha != 0:
            cz = rest.diff(z)
            c0 = sp.expand(rest - cz * z)
            if cz != 0 and not cz.has(*elem) and not c0.has(*elem):
                # h = c0 + cz*z_k as cz*(z_k - m) and (c0 + cz*m) times the weights' sum, as below:
                # summed as they are, z_k of 4000 in a spread row cancel against m in the row math
                # (a gradient 300 times further from float64 than torch's; the fuzzer's spread regime)
                base = self.acc(domain, True, alpha, sp.S.Zero, sp.S.One)
                relative = self.acc(domain, True, alpha, sp.S.Zero, cz * (z - M))
                return factor * (c0 + cz * M) * base + factor * relative
        linear = _linear(rest) if domain == "vocab" and (alpha, beta) != (0, 0) else None
        if linear is not None:
            # h = c0 + cz*z + ct*t summed as cz*(z - m) + ct*(t - m_t), relative to the running
            # maxima (the kernel shifts it when they grow), plus (c0 + cz*m + ct*m_t) times the
            # weights' own sum: entropy's sum p z is m + sum p (z - m), and m cancels in lse - sum p z
            c0, cz, ct = linear
            base = self.acc(domain, True, alpha, beta, sp.S.One)
            relative = self.acc(domain, True, alpha, beta, cz * ZM + ct * TM)
            return factor * (c0 + cz * M + ct * MT) * base + factor * relative   # two terms: m cancels
        return factor * self.acc(domain, True, alpha, beta, rest)

    def lower_reduction(self, domain: str, body: sp.Expr) -> sp.Expr:
        value, exact = sp.S.Zero, sp.S.Zero
        for addend in sp.Add.make_args(body):
            expanded = sp.Add.make_args(sp.expand(addend))
            pieces = [self.online_piece(p, domain) for p in expanded]
            # (z/2 - N)**2 * p expanded is z**2 * p / 4 - z * N * p + N**2 * p: its z**2 summed as it is
            # (no shift keeps a square relative to the running maximum) cancels against the others'
            # m**2 in the row math, every digit lost on a row of large logits (found by the fuzzer,
            # 1.6e3 off). Such an addend is an exact sum, relative to the final maxima.
            mixed = domain == "vocab" and len(expanded) > 1 and any(_nonlinear(p) for p in expanded)
            if all(p is not None for p in pieces) and not mixed:
                value += sp.Add(*pieces)
            else:
                exact += addend
        if exact != 0:
            value += self.acc(domain, False, sp.S.Zero, sp.S.Zero, exact)
        return value


def _only_smooth(expr: sp.Expr, x: sp.Symbol) -> bool:
    """Whether ``x`` appears only in sums, products, powers, exp, log and tanh of ``expr``: no
    condition, Min/Max/Abs or other function reads it."""
    smooth = (sp.exp, sp.log, sp.tanh, *CANCELLATIONS)
    return not any(isinstance(node, (sp.core.function.Application, sp.core.relational.Relational))
                   and not isinstance(node, smooth) and node.has(x) for node in sp.preorder_traversal(expr))


def _nonlinear(piece: sp.Expr) -> bool:
    """Whether a summand, apart from its exponentials, is a polynomial of degree 2 or more in the
    logits and the teacher's (``z**2``, ``z*t``): what no shift keeps relative to the running maxima.
    (A bounded function of them, ``tanh(z)``, or a per-class vector's weight, ``w*z``, is summed as
    before.)"""
    rest = sp.Mul(*[f for f in sp.Mul.make_args(piece) if not isinstance(f, sp.exp)])
    z, t = S.logit, S.teacher_logit
    return rest.is_polynomial(z, t) and any(rest.diff(a, b) != 0 for a, b in ((z, z), (z, t), (t, t)))


def _linear(h: sp.Expr):
    """``(c0, cz, ct)`` with ``h = c0 + cz*z + ct*t`` and at least one of ``cz, ct`` non-zero, or None."""
    z, t = S.logit, S.teacher_logit
    cz, ct = h.diff(z), h.diff(t)
    c0 = sp.expand(h - cz * z - ct * t)
    if cz.has(z, t) or ct.has(z, t) or c0.has(z, t) or (cz == 0 and ct == 0) or S.vectors_in(h):
        return None   # (coefficients that vary along the vocabulary are no row factors)
    return c0, cz, ct


def base_of(acc: Accumulator, accs) -> Accumulator:
    """The sum of the weights of ``acc``'s group (body 1), which a relative sum shifts by."""
    return next(a for a in accs if a.online and (a.domain, a.alpha, a.beta) == (acc.domain, acc.alpha, acc.beta)
                and a.body == 1)


def shift(acc: Accumulator) -> tuple[sp.Expr, sp.Expr]:
    """``(d body/d zm, d body/d tm)`` of an online accumulator kept relative to the running maxima:
    when they grow by ``dm, dm_t`` the sum moves by ``-(dm*cz + dm_t*ct) * (the weights' sum)``.
    (A top-k sum, taken once the row's maximum is known, reads it as ``z_k - m``.)"""
    if acc.domain == "topk":
        return -acc.body.diff(M), sp.S.Zero
    return acc.body.diff(ZM), acc.body.diff(TM)


def _merge_exp(expr: sp.Expr) -> sp.Expr:
    """One exp per product, so that exp(2*m)*exp(-2*N) is evaluated as exp(2*m - 2*N) <= 1."""
    exponent, rest = sp.S.Zero, sp.S.One
    for f in sp.Mul.make_args(expr):
        if isinstance(f, sp.exp):
            exponent += f.args[0]
        else:
            rest *= f
    return rest * sp.exp(sp.expand(exponent))


def _prune(accs: list[Accumulator], normalizers, exprs: list[sp.Expr]):
    """Drop accumulators nothing reads (left by reductions that fell back to an exact sum) and
    number the rest densely, so that the generated kernel keeps only what it uses."""
    used = {n.acc for n in normalizers}
    used |= {s.name for e in exprs for s in e.free_symbols}
    used |= {s.name for a in accs if a.name in used for s in a.body.free_symbols}
    used |= {base_of(a, accs).name for a in accs if a.name in used and a.online and shift(a) != (0, 0)}
    kept = [a for a in accs if a.name in used]
    rename = {a.name: f"acc{i}" for i, a in enumerate(kept)}
    subs = {sp.Symbol(o, real=True): sp.Symbol(n, real=True) for o, n in rename.items()}
    return tuple(Accumulator(rename[a.name], a.domain, a.online, a.alpha, a.beta, a.body.xreplace(subs))
                 for a in kept), rename


def _simplified(e: sp.Expr) -> sp.Expr | None:
    """``e`` by sympy's ``cancel``, else by its ``simplify``, or None where ``e`` holds conditions
    (Piecewise, sign: from Min, Max and Abs) that ``cancel`` leaves: sympy's simplify of a quotient
    of conditions can run for many minutes (found by the H200 fuzz run, a head that never finished
    building: ``Abs(Min(target_logit, vsum(u * softmax * log(softmax))))``)."""
    r = sp.cancel(e)
    if r.is_number:
        return r
    return None if r.has(sp.Piecewise, sp.sign) else sp.simplify(r)


def _combine(accs: list[Accumulator], fixed: set[str], exprs: list[sp.Expr]):
    """Online sums that every expression reads only through one combination ``A + k*B`` become one
    sum of the combined summand: forward KL's ``sum q t - sum q z`` becomes ``sum q (t - z)``, one
    running sum fewer and no cancellation between two large sums. The two must share their weight
    ``exp(alpha*z + beta*t)`` and ``k`` be known in the first read (labels, tokens). (Exact sums stay
    apart: each is its own unit of the 0 * log 0 = 0 convention at -inf inputs, so JSD's KL(q||m)
    part must not vanish with its KL(p||m) part where only the teacher is -inf.) ``A + k*B`` is the only
    way an expression ``E`` reads ``A`` and ``B`` exactly when ``dE/dB = k * dE/dA`` for every ``E``;
    then ``E`` with ``A`` the combined sum and ``B = 0`` is the same function. ``fixed``: sums read
    by name (the normalisers' and any that a summand reads), never combined.
    Returns the accumulators left and the expressions rewritten."""
    accs, exprs = list(accs), list(exprs)

    def known(k: sp.Expr) -> bool:
        return all(s in _BEFORE_STATS or s.name.startswith(S.TOKEN_PREFIX) for s in k.free_symbols)

    def ratio(a: Accumulator, b: Accumulator):
        A, B = sp.Symbol(a.name, real=True), sp.Symbol(b.name, real=True)
        k = None
        for e in exprs:
            da, db = e.diff(A), e.diff(B)
            if da == 0 and db == 0:
                continue
            if da == 0 or db == 0:
                return None
            try:
                r = _simplified(db / da)
                if r is None:
                    return None
                if k is None:
                    k = r
                elif _simplified(r - k) != 0:   # (None, a difference with conditions, is not 0)
                    return None
            except (ValueError, TypeError):
                # (sympy's simplify can fail on a condition it cannot compare, 'zoo is not comparable':
                # combining two sums only saves an accumulator, so they stay apart)
                return None
        return k if k is not None and known(k) else None

    merged = True
    while merged:
        merged = False
        for i, a in enumerate(accs):
            for b in accs[i + 1:]:
                if ({a.name, b.name} & fixed or not (a.online and b.online) or
                        (a.domain, a.alpha, a.beta) != (b.domain, b.alpha, b.beta)):
                    continue
                k = ratio(a, b)
                if k is None:
                    continue
                accs[i] = Accumulator(a.name, a.domain, a.online, a.alpha, a.beta, a.body + k * b.body)
                accs.remove(b)
                exprs = [e.xreplace({sp.Symbol(b.name, real=True): sp.S.Zero}) for e in exprs]
                merged = True
                break
            if merged:
                break
    return accs, exprs


def _log_of_exp(expr: sp.Expr) -> sp.Expr:
    """``log(exp(E) * R)`` as ``E + log(R)`` (exp(E) > 0 for every real E): the log of a sum of
    exp(alpha*z) with no normaliser is ``alpha*m + log(acc)``, where ``log(exp(alpha*m)*acc)``
    overflows past alpha*m = 88."""
    def split(arg: sp.Expr) -> sp.Expr:
        exps = [f for f in sp.Mul.make_args(arg) if isinstance(f, sp.exp)]
        if not exps or not isinstance(arg, sp.Mul):
            return sp.log(arg)
        return sp.Add(*[f.args[0] for f in exps]) + sp.log(arg / sp.Mul(*exps))
    return expr.replace(sp.log, split)


def _abstract_terms(lw: _Lowering, terms: tuple[tuple[str, sp.Expr, bool], ...]):
    """Pass 1: each term over placeholders of its sums (``_Lowering.abstract``): its row values, a
    segment term's means and its formula in them, each loss term's weight, and the loss they make
    (a segment term's part is its coefs times its means' row quantities)."""
    row_values: list[tuple[str, sp.Expr]] = []
    segments: list[SegmentTerm] = []
    weights: list[sp.Symbol] = []
    loss = sp.S.Zero
    for name, formula, is_metric in terms:
        formula = run_time_temperatures(formula)
        if formula.has(S.segment_mean):
            # (never a metric: terms.check_metric refuses it when the head is built)
            # each statistic (a segment_mean, a segment_sorted: a sorted sum, a row_quantile) by its node
            means: dict[sp.Expr, sp.Symbol] = {}
            # (sympy may write one row quantity two ways, -a*(b - c) and a*(c - b): one statistic,
            # computed as first written)
            seen: dict[sp.Expr, sp.Expr] = {}

            def stat(node, _means=means, _seen=seen, _name=name):
                node = _seen.setdefault(node.func(sp.expand(node.args[0]), *node.args[1:]), node)
                _means.setdefault(node, sp.Symbol(f"U{len(_means)}_{_name}", real=True))
                return _means[node]
            F = lw.abstract(formula.replace(lambda e: isinstance(e, S.segment_mean), stat))
            ordered = tuple(U for node, U in means.items() if isinstance(node, S.segment_sorted))
            quantiles = tuple((U, float(node.args[1])) for node, U in means.items() if isinstance(node, S.row_quantile))
            coefs = tuple(sp.Symbol(f"{U.name}_coef", real=True) for U in means.values())
            for (node, U), c in zip(means.items(), coefs):
                row_u = lw.abstract(node.args[0])
                row_values.append((U.name, row_u))
                if not isinstance(node, S.row_quantile):   # (a quantile is detached: no path through it)
                    loss += c * row_u
            w = sp.Symbol(f"w_{name}", real=True)
            weights.append(w)  # (a segment term's is folded into its coefs at run time)
            atoms = sorted({s for s in F.free_symbols if not s.name.startswith(S.RUNTIME_PREFIX)}
                           - set(means.values()) - set(S.SEGMENT_SYMBOLS), key=str)
            P = {a: sp.Symbol(f"P{k}_{name}", real=True) for k, a in enumerate(atoms)}
            if P and ordered:
                raise ValueError(f"{name}: segment_sorted(...) belongs to a segment term (a formula of "
                                 f"segment statistics alone), not to a row term that reads row quantities "
                                 f"{sorted(map(str, P))} beside it")
            if quantiles and not P:
                raise ValueError(f"{name}: row_quantile(...) is a row-level constant of the batch, for a row "
                                 f"term that reads it beside row quantities (a mask of the rows); a formula of "
                                 f"batch and segment statistics alone has no rows to mask")
            if P:
                # a row term of segment statistics (GSPO-token): its direct path is a row term's,
                # with the means read per row in the gradient launch; the path through the means
                # comes back through the coefs, which the segment kernel sums row by row
                row_values += [(p.name, a) for a, p in P.items()] + [(f"V_{name}", sp.S.One)]
                loss += w * F
            segments.append(SegmentTerm(
                name, tuple(means.values()), stable_form(without_stop_gradient(F.xreplace(P))),
                tuple(sp.S.Zero if U in dict(quantiles) else stable_form(without_stop_gradient(derive(F, U).xreplace(P)))
                      for U in means.values()), coefs,
                tuple(P.values()), f"V_{name}" if P else "", ordered, quantiles))
            continue
        f = cancellations(lw.abstract(formula))
        row_values.append((name, f))
        if not is_metric:
            w = sp.Symbol(f"w_{name}", real=True)
            weights.append(w)
            loss += w * f
    return row_values, segments, weights, loss


def _derive_gradient(lw: _Lowering, loss: sp.Expr, *, teacher: bool = False):
    """Pass 2: dloss/dz_i by the chain rule over the placeholders: per-row coefficients (``g0``,
    ...) and the per-element parts over the vocabulary and over the top-k entries. ``teacher``:
    dloss/dt_i too, the same way (returned last; 0 without): each group's summand differentiated
    in t, and each normaliser with beta != 0 through ``beta*exp(alpha*z_i + beta*t_i - N)``, with
    coefficients of their own after the student's (which it reads where they are the same row
    value), so the student's part is what the head's default kernel computes."""
    coefs: list[tuple[sp.Symbol, sp.Expr]] = []

    def coef(expr: sp.Expr, reuse: bool = False) -> sp.Expr:
        if expr == 0:
            return sp.S.Zero
        if reuse:
            known = next((s for s, e in coefs if e == expr), None)
            if known is not None:
                return known
        sym = sp.Symbol(f"g{len(coefs)}", real=True)
        coefs.append((sym, expr))
        return sym

    # A vocabulary sum read inside another's summand (LogitNorm's sum of z^2 inside its sum of
    # exp(z / (tau*||z||))) moves with z_i through that summand too: its coefficient collects the path.
    totals = {r: derive(loss, r) for r in lw.red_of}
    for outer, (domain, body) in list(lw.red_of.items()):
        for inner in in_order(body.free_symbols & set(totals)):
            totals[inner] += totals[outer] * lw.sum_of(domain, derive(body, inner))
    groups = shared_coefficients(list(lw.reductions.items()), loss, totals)
    grad_vocab, grad_topk = sp.S.Zero, sp.S.Zero
    for domain, C, members in groups:
        elem = S.logit if domain == "vocab" else S.topk_logit
        d = simpler(sp.Add(*[k * derive(body, elem) for body, k in members]))
        if d == 0:
            continue
        term = coef(C) * d
        if domain == "vocab":
            grad_vocab += term
        else:
            grad_topk += term

    def through_sums(x: sp.Symbol) -> sp.Expr:
        # dloss/dx of a row symbol x, directly and through the reductions that read it
        total = derive(loss, x)
        for domain, C, members in groups:
            if any(body.has(x) for body, _ in members):
                total += C * lw.sum_of(domain, sp.Add(*[k * derive(body, x) for body, k in members]))
        return total

    # row symbols that move with z_i: each normaliser N (dN/dz_i = alpha*exp(alpha*z_i + beta*t_i - N))
    # and the target logit; their coefficients also collect the paths through the reductions.
    student_norms = [n for n, (alpha, _) in lw.norm_of.items() if alpha != 0]
    for x in student_norms + list(_Z_DEPENDENT_ROW):
        total = through_sums(x)
        if total == 0:
            continue
        if x in lw.norm_of:
            alpha, beta = lw.norm_of[x]
            grad_vocab += coef(total) * alpha * sp.exp(alpha * S.logit + beta * S.teacher_logit - x)
        else:
            grad_vocab += coef(total) * _Z_DEPENDENT_ROW[x]
    grad_teacher = sp.S.Zero
    if teacher:
        # (no row symbol but the normalisers moves with t_i: the teacher's maximum in a run-time
        # temperature's rewrite is stopped, and no top-k summand reads the teacher's logits)
        for domain, C, members in groups:
            d = simpler(sp.Add(*[k * derive(body, S.teacher_logit) for body, k in members])) \
                if domain == "vocab" else sp.S.Zero
            if d != 0:
                grad_teacher += coef(C, reuse=True) * d
        for x, (alpha, beta) in lw.norm_of.items():
            total = through_sums(x) if beta != 0 else sp.S.Zero
            if total != 0:
                grad_teacher += coef(total, reuse=True) * beta * sp.exp(alpha * S.logit + beta * S.teacher_logit - x)
    return coefs, without_stop_gradient(grad_vocab), without_stop_gradient(grad_topk), \
        without_stop_gradient(grad_teacher)


def _accumulate(lw: _Lowering):
    """Pass 3: the placeholders as accumulators (``_Lowering.lower_reduction``), a sum read inside
    another's summand as one of the first read's; then each normaliser's sum. Returns each
    placeholder's value in the accumulators, and the normalisers."""
    nested = {r for _, body in lw.reductions for r in body.free_symbols if r in lw.red_of}
    lowered_red = {r: lw.lower_reduction(domain, without_stop_gradient(body))
                   for (domain, body), r in lw.reductions.items()}
    for r in nested:
        if any(not a.online for a in lw.accs.values() if sp.Symbol(a.name, real=True) in lowered_red[r].free_symbols):
            body = lw.red_of[r][1]
            run_time = body.has(*MAXIMA.values())
            raise ValueError(f"a sum read inside another sum must be one of the first read (a sum of "
                             f"exp(a*z) times z, t or inputs), not {body}" + (
                                 ": a sum at a temperature known only at run time (a tensor parameter or a "
                                 "token) is read after the stats; where another sum reads it other than as "
                                 "a row factor (inside a log: JSD's log(beta*p + (1-beta)*q)), give the "
                                 "temperature as a number" if run_time else ""))
    # a nested sum inside a summand (or a row factor of one: vsum(z * vsum(z))), and the gradient's
    # summands, read as the first read's sums
    lowered_red = {r: v.xreplace(lowered_red) for r, v in lowered_red.items()}
    for key, sym in list(lw.norms.items()):
        lw.acc("vocab", True, key[0], key[1], sp.S.One)
    normalizers = tuple(
        Normalizer(sym, key[0], key[1], lw.accs[("vocab", True, key[0], key[1], sp.S.One)].name)
        for key, sym in lw.norms.items())
    return lowered_red, normalizers


def _row_math(expr: sp.Expr, lowered_red: dict, normalizers: tuple[Normalizer, ...]) -> sp.Expr:
    """Pass 4, for each row value and gradient coefficient: read in the accumulators.

    Row math reads each normaliser as its parts, alpha*m + beta*m_t + log(acc), and the target
    logit as m + (z_y - m): sympy then cancels products such as acc*exp(m - N) (the total
    probability, 1) exactly, exp(m_t - N) is 1/acc, lse - z_y is log(acc) - zym, and N1 - N0 is
    (m - m_t) + log(acc2) - log(acc0): sums of small terms, where the rounded N (an ulp of |N|,
    1e-6 at N = 20) would cost a confident row's cross-entropy most of its digits.
    (z_y stays itself where a kink or a condition reads it: zym + m need not round back to z_y,
    and a tie that torch sees, z_y == b, must stay one.)"""
    parts = {n.symbol: n.value for n in normalizers}
    expr = without_stop_gradient(expr).xreplace(lowered_red).xreplace(parts).xreplace({S.row_max: M, TEACHER_MAX: MT})
    if _only_smooth(expr, S.target_logit):
        expr = expr.xreplace({S.target_logit: ZYM + M})
    return _cancel_maxima(_log_of_exp(sp.powsimp(expr, deep=True, combine="exp")))


def _cancel_maxima(expr: sp.Expr) -> sp.Expr:
    """A sum whose addends carry the row maximum inside products, ``a*(m + log(b))/b - a*m/b`` (a
    top-k sum of ``z_k - m`` beside its normaliser), with those products distributed where ``m``
    then cancels: apart, each is of the size of ``|m|`` (4000 on a spread row) and their fp32
    difference keeps none of the digits of the small rest. Where nothing cancels, as it was."""
    def cancelled(add: sp.Add) -> sp.Expr:
        spread = sp.Add(*[sp.expand_mul(a) if isinstance(a, sp.Mul) and a.has(M) else a for a in add.args])
        return spread if sp.count_ops(spread) and _count(spread, M) < _count(add, M) else add
    return expr.replace(lambda e: isinstance(e, sp.Add) and e.has(M), cancelled)


def _count(expr: sp.Expr, x: sp.Symbol) -> int:
    return sum(1 for node in sp.preorder_traversal(expr) if node == x)


def _move_maxima_factors(coefs: list[tuple[sp.Symbol, sp.Expr]], grad_vocab: sp.Expr, grad_topk: sp.Expr):
    """Pass 5: a coefficient's factor exp(E) of the row maxima (1/R of a sum of exp(alpha*z) with no
    normaliser: exp(-alpha*m)/acc) goes to the elements it multiplies, to meet their
    exp(alpha*z) = exp(alpha*m + alpha*zm) in one exponential: apart, past alpha*m = 88 one
    underflows to 0 and the other overflows to inf. (``coefs`` is rewritten in place; returns the
    gradient's two parts.) The coefficient keeps its other factors, not ``e / factor``: sympy
    writes ``exp(z_y - m) / exp(z_y - m)`` as ``exp(z_y - m) * exp(m - z_y)``, 0 * inf on a spread
    row (a clamp of ``1 - p_y``, whose kink keeps ``z_y`` itself; found by the fuzzer)."""
    moved = {}
    for i, (sym, e) in enumerate(coefs):
        moves = [isinstance(f, sp.exp) and f.has(M, MT) for f in sp.Mul.make_args(e)]
        if any(moves):
            kept = sp.Mul(*[f for f, move in zip(sp.Mul.make_args(e), moves) if not move])
            factor = sp.Mul(*[f for f, move in zip(sp.Mul.make_args(e), moves) if move])
            coefs[i], moved[sym] = (sym, kept), sym * factor
    return grad_vocab.xreplace(moved), sp.powsimp(grad_topk.xreplace(moved), deep=True, combine="exp")


def _relative_to_maxima(lw: _Lowering, normalizers: tuple[Normalizer, ...], lowered_red: dict,
                        grad_vocab: sp.Expr, grad_topk: sp.Expr) -> tuple[sp.Expr, sp.Expr]:
    """Pass 6: the per-element expressions of the reads after the first (the gradient's, the exact
    sums' summands, in ``lw.accs``) see each element relative to the final maxima and each
    normaliser as maxima + log(acc): exp(z - N) is exp(zm - L_N), whose exponent is exact up to an
    ulp of itself, where z - N would carry the rounding of |N| (the gradient of a row with logits
    near 100 off by 5e-6 relative, 30x torch's). The top-k entries too, as zkm = z_k - m, where the
    expression reads z_k only smoothly (as _row_math's z_y: a tie torch sees must stay one): with
    z_k - N rounded at |m| (20 under softcap), a p_k of 1 - 1e-6 was exactly 1 and log(1 - p_k)
    -inf (found by the fuzzer). Returns the gradient's vocabulary and top-k parts."""
    relative = {n.symbol: n.alpha * M + n.beta * MT + n.log_acc for n in normalizers}
    relative.update({S.logit: ZM + M, S.teacher_logit: TM + MT, S.row_max: M, TEACHER_MAX: MT})

    def per_element(expr: sp.Expr) -> sp.Expr:
        return sp.powsimp(expr.xreplace(relative), deep=True, combine="exp")

    def per_entry(expr: sp.Expr) -> sp.Expr:
        return expr.xreplace({S.topk_logit: ZKM + M}) if _only_smooth(expr, S.topk_logit) else expr
    lw.accs = {k: (a if a.online else Accumulator(a.name, a.domain, False, a.alpha, a.beta,
                                                  per_element(per_entry(a.body.xreplace(lowered_red)))))
               for k, a in lw.accs.items()}
    return per_element(grad_vocab), per_element(per_entry(grad_topk))


def _combine_and_prune(lw: _Lowering, normalizers: tuple[Normalizer, ...], row_values, coefs, grad_vocab,
                       grad_topk):
    """Pass 7: sums that are multiples of one another combined (``_combine``), those nothing reads
    dropped and the rest renamed in order (``_prune``). Returns the accumulators, the normalisers,
    the row values, coefficients and the gradient's two parts renamed, and how many sums there were
    before combining."""
    exprs = [e for _, e in row_values] + [e for _, e in coefs]
    # (the gradient's per-element expressions read accumulators by name too: a sum inside another's
    # summand; kept, never combined, and renamed with the rest)
    grads = [grad_vocab, grad_topk]
    uncombined = len(_prune(list(lw.accs.values()), normalizers, exprs + grads)[0])
    # never combined: sums read by name (the normalisers', and the weights' own sums that relative
    # sums shift by), and any a summand or the gradient reads
    fixed = ({n.acc for n in normalizers} | {a.name for a in lw.accs.values() if a.online and a.body == 1}
             | {s.name for a in lw.accs.values() for s in a.body.free_symbols}
             | {s.name for g in grads for s in g.free_symbols})
    accs, exprs = _combine(list(lw.accs.values()), fixed, exprs)
    row_values = [(n, e) for (n, _), e in zip(row_values, exprs)]
    coefs = [(s, e) for (s, _), e in zip(coefs, exprs[len(row_values):])]
    accumulators, rename = _prune(accs, normalizers, exprs + grads)
    normalizers = tuple(Normalizer(n.symbol, n.alpha, n.beta, rename[n.acc]) for n in normalizers)
    subs = {sp.Symbol(old, real=True): sp.Symbol(new, real=True) for old, new in rename.items()}
    row_values = [(n, e.xreplace(subs)) for n, e in row_values]
    coefs = [(s, e.xreplace(subs)) for s, e in coefs]
    # (found by the fuzzer: with the sums renumbered after combining, dL/dz_i read the outer sum's
    # accumulator where its summand's inner sum had been, a wrong gradient)
    return accumulators, normalizers, row_values, coefs, grad_vocab.xreplace(subs), grad_topk.xreplace(subs), \
        uncombined


def _inputs(free: set[sp.Symbol]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The per-row tokens and per-class vectors the lowered head reads; a parameter left unbound
    is refused."""
    tokens = tuple(sorted(s.name[len(S.TOKEN_PREFIX):] for s in free
                          if s.name.startswith(S.TOKEN_PREFIX)))
    vectors = tuple(sorted(s.name[len(S.VECTOR_PREFIX):] for s in free if s.name.startswith(S.VECTOR_PREFIX)))
    if set(vectors) & set(tokens):
        raise ValueError(f"{sorted(set(vectors) & set(tokens))}: one name for a token(...) and a vector(...)")
    params = [s.name for s in free if s.name.startswith(S.PARAM_PREFIX)]
    if params:
        raise ValueError(f"unbound parameters {params}")
    return tokens, vectors


def lower(terms: tuple[tuple[str, sp.Expr, bool], ...], *, teacher_grad: bool = False) -> Lowered:
    """``terms``: (name, bound formula, is_metric) for each term of the head, in output order. The
    passes, in order: each term over placeholders of its sums, the gradient by the chain rule, the
    placeholders as accumulators, the row math in them, the maxima's factors moved to the elements,
    the later reads relative to the maxima, the sums combined and pruned. ``teacher_grad``: the
    variant that also derives dL/dt_i (``Lowered.grad_teacher``), for teacher logits that require grad."""
    try:
        return _lower(terms, teacher_grad)
    except RecursionError:
        # sympy's Piecewise evaluation can call itself without end on a derivative of nested
        # Max/Min whose conditions compare sums (Max(Max(lse_at(T), p_y), vsum(logsoftmax))):
        # refused, saying so, not a crash deep inside sympy
        raise ValueError(f"terms {[name for name, _, _ in terms]}: sympy could not simplify the derivative of "
                         "their Max/Min nesting (a recursion without end in its Piecewise); write the nested "
                         "Max/Min as one Max/Min of all its arguments, or split the term") from None


def _lower(terms: tuple[tuple[str, sp.Expr, bool], ...], teacher_grad: bool = False) -> Lowered:
    lw = _Lowering()
    row_values, segments, weights, loss = _abstract_terms(lw, terms)
    coefs, grad_vocab, grad_topk, grad_teacher = _derive_gradient(lw, loss, teacher=teacher_grad)
    lowered_red, normalizers = _accumulate(lw)
    # dL/dz_i and dL/dt_i, the per-element gradients over the vocabulary, go through the passes below
    # as one (a sympy Tuple: each pass rewrites both alike), split again after the sums are renamed
    grad_vocab = sp.Tuple(grad_vocab, grad_teacher).xreplace(lowered_red)
    row_values = [(n, _row_math(e, lowered_red, normalizers)) for n, e in row_values]
    coefs = [(s, sech2(_row_math(e, lowered_red, normalizers))) for s, e in coefs]
    grad_vocab, grad_topk = _move_maxima_factors(coefs, grad_vocab, grad_topk)
    grad_vocab, grad_topk = _relative_to_maxima(lw, normalizers, lowered_red, grad_vocab, grad_topk)
    accumulators, normalizers, row_values, coefs, grad_vocab, grad_topk, uncombined = _combine_and_prune(
        lw, normalizers, row_values, coefs, grad_vocab, grad_topk)
    grad_vocab, grad_teacher = grad_vocab
    # the printed forms finite wherever the formulas are (stable.py), last: no pass above expands them again
    row_values = [(n, shared_exponentials(stable_form(e))) for n, e in row_values]
    coefs = [(s, stable_form(e)) for s, e in coefs]
    grad_vocab, grad_topk, grad_teacher = stable_form(grad_vocab), stable_form(grad_topk), stable_form(grad_teacher)
    accumulators = tuple(a if a.online else Accumulator(a.name, a.domain, False, a.alpha, a.beta, stable_form(a.body))
                         for a in accumulators)
    free = set().union(*(e.free_symbols for _, e in row_values), *(e.free_symbols for _, e in coefs),
                       grad_vocab.free_symbols, grad_topk.free_symbols, grad_teacher.free_symbols,
                       *(a.body.free_symbols for a in accumulators))
    tokens, vectors = _inputs(free)
    return Lowered(
        outputs=tuple(name for name, _, _ in terms),
        accumulators=accumulators,
        normalizers=normalizers,
        row_values=tuple(row_values),
        segments=tuple(segments),
        weights=tuple(weights),
        grad_coefs=tuple(coefs),
        grad_vocab=grad_vocab,
        grad_topk=grad_topk,
        tokens=tokens,
        uses_labels=bool(free & {S.target_logit, S.label, IS_Y, ZYM}),
        uses_teacher=bool(free & {S.teacher_logit, MT, TM}) or any(b != 0 for _, b in lw.norms),
        uses_topk=any(a.domain == "topk" for a in accumulators),
        uses_argmax=bool(free & {S.argmax, IS_ARGMAX}),
        uncombined=uncombined,
        vectors=vectors,
        teacher_grad=teacher_grad,
        grad_teacher=grad_teacher,
    )
