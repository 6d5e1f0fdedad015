"""Parity tests for your own heads: ``assert_parity(head)`` and the float64 ``reference(head)``.

The reference evaluates the head's declared formulas directly in float64 torch: a walk over each
formula's tree, each construct the torch op a user would write (``_OPS``), with ``lse_at(T)`` as a logsumexp, ``vsum`` a sum over the
vocabulary, ``topk_sum`` a gather and a sum, ``segment_mean`` a mean over a segment's valid rows
(``segment_sorted``: their sums, torch.sort's; ``row_quantile``: torch.quantile over the valid rows);
the terms are reduced as the head's contract says (divisor, weights, metrics), and the gradient is
taken by ``torch.autograd``. Nothing of the compiler takes part (no lowering, planning, emitted
code or sympy derivative), so it checks all of them.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import sympy as sp
import torch
from sympy.core.mul import _keep_coeff
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanFalse, BooleanTrue

from . import symbols as S
from .head import HeadLoss
from .inputs import STANDARD_INPUTS
from .interface import weight_name
from .terms import reads_rows

__all__ = ["reference", "assert_parity", "random_inputs", "TOLERANCES"]

# (values: relative and absolute; gradient: error over the largest |gradient|) per logits dtype.
# A bf16 gradient is stored in bf16 (2**-8 relative), values are accumulated in fp32 either way.
TOLERANCES = {torch.float32: (1e-4, 1e-5, 2e-4), torch.bfloat16: (2e-3, 2e-3, 1e-2),
              torch.float16: (2e-3, 2e-3, 5e-3)}


_Z_ROW, _T_ROW = sp.Symbol("z_row", real=True), sp.Symbol("t_row", real=True)


def _sum(summand, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The sum over the last dim of ``summand(a, b)`` with the ``0 * log 0 = 0`` convention: a
    summand that is NaN where ``a`` or ``b`` is -inf counts as 0. (It is evaluated again with those
    elements set to 0, so that autograd's gradient there is 0, not 0 * NaN.)"""
    dead = a == float("-inf")
    if b is not None:
        dead = dead | (b == float("-inf"))
    with torch.no_grad():
        zero = dead & summand(a, b).isnan()
    if not zero.any():
        return summand(a, b).sum(-1, keepdim=True)
    a, b = a.masked_fill(zero, 0.0), (None if b is None else b.masked_fill(zero, 0.0))
    return summand(a, b).masked_fill(zero, 0.0).sum(-1, keepdim=True)


def _evaluate(expr: sp.Expr, ns: dict[str, Any]) -> torch.Tensor | float:
    """``expr`` over whole rows: element symbols are [rows, V] (or [rows, K]) tensors, row symbols
    [rows, 1], reductions keep the row dimension; ``ns``: each symbol's value by name. Each
    construct is the torch op a user would write (``_OPS``), so that autograd's derivative at a kink
    is torch's own; sums and products in sympy's printed order (its ordered terms and factors, a
    product's denominators divided last), numbers as Python floats."""
    if isinstance(expr, sp.Symbol):
        return ns[expr.name]
    if isinstance(expr, (sp.Number, sp.NumberSymbol)) or (isinstance(expr, (sp.Pow, sp.Function)) and expr.is_number):
        try:
            return float(expr)    # sqrt(pi), erf(1): a number
        except TypeError:
            pass                  # not a plain number: LSE(1, 0)
    for kind in type(expr).__mro__:
        if kind in _OPS:
            return _OPS[kind](expr, ns)
    raise NotImplementedError(f"no reference evaluation of {type(expr).__name__}: {expr}")


def _tensor(expr: sp.Expr, ns: dict[str, Any]) -> torch.Tensor:
    """``expr``'s value as a tensor of the logits' dtype (a number too: an argument of a torch op)."""
    value = _evaluate(expr, ns)
    return ns["z"].new_tensor(value) if isinstance(value, float) else value


def _add(expr: sp.Add, ns: dict[str, Any]):
    total = None
    for term in expr.as_ordered_terms():
        value = _evaluate(term, ns)
        total = value if total is None else total + value
    return total


def _mul(expr: sp.Mul, ns: dict[str, Any]):
    # as sympy prints a product: a negative coefficient taken out, the factors with negative
    # rational exponents divided last (a/b, not a*b**-1)
    c, rest = expr.as_coeff_Mul()
    negative = c < 0
    if negative:
        expr = _keep_coeff(-c, rest)
    numerator, denominator = [], []
    for f in expr.as_ordered_factors():
        if f.is_Pow and f.exp.is_Rational and f.exp.is_negative:
            denominator.append(sp.Pow(f.base, -f.exp, evaluate=f.exp == -1))
        else:
            numerator.append(f)
    value = _product(numerator, ns) if numerator else 1.0
    if denominator:
        value = value / _product(denominator, ns)
    return -value if negative else value


def _product(factors: list[sp.Expr], ns: dict[str, Any]):
    return functools.reduce(operator.mul, (_evaluate(f, ns) for f in factors))


def _pow(expr: sp.Pow, ns: dict[str, Any]) -> torch.Tensor:
    # torch.pow, as a user writes x ** a: its derivative a * x**(a - 1), 0 at x = 0 for a > 1
    # (exp(a * log(x)), the kernels' way for a general exponent, has autograd's 0 * inf there)
    base, e = expr.args
    if e == sp.S.Half:
        return torch.sqrt(_tensor(base, ns))
    return torch.pow(_tensor(base, ns), _evaluate(e, ns))


def _extremum(fn: str):
    # torch.minimum/maximum of two; amin/amax of the stacked arguments for more (equal split of a tie)
    def evaluate(expr, ns):
        args = [_tensor(a, ns) for a in expr.args]
        if len(args) == 2:
            return getattr(torch, f"{fn}imum")(*args)
        return getattr(torch.stack(torch.broadcast_tensors(*args)), f"a{fn}")(0)
    return evaluate


def _piecewise(expr: sp.Piecewise, ns: dict[str, Any]):
    out = None
    for value, cond in reversed(expr.args):
        if out is None or cond == sp.true:
            out = _evaluate(value, ns)
        else:
            out = torch.where(_evaluate(cond, ns), _evaluate(value, ns), out)
    return out


def _sum_over(a: str, b: str, rows: tuple[str, str]):
    # vsum over the row's elements (z, t), topk_sum over its top-k entries (z_k, l_k). The sum is over
    # the whole rows (``rows``: a sum inside another's summand sums the row, not the outer summand's
    # elements, which _sum evaluates a second time with its -inf entries set to 0)
    def evaluate(expr, ns):
        return _sum(lambda x, y: _evaluate(expr.args[0], {**ns, a: x, b: y}) + torch.zeros_like(x),
                    ns[rows[0]], ns[rows[1]])
    return evaluate


def _unary(fn):
    return lambda expr, ns: fn(_evaluate(expr.args[0], ns))


_RELATIONS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
              "!=": operator.ne}

# each construct of a formula (symbols.FUNCTIONS, the package's own functions, arithmetic, the
# conditions of a Piecewise) as the torch op a user would write
_OPS = {
    sp.Add: _add, sp.Mul: _mul, sp.Pow: _pow,
    sp.exp: _unary(torch.exp), sp.log: _unary(torch.log), sp.tanh: _unary(torch.tanh), sp.sin: _unary(torch.sin),
    sp.cos: _unary(torch.cos), sp.erf: _unary(torch.erf), sp.Abs: _unary(torch.abs),
    sp.sign: _unary(lambda a: torch.where(a > 0, 1.0, torch.where(a < 0, -1.0, 0.0))),
    sp.Min: _extremum("min"), sp.Max: _extremum("max"),
    S.clamp: lambda expr, ns: torch.clamp(*(_tensor(a, ns) for a in expr.args)),
    sp.Piecewise: _piecewise,
    Relational: lambda expr, ns: _RELATIONS[expr.rel_op](_evaluate(expr.lhs, ns), _evaluate(expr.rhs, ns)),
    sp.And: lambda expr, ns: functools.reduce(operator.and_, (_evaluate(a, ns) for a in expr.args)),
    sp.Or: lambda expr, ns: functools.reduce(operator.or_, (_evaluate(a, ns) for a in expr.args)),
    sp.Not: _unary(operator.invert),
    sp.ITE: lambda expr, ns: _evaluate(sp.Or(sp.And(expr.args[0], expr.args[1]),
                                             sp.And(sp.Not(expr.args[0]), expr.args[2])), ns),
    BooleanTrue: lambda expr, ns: True, BooleanFalse: lambda expr, ns: False,
    S.stop_gradient: _unary(lambda a: a.detach()),
    # over the whole rows (z_row, t_row), also inside a vsum (whose summand takes z, t)
    S.LSE: lambda expr, ns: torch.logsumexp(_evaluate(expr.args[0] * _Z_ROW + expr.args[1] * _T_ROW, ns), -1,
                                            keepdim=True),
    S.vsum: _sum_over("z", "t", rows=("z_row", "t_row")), S.topk_sum: _sum_over("z_k", "l_k", rows=("z_k", "l_k")),
}


@dataclass
class Reference:
    """``ref(logits, labels, **inputs) -> (loss, {name: value}, dL/dlogits)``, all float64."""

    head: HeadLoss

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None = None, **inputs: Any):
        x, out, values, _ = self.evaluate(logits, labels, **inputs)
        if out.requires_grad:
            (out.sum() if inputs.get("reduction") == "none" else out).backward()
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        return out.detach(), values, grad.reshape(logits.shape)

    def evaluate(self, logits: torch.Tensor, labels: torch.Tensor | None = None, *,
                 precision: torch.dtype = torch.float64, **inputs: Any):
        """``(x, out, values, rows)`` before any backward: ``x`` the float64 leaf the logits became
        (``[rows, V]``), ``out`` the loss (per row under reduction="none") and ``rows`` each
        non-segment output's per-row values (0 on invalid rows), both in the graph of ``x``, so
        that a caller can take gradients of its own (upstream gradients on ``out.rows``).
        ``precision``: the dtype the logits (and teacher logits) are evaluated in; float32 gives
        what plain torch computes in fp32 for the same formula (the fuzzer's yardstick of a
        formula's own rounding)."""
        head = self.head
        V = logits.shape[-1]
        shape = logits.shape[:-1]
        x = logits.detach().to(precision).reshape(-1, V).requires_grad_()
        z = x if head.softcap is None else head.softcap * torch.tanh(x / head.softcap)
        z = z * head.logit_scale
        R = z.shape[0]
        y = labels.reshape(-1) if labels is not None else torch.zeros(R, dtype=torch.long, device=z.device)
        valid = torch.ones(R, dtype=torch.bool, device=z.device)
        if labels is not None:
            valid &= y != head.ignore_index
        if inputs.get("loss_mask") is not None:
            valid &= inputs["loss_mask"].reshape(-1)
        # an ignored row's target: its argmax, a finite logit (a -inf one would make 0 * inf in the backward)
        yc = torch.where(valid, y.clamp(0, V - 1), z.detach().argmax(-1))[:, None]
        ns = {"z": z, "z_y": z.gather(1, yc), "label": y[:, None].to(precision), "vocab_size": z.new_tensor(float(V)),
              "argmax": z.argmax(-1, keepdim=True).to(precision), "t": None,
              S.row_max.name: z.gather(1, z.detach().argmax(-1, keepdim=True))}
        # a row whose logits (or teacher logits) are all -inf has no distribution: its values are NaN
        no_dist = (z == float("-inf")).all(-1)
        if inputs.get("teacher_logits") is not None:
            # (teacher logits that require grad stay in the graph: autograd's dL/dt, for co-distillation)
            teacher = inputs["teacher_logits"]
            ns["t"] = (teacher if teacher.requires_grad else teacher.detach()).to(precision).reshape(R, V)
            no_dist = no_dist | (ns["t"] == float("-inf")).all(-1)
        elif any(f.has(S.teacher_logit) for _, f, _ in head._bound):
            # teacher logits a formula names but its kernel does not read (vsum(teacher_prob_at(T))
            # is 1): values of their own, as for a token or a vector below; the head takes none
            ns["t"] = torch.linspace(-1.0, 1.0, V, dtype=precision, device=z.device).expand(R, V)
        ns["z_row"], ns["t_row"] = z, ns["t"]
        if inputs.get("teacher_topk_ids") is not None:
            ids = inputs["teacher_topk_ids"].reshape(R, -1)
            ns["z_k"] = z.gather(1, ids)
            ns["l_k"] = inputs["teacher_topk_logprobs"].to(precision).reshape(R, -1)
        # a token or a vector that a formula names but its kernel does not read (the formula's value
        # does not depend on it: Min(1 + a**2, vsum(softmax)) is 1, vsum(u - stop_gradient(u)) is 0)
        # takes values of its own: the head accepts no such input
        for sym in set().union(*(f.free_symbols for _, f, _ in head._bound)):
            if sym.name.startswith(S.TOKEN_PREFIX):
                ns[sym.name] = torch.linspace(-1.5, 1.5, R, dtype=precision, device=z.device)[:, None]
            elif sym.name.startswith(S.VECTOR_PREFIX):
                ns[sym.name] = torch.linspace(0.5, 1.5, V, dtype=precision, device=z.device)[None, :]
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor) and name in head.kernel.SPEC.vectors:   # [V], along each row
                ns[S.VECTOR_PREFIX + name] = value.to(precision).reshape(1, V)
            elif isinstance(value, torch.Tensor) and name not in STANDARD_INPUTS:
                ns[S.TOKEN_PREFIX + name] = value.to(precision).reshape(R, 1)
        for name, value in head.scalars.items():     # weights and runtime parameters, as they are now
            ns[name] = torch.tensor(float(value), dtype=precision, device=z.device)
        # a term with class weights: each row's value times class_weight[label] (its formula as the
        # head binds it reads them as S.class_weight(term)); its mean divides by their valid sum
        class_weights = {}
        for t in head.loss_terms:
            if t.class_weight is not None:
                w = getattr(head, f"class_weight_{t.name}").detach().double().to(z.device)
                rows_w = torch.where(valid, w[y.clamp(0, V - 1)], 0.0)
                ns[S.class_weight(t.name).name] = rows_w[:, None].to(precision)
                class_weights[t.name] = float(rows_w.sum()) or 1.0   # (a sum of 0: every row is 0)
        divisor, reduction = inputs.get("divisor"), inputs.get("reduction", "mean")
        n_valid = float(valid.sum().clamp_min(1))
        normalize = {t.name: t.normalize for t in head.loss_terms}
        values, rows, per_row_loss, loss = {}, {}, z.new_zeros(R), z.new_zeros(())
        for name, formula, is_metric in head._bound:
            weight = 0.0 if is_metric else ns[weight_name(name)]
            if formula.has(S.segment_mean) and reads_rows(formula):
                # a row term of segment statistics: each row's formula with its segment's means
                seg = inputs.get("segment_ids")    # (none for batch quantiles alone: one segment)
                seg = torch.zeros(R, dtype=torch.long) if seg is None else seg.reshape(-1)
                per_row = _evaluate(_row_means(formula, ns, valid, seg), ns)
                per_row = torch.where(valid, torch.as_tensor(per_row, dtype=torch.float64).expand(R, 1)[:, 0], 0.0)
                div = 1.0 if reduction == "sum" else float(divisor) if divisor is not None else n_valid
                if normalize[name] == "sequence":   # (each row over its segment's rows: terms.bind)
                    div = 1.0 if reduction == "sum" else _num_segments(inputs.get("num_segments"), seg[valid])
                value = per_row.sum() / div
            elif formula.has(S.segment_mean):
                value = _segment_term(formula, ns, valid, inputs["segment_ids"].reshape(-1), divisor, reduction,
                                      inputs.get("num_segments") if normalize[name] == "sequence" else False)
            else:
                per_row = torch.as_tensor(_evaluate(formula, ns), dtype=torch.float64).expand(R, 1)[:, 0]
                per_row = torch.where(valid, per_row.masked_fill(no_dist, float("nan")), 0.0)
                # metrics: means over the valid rows; terms by their normalize= and the call's divisor
                div = n_valid if is_metric else 1.0 if normalize[name] == "sum" or reduction == "sum" \
                    else float(divisor) if divisor is not None else class_weights.get(name, n_valid)
                value = per_row.sum() / div
                per_row_loss = per_row_loss + weight * per_row
                rows[name] = per_row.reshape(shape)
            values[name] = value.detach()
            loss = loss + weight * value
        return x, per_row_loss.reshape(shape) if reduction == "none" else loss, values, rows


def _row_means(formula, ns, valid, seg) -> sp.Expr:
    """``formula`` with each segment_mean a per-row symbol bound in ``ns`` to the mean over the
    row's segment's valid rows (and ``segment_count`` to that segment's valid rows), in the
    reference's precision (the logits' there, ``ns["z"]``)."""
    ids = sorted(set(seg[valid].tolist()))
    sel = {s: (seg == s) & valid for s in ids}
    count = sum(torch.where(seg == s, float(sel[s].sum()), 0.0) for s in ids) if ids else torch.zeros(seg.shape[0])
    ns[S.segment_count.name] = torch.as_tensor(count, dtype=ns["z"].dtype, device=seg.device)[:, None]
    means = {}
    for k, mean in enumerate(formula.atoms(S.segment_mean)):
        u = torch.as_tensor(_evaluate(mean.args[0], ns), dtype=ns["z"].dtype).expand(seg.shape[0], 1)[:, 0]
        if isinstance(mean, S.row_quantile):   # the batch's, detached (torch.quantile, TRL's mask)
            per_row = (torch.quantile(u[valid].detach(), float(mean.args[1])) if valid.any() else u.new_zeros(())) \
                .expand(seg.shape[0])
        else:
            per_row = sum((torch.where(seg == s, u[sel[s]].mean(), 0.0) for s in ids), u.new_zeros(seg.shape[0]))
        means[mean] = sp.Symbol(f"segment_mean_{k}", real=True)
        ns[means[mean].name] = per_row[:, None]
    return formula.xreplace(means)


def _segment_term(formula, ns, valid, seg, divisor, reduction, sequence) -> torch.Tensor:
    """A term of segment means: each mean over its segment's valid rows, the formula per non-empty
    segment, summed and divided (by the non-empty segments by default). ``sequence`` (not False: a
    term with normalize="sequence", given ``num_segments`` or None): divided by every segment, the
    empty ones too (``num_segments``, else the largest valid segment id + 1), whatever the divisor."""
    ids = sorted(set(seg[valid].tolist()))
    ns[S.segment_count.name] = torch.tensor([float(((seg == s) & valid).sum()) for s in ids],
                                            dtype=ns["z"].dtype, device=seg.device)
    means = {}
    for k, mean in enumerate(formula.atoms(S.segment_mean)):
        u = torch.as_tensor(_evaluate(mean.args[0], ns), dtype=ns["z"].dtype).expand(seg.shape[0], 1)[:, 0]
        per_seg = torch.stack([u[(seg == s) & valid].mean() for s in ids]) if ids else u.new_zeros(0)
        if isinstance(mean, S.segment_sorted):   # the segments' sums, the k-th smallest at the k-th segment
            per_seg = torch.sort(per_seg * ns[S.segment_count.name], stable=True).values
        means[mean] = sp.Symbol(f"segment_mean_{k}", real=True)
        ns[means[mean].name] = per_seg
    total = torch.as_tensor(_evaluate(formula.xreplace(means), ns), dtype=ns["z"].dtype).sum()
    if sequence is not False:
        return total / (1.0 if reduction == "sum" else _num_segments(sequence, seg[valid]))
    div = float(divisor) if divisor is not None else 1.0 if reduction == "sum" else max(len(ids), 1)
    return total / div


def _num_segments(given: int | None, valid_ids: torch.Tensor) -> float:
    """A normalize="sequence" term's divisor: ``num_segments``, else the largest valid row's segment id
    plus one (an empty segment counts); at least 1."""
    n_seg = given if given is not None else (int(valid_ids.max()) + 1 if valid_ids.numel() else 0)
    return float(max(n_seg, 1))


def reference(head: HeadLoss) -> Reference:
    """The head's declared formulas in float64 torch, for parity tests (see the module's doc)."""
    return Reference(head)


# The input regimes ``random_inputs`` draws (``regime=``) and ``assert_parity`` checks (``regimes=``):
# late training's rows, drawn on purpose rather than met by chance, each against plain torch fp32.
REGIMES: dict[str, str] = {
    "randn": "logits 2*randn: no probability near 0 or 1",
    "saturated": "label logits 40 above the rest on a third of the rows (p_y rounds to 1 in fp32 and bf16) "
                 "and 120 below on another third (p_y rounds to 0)",
    "one_hot_teacher": "teacher rows one-hot (one logit 60 above the rest), near-uniform (a 1e-3 spread) and "
                       "vocabulary-masked (-inf columns)",
    "spread": "logit spreads up to 1e4 (the teacher's too)",
    "one_column": "rows whose logits are -inf at every column but the label's",
    "all_ignored": "every row ignored",
    "policy_edges": "importance ratios at the head's clip bounds (a relative 1e-4 inside or outside: at the "
                    "bound itself a step, ClipFraction's, is decided by rounding) and past exp's overflow "
                    "(old_logprobs 100 from the log-probability), advantages 0 and 1e6, ref_logprobs 100 away",
}
# the regimes assert_parity checks unless told (those that apply to a head: a teacher regime where it
# reads a teacher, the policy edges where it reads policy tokens)
DEFAULT_REGIMES = ("randn", "saturated", "one_hot_teacher", "spread", "policy_edges")


def applies(regime: str, head: HeadLoss) -> bool:
    """Whether ``regime`` draws anything for ``head`` beyond the ``randn`` rows (a teacher regime
    for a head without a teacher does not)."""
    spec = head.kernel.SPEC
    if regime not in REGIMES:
        raise ValueError(f"regimes: unknown regime {regime!r}; the regimes are {sorted(REGIMES)}")
    if regime == "one_hot_teacher":
        return spec.uses_teacher
    if regime == "policy_edges":
        return bool({"old_logprobs", "advantages", "ref_logprobs"} & set(spec.tokens))
    if regime in ("saturated", "one_column", "all_ignored"):
        return spec.uses_labels
    return True


def token_domains(head: HeadLoss) -> dict[str, tuple[float, float]]:
    """Each per-row token's range of values the head's formulas need: the domain its term declares
    (``declare_term(..., domains=)``), else ``(0.25, 4)`` for a token that divides an exponent (a
    temperature: ``lse_at(token)``, ``exp(z / token)``) or sits under a log or a fractional power,
    else no range (``randn``)."""
    out: dict[str, tuple[float, float]] = {}
    for term in head.loss_terms + head.metric_terms:
        for name, bounds in term.domains:
            out[name] = bounds
    for _, formula, _ in head._bound:
        needs_positive = set()
        for lse in formula.atoms(S.LSE):
            needs_positive |= lse.free_symbols
        for node in sp.preorder_traversal(formula):
            if isinstance(node, sp.exp) and node.args[0].has(*S.ELEMENT_SYMBOLS, *S.TOPK_SYMBOLS):
                needs_positive |= {s for s in node.args[0].free_symbols if s.name.startswith(S.TOKEN_PREFIX)
                                   and any(d.has(s) for d in (node.args[0].diff(x) for x in S.ELEMENT_SYMBOLS))}
            elif isinstance(node, sp.log) or (isinstance(node, sp.Pow) and not node.exp.is_integer):
                needs_positive |= node.args[0].free_symbols
        for s in needs_positive:
            if s.name.startswith(S.TOKEN_PREFIX):
                out.setdefault(s.name[len(S.TOKEN_PREFIX):], (0.25, 4.0))
    return out


def _clip_bounds(head: HeadLoss) -> tuple[float, float]:
    """``(eps_low, eps_high)`` of the head's first term that has them (as they are now), else 0.2."""
    for term in head.loss_terms + head.metric_terms:
        # (a metric's eps may follow another term's: terms.FromTerm, with its own fallback)
        params = {k: getattr(v, "fallback", v) for k, v in term.params}
        if "eps_high" in params:
            return float(params.get("eps_low", 0.2)), float(params["eps_high"])
    return 0.2, 0.2


def random_inputs(head: HeadLoss, rows: int = 24, vocab: int = 500, dtype: torch.dtype = torch.float32,
                  device: Any = "cpu", seed: int = 0, *, regime: str | tuple[str, ...] = "randn",
                  **given: Any) -> tuple[torch.Tensor, Any, dict]:
    """``(logits, labels, inputs)`` for everything the head reads: ignored rows, a loss_mask,
    teacher logits, per-row tokens (a ``*logprobs`` token near the logits' own log-probability, each
    other token in the domain its formula needs: ``token_domains``), top-k ids and log-probs,
    segments; drawn as ``regime`` says (``REGIMES``), or as several regimes say, each on its share
    of the rows (row ``i`` in ``regime[i % len(regime)]``). ``given`` inputs are used as they are."""
    regimes = (regime,) if isinstance(regime, str) else tuple(regime)
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown or not regimes:
        raise ValueError(f"regime: unknown regime(s) {unknown}; the regimes are {sorted(REGIMES)}")
    spec = head.kernel.SPEC
    g = torch.Generator(device=device).manual_seed(seed)
    share = torch.arange(rows, device=device) % len(regimes)
    on = {r: (share == i) & (r != "randn") for i, r in enumerate(regimes)}

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def thirds(rows_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        third = torch.randint(0, 3, (rows,), generator=g, device=device)
        return rows_of & (third == 0), rows_of & (third == 1)
    spread = torch.where(on.get("spread", torch.zeros_like(share, dtype=torch.bool)), 800.0, 1.0)[:, None]
    logits = randn(rows, vocab) * 2 * spread
    labels = given.pop("labels", None)
    if labels is None and spec.uses_labels:
        labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
        labels[torch.rand(rows, generator=g, device=device) < 0.15] = head.ignore_index
        if "all_ignored" in on:
            labels[on["all_ignored"]] = head.ignore_index
    target = (labels if labels is not None else torch.zeros(rows, dtype=torch.long, device=device))
    at = target.clamp(0, vocab - 1)[:, None]
    if "saturated" in on:    # p_y rounding to 1 (40 above the rest) and to 0 (120 below)
        high, low = thirds(on["saturated"])
        row_max, row_min = logits.amax(-1, keepdim=True), logits.amin(-1, keepdim=True)
        label_logit = torch.where(high[:, None], row_max + 40, torch.where(low[:, None], row_min - 120,
                                                                          logits.gather(1, at)))
        logits = logits.scatter(1, at, label_logit)
    if "one_column" in on:
        alone = torch.full_like(logits, float("-inf")).scatter(1, at, logits.gather(1, at))
        logits = torch.where(on["one_column"][:, None], alone, logits)
    logits = logits.to(dtype)
    inputs = {"loss_mask": torch.rand(rows, generator=g, device=device) > 0.1}
    if spec.uses_teacher:
        teacher = randn(rows, vocab) * 2 * spread + 0.5 * logits.float()
        if "one_hot_teacher" in on:
            one_hot, uniform = thirds(on["one_hot_teacher"])
            peak = torch.randint(0, vocab, (rows, 1), generator=g, device=device)
            hot = teacher.scatter(1, peak, teacher.amax(-1, keepdim=True) + 60)
            flat = 1e-3 * randn(rows, vocab)
            # the rest of its rows: a random half of the columns masked to -inf (the peak kept)
            masked = teacher.masked_fill(torch.rand(rows, vocab, generator=g, device=device) < 0.5, float("-inf"))
            masked = masked.scatter(1, peak, hot.gather(1, peak))
            teacher = torch.where(one_hot[:, None], hot, torch.where(uniform[:, None], flat, torch.where(
                on["one_hot_teacher"][:, None], masked, teacher)))
        inputs["teacher_logits"] = teacher.to(dtype)
    if spec.uses_topk:
        K = min(8, vocab)
        inputs["teacher_topk_ids"] = torch.rand(rows, vocab, generator=g, device=device).argsort(-1)[:, :K]
        inputs["teacher_topk_logprobs"] = torch.log_softmax(randn(rows, K + 2), -1)[:, :K]
    logp = torch.log_softmax(logits.double(), -1).gather(1, at)[:, 0]
    domains = token_domains(head)
    for name in spec.tokens:
        if name in head.class_weight_tokens:    # (the head's own: its class weights at the labels)
            continue
        noise = randn(rows, dtype=torch.float64)
        if name.endswith("logprobs"):
            value = logp + 0.2 * noise
        elif name in domains:
            lo, hi = domains[name]
            value = lo + (hi - lo) * torch.rand(rows, generator=g, device=device, dtype=torch.float64)
        else:
            value = noise
        if "policy_edges" in on and name in ("old_logprobs", "ref_logprobs", "advantages"):
            first, second = thirds(on["policy_edges"])
            if name == "old_logprobs":     # r at a clip bound, either side of it, else e^{+-100}
                low, high = _clip_bounds(head)
                side = 1 + 1e-4 * torch.where(torch.rand(rows, generator=g, device=device) < 0.5, 1.0, -1.0)
                edge = logp - torch.log(torch.where(noise > 0, 1 + high, 1 - low) * side)
                value = torch.where(first, edge, torch.where(second, logp - 100 * noise.sign(), value))
            elif name == "ref_logprobs":
                value = torch.where(first, logp + 100 * noise.sign(), value)
            else:
                value = torch.where(first, 0.0, torch.where(second, 1e6 * noise.sign(), value))
        inputs[name] = value.float()
    for name in spec.vectors:
        inputs[name] = torch.rand(vocab, generator=g, device=device) + 0.5
    if spec.segments:
        n_seg = max(rows // 6, 1)
        inputs["segment_ids"] = torch.sort(torch.randint(0, n_seg, (rows,), generator=g, device=device)).values
        inputs["num_segments"] = n_seg
    inputs.update(given)
    return logits, labels, inputs


def _worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, tuple[int, ...], float, float]:
    """(largest |got - want|, where, got there, want there); NaN counts as the worst."""
    got, want = got.detach().double().cpu().reshape(want.shape), want.double().cpu()
    err = (got - want).abs().nan_to_num(float("inf"))
    if err.dim() == 0:
        return float(err), (), float(got), float(want)
    at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return float(err[at]), at, float(got[at]), float(want[at])


def assert_parity(head: HeadLoss, rows: int = 24, vocab: int = 500,
                  dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), device: Any = None,
                  seed: int = 0, *, regimes: tuple[str, ...] = DEFAULT_REGIMES, **inputs: Any) -> None:
    """Run ``head`` on random inputs (``inputs`` given are used as they are) in each dtype, the rows
    drawn in ``regimes`` (``REGIMES``: saturated labels, one-hot teachers, large spreads, ...; those
    that apply to the head, each on its share of the rows), on the GPU when there is one, and compare
    its loss, terms, metrics and gradient with ``reference(head)`` in float64, plain torch's fp32
    evaluation of the same formulas as the yardstick (``compare``). Raises ``AssertionError`` naming
    the regime that fails (each is then checked alone), the output, the worst element and the bound."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(regimes, str) or not all(isinstance(r, str) for r in regimes):
        raise TypeError(f"regimes must be a tuple of regime names (of {sorted(REGIMES)}), got {regimes!r}")
    drawn = tuple(r for r in regimes if applies(r, head)) or ("randn",)
    for dtype in dtypes:
        try:
            _check_parity(head, rows, vocab, dtype, device, seed, drawn, inputs)
        except AssertionError:
            if len(drawn) == 1:
                raise
            for regime in drawn:   # the regime that fails, by itself
                _check_parity(head, rows, vocab, dtype, device, seed, (regime,), inputs)
            raise


def _check_parity(head: HeadLoss, rows: int, vocab: int, dtype: torch.dtype, device: Any, seed: int,
                  regimes: tuple[str, ...], inputs: dict) -> None:
    logits, labels, kw = random_inputs(head, rows, vocab, dtype, device, seed, regime=regimes, **inputs)
    x = logits.clone().requires_grad_()
    out = head(x, labels, **kw)
    if head.loss_terms:
        out.loss.sum().backward()
    ref = reference(head)
    ref_kw = {name: (v.cpu() if isinstance(v, torch.Tensor) else v) for name, v in kw.items()}
    cpu_labels = None if labels is None else labels.cpu()
    want_loss, want, want_grad = ref(logits.cpu(), cpu_labels, **ref_kw)
    plain_loss, plain, plain_grad = ref(logits.cpu(), cpu_labels, precision=torch.float32, **ref_kw)
    named = regimes[0] if len(regimes) == 1 else "+".join(regimes)
    where = f"(regime {named!r}, {dtype}, {rows} x {vocab}, seed {seed})"
    for name, got, expected, yardstick in [("loss", out.loss, want_loss, plain_loss)] + [
            (n, v, want[n], plain[n]) for n, v in {**out.terms, **out.metrics}.items()]:
        compare(name, got, expected, dtype, where=where, plain=yardstick)
    if head.loss_terms:
        compare("gradient", x.grad, want_grad, dtype, where=where, plain=plain_grad,
                floor=gradient_floor(want_loss))


def gradient_floor(loss: torch.Tensor) -> float:
    """The error a gradient that cancels to (nearly) 0 may carry: fp32 rounding of the loss's own
    scale, which its parts have (``c * vsum(softmax)``: each part of size c, their sum 0)."""
    return 2.0**-20 * max(1.0, float(loss.detach().abs().max()) if loss.numel() else 0.0)


# How much further from float64 than plain torch's fp32 evaluation of the same formula a result may
# be, where it is outside the dtype's tolerance (the contract's oracle: docs/api.md, "Numerics")
PEER_FACTOR = 4.0


def compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, *,
            tolerances: tuple[float, float, float] | None = None, where: str = "",
            plain: torch.Tensor | None = None, floor: float = 1e-9) -> None:
    """The one comparison of a head's output with a float64 reference (``assert_parity``, the fuzzer
    and the project's own tests): a value within ``atol + rtol * max|want|``, the gradient (``name``
    starting with "gradient") within ``grad_tol * max|want|``, ``TOLERANCES[dtype]`` unless given,
    or within ``floor`` where the whole gradient is below it (one that cancels to 0 is held to the
    rounding of its parts: ``gradient_floor``).

    ``plain``: the same output computed by plain torch in fp32 (``Reference.evaluate(precision=
    torch.float32)``), the oracle: wherever it is finite, ``got`` must be finite too, and no further
    from ``want`` than the bound or ``PEER_FACTOR`` times plain torch's own largest error (a formula
    whose value or derivative cancels in any fp32 evaluation is held to torch's digits); where plain
    torch is not finite, ``got`` is held to the bound (a gradient: plus ``floor``). Elements
    where the float64 reference is not finite are then not compared. Raises ``AssertionError``
    naming the output, the worst element and the bound."""
    rtol, atol, grad_tol = tolerances or TOLERANCES[dtype]
    want = want.double().cpu()
    got = got.detach().double().cpu().reshape(want.shape)
    compared = torch.isfinite(want) if plain is not None else torch.ones_like(want, dtype=torch.bool)
    scale = float(want[compared].abs().max()) if compared.any() else 0.0
    bound = max(grad_tol * scale + 1e-9, floor if scale < floor else 0.0) if name.startswith("gradient") \
        else atol + rtol * scale
    plain_note = ""
    if plain is not None:
        plain = plain.detach().double().cpu().reshape(want.shape)
        lost = torch.isfinite(plain) & ~torch.isfinite(got)
        if lost.any():
            at = tuple(int(i) for i in lost.nonzero()[0])
            raise AssertionError(f"{name} {where}{' at ' + str(at) if at else ''}: {float(got[at]):.6g} where plain "
                                 f"torch fp32 gives {float(plain[at]):.6g} (float64: {float(want[at]):.6g})")
        yardstick = compared & torch.isfinite(plain)
        plain_err = float((plain - want)[yardstick].abs().max()) if yardstick.any() else 0.0
        plain_note = f"; plain torch fp32's error {plain_err:.3g}"
        # (where plain torch is not finite, the float64 value is the project's own convention: held to
        # the bound alone)
        err_plain = (got - want).abs().nan_to_num(float("inf")).masked_fill(~yardstick, 0.0)
        # (where plain torch is not finite either, a non-finite result is on par with it)
        err_own = (got - want).abs().nan_to_num(float("inf")).masked_fill(
            yardstick | ~compared | ~torch.isfinite(got), 0.0)
        # (and a finite gradient there is held to the bound plus the rounding of its parts, ``floor``:
        # plain torch, which would be the yardstick of a cancellation, has no value there; JSD at
        # temperature 0.05, whose row gradient of 1.8e-5 cancels parts of 7, found by the fuzzer)
        own_bound = bound + floor if name.startswith("gradient") else bound
        worst = max(float(err_plain.max()) if err_plain.numel() else 0.0, 0.0)
        if worst <= max(bound, PEER_FACTOR * plain_err) and not (err_own > own_bound).any():
            return
    err, at, got_at, want_at = _worst(got.masked_fill(~compared, 0.0), want.masked_fill(~compared, 0.0))
    if not err <= bound or plain is not None:
        raise AssertionError(f"{name} {where}{' at ' + str(at) if at else ''}: {got_at:.6g} against the "
                             f"float64 reference {want_at:.6g}, error {err:.3g} > {bound:.3g}{plain_note}")
