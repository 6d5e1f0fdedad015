"""Stage 1b, declare: loss terms as sympy formulas.

Every built-in below is one formula; the gradient of each is derived later by sympy (lower.py).
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import sympy as sp
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import BooleanAtom

from . import symbols as S
from .interface import weight_name


@dataclass(frozen=True)
class FromTerm:
    """A parameter default taken from another term of the same head (e.g. ClipFraction's eps from GRPO)."""

    term: str
    fallback: float


NORMALIZE = ("tokens", "sequence", "sum")


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (told apart without importing torch: the compiler's
    stages do not)."""
    return hasattr(value, "is_floating_point") and hasattr(value, "dim")


def _check_value(term: str, what: str, value: Any, *, unbounded: bool = False) -> Any:
    """A weight or parameter: a number, a bool (a 0/1 switch: ``kl_bias_correction=True``), or a
    0-dim float tensor (read by the kernel at each call); returned as a float or the tensor. It must
    be finite, but where ``unbounded`` (a clamp's bound, where +-inf is no bound). A tensor's value is
    looked at once, here (the head's construction waits for it once anyway: ``_sign``); a later
    in-place update to inf or NaN is computed as IEEE arithmetic would."""
    if is_tensor(value):
        if value.dim() != 0 or not value.is_floating_point():
            raise TypeError(f"{term}: {what} as a tensor must be a 0-dim float tensor, got shape "
                            f"{tuple(value.shape)} {value.dtype}")
        number = float(value.detach())
    elif isinstance(value, (int, float)):
        number = value = float(value)
    else:
        raise TypeError(f"{term}: {what} must be a number, a bool or a 0-dim float tensor, got {value!r}")
    if math.isnan(number) or (math.isinf(number) and not unbounded):
        allowed = " (an infinite value is accepted only for a clamp's bound)" \
            if math.isinf(number) and what != "weight" else ""
        raise ValueError(f"{term}: {what} must be finite, got {number}{allowed}")
    return value


def _bounds(formula: sp.Expr) -> set[str]:
    """The parameters that stand alone as a clamp's bound (GRPO's ``delta``), where an infinite value
    means no bound and folds away (``_number``); anywhere else an infinite parameter would make the
    formula inf*0 or inf-inf somewhere, so it is refused."""
    occurrences: dict[str, list[bool]] = {}
    for node in sp.preorder_traversal(formula):
        for i, arg in enumerate(node.args):
            if isinstance(arg, sp.Symbol) and arg.name.startswith(S.PARAM_PREFIX):
                occurrences.setdefault(arg.name[len(S.PARAM_PREFIX):], []).append(
                    isinstance(node, S.clamp) and i > 0)
    return {name for name, places in occurrences.items() if all(places)}


@dataclass(frozen=True, eq=False)
class Term:
    """One term of a head: a name, a row-level formula, its parameters' values, a weight, and how
    its rows are normalised (``normalize``). A weight or a parameter value may be a number or a
    0-dim float tensor: both are kernel arguments (docs/api.md: runtime parameters)."""

    name: str
    formula: sp.Expr
    weight: Any = 1.0                     # a number or a 0-dim float tensor
    params: tuple[tuple[str, Any], ...] = ()
    metric_only: bool = False
    normalize: str = "tokens"             # "tokens" | "sequence" | "sum" (NORMALIZE)
    class_weight: Any = None              # a [V] float tensor: each row's value times class_weight[label]
    domains: tuple[tuple[str, tuple[float, float]], ...] = ()   # declare_term's, for parity tests' inputs

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params)
        norm = "" if self.normalize == "tokens" else f", normalize={self.normalize!r}"
        cw = "" if self.class_weight is None else f", class_weight=[{self.class_weight.shape[0]}]"
        return f"{self.name}({args}; weight={self.weight!r}{norm}{cw}): {self.formula}"


# Options of peers' losses (Liger, flash-attn, torch, TRL) that a term does not take, and where
# each goes here: named in the error of a term given one (docs/coming-from.md).
_ELSEWHERE = {
    "lse_square_scale": "the z-loss's scale is its term's weight: ZLoss(weight=...)",
    "softcap": "the softcap is the head's: HeadLoss(..., softcap=...)",
    "logit_scale": "the logits' scale is the head's: HeadLoss(..., logit_scale=...)",
    "ignore_index": "the ignored label is the head's: HeadLoss(..., ignore_index=...)",
    "reduction": "the reduction is the call's: head(logits, labels, reduction=...)",
    "temperature": "this term takes none; logits divided by T are the head's logit_scale: "
                   "HeadLoss(..., logit_scale=1 / T)",
    "ce_weight": "per-class weights are CrossEntropy(class_weight=...)",
    "label_smoothing": "label smoothing is CrossEntropy's: CrossEntropy(label_smoothing=...)",
}


@dataclass(frozen=True)
class TermFactory:
    """What ``declare_term`` returns: call it with ``weight=``, ``normalize=`` and the term's parameters."""

    name: str
    formula: sp.Expr
    defaults: Mapping[str, Any] = field(default_factory=dict)
    metric_only: bool = False
    domains: tuple[tuple[str, tuple[float, float]], ...] = ()

    def __call__(self, *positional: Any, weight: Any = 1.0, normalize: str = "tokens",
                 class_weight: Any = None, **params: Any) -> Term:
        if positional:
            self._refuse_positional(positional)
        unknown = set(params) - set(self.defaults) - self._param_names()
        if unknown:
            takes = [*sorted(self._param_names()), "weight", "normalize", "class_weight"]
            raise TypeError(f"{self.name}: unknown parameter(s) {sorted(unknown)}; it takes "
                            + ", ".join(f"{k}=" for k in takes)
                            + "".join(f"; {k}=: {_ELSEWHERE[k]}" for k in sorted(unknown) if k in _ELSEWHERE))
        weight = _check_value(self.name, "weight", weight)
        if normalize not in NORMALIZE:
            raise ValueError(f"{self.name}: normalize must be one of {NORMALIZE}, got {normalize!r}")
        if normalize != "tokens" and self.formula.has(S.segment_mean):
            self._check_statistics_normalize(normalize)
        if class_weight is not None:
            self._check_class_weight(class_weight, normalize)
        values = {**self.defaults, **params}
        missing = self._param_names() - set(values)
        if missing:
            raise TypeError(f"{self.name}: missing parameter(s) {sorted(missing)}")
        bounds = _bounds(self.formula)
        for k, v in values.items():
            if isinstance(v, FromTerm):
                continue
            v = values[k] = _check_value(self.name, f"parameter {k}", v, unbounded=k in bounds)
            if is_tensor(v) and v.requires_grad:
                raise ValueError(f"{self.name}: parameter {k} is a tensor that requires grad, but a parameter "
                                 "inside a formula gets no gradient (only a term's weight does): pass it "
                                 ".detach(), or make the learnable factor a term's weight")
        # (a tensor temperature's value as the term is built, read once as its sign is: a schedule keeps it > 0)
        temperatures = {s for lse in self.formula.atoms(S.LSE) for s in lse.free_symbols}
        numbers = {S.param(k): _number(v) for k, v in values.items()
                   if not isinstance(v, FromTerm) and (not is_tensor(v) or S.param(k) in temperatures)}
        for lse in _limit_form(self.formula).xreplace(numbers).atoms(S.LSE):
            if any(a.is_number and not (a.is_finite and a.is_extended_real and a >= 0) for a in lse.args) \
                    or all(a == 0 for a in lse.args):
                raise ValueError(f"{self.name}: a temperature must be > 0 (got {lse}, from {params})")
        return Term(self.name, self.formula, weight, tuple(sorted(values.items())), self.metric_only,
                    normalize, class_weight, self.domains)

    def _refuse_positional(self, positional: tuple[Any, ...]) -> None:
        """Options are keyword-only: ``CrossEntropy(0.1)`` read as ``weight=0.1`` would be a silently
        different loss from the label smoothing its writer may have meant."""
        public = next((n for n, v in globals().items() if v is self), self.name)
        names = ["weight", *self.defaults, *sorted(self._param_names() - set(self.defaults))]
        raise TypeError(f"{public} takes its options by keyword: {', '.join(f'{n}=...' for n in names)} "
                        f"(also normalize=..., class_weight=...); got positional {positional!r}")

    def _check_statistics_normalize(self, normalize: str) -> None:
        """A formula of segment statistics takes ``normalize="sequence"`` (the mean over the segments of
        each one's mean over its valid rows: ``bind``); ``"sum"`` it does not take, and a row term of
        batch quantiles alone is not one of segments (the call may give no ``segment_ids``: one segment)."""
        if normalize == "sum":
            raise ValueError(f"{self.name}: a term of segment statistics is divided by its segments (a "
                             "segment term) or as a row term is (divisor= or the valid rows); it takes "
                             "normalize='tokens' or 'sequence', not 'sum' (reduction='sum' drops the division)")
        if all(isinstance(m, S.row_quantile) for m in self.formula.atoms(S.segment_mean)):
            raise ValueError(f"{self.name}: normalize='sequence' averages each segment's rows, and this term "
                             "reads batch quantiles (S.row_quantile) alone, no segment statistic: a head of "
                             "them takes no segment_ids (its rows are one segment); it takes normalize='tokens'")

    def _check_class_weight(self, class_weight: Any, normalize: str) -> None:
        """``class_weight``: a [V] float tensor of finite, non-negative values (looked at once, here:
        the one wait for the device it costs), for a loss term of rows that reads the labels."""
        where = f"{self.name}: class_weight"
        if not is_tensor(class_weight):
            raise TypeError(f"{where} must be a 1-D float tensor of one weight per class, got "
                            f"{type(class_weight).__name__}")
        if class_weight.dim() != 1 or class_weight.shape[0] == 0 or not class_weight.is_floating_point():
            raise TypeError(f"{where} must be a 1-D float tensor of one weight per class, got shape "
                            f"{tuple(class_weight.shape)} {class_weight.dtype}")
        if class_weight.requires_grad:
            raise ValueError(f"{where} requires grad, but no gradient flows to it: pass "
                             "class_weight.detach()")
        if not bool(class_weight.isfinite().all()) or not bool((class_weight >= 0).all()):
            raise ValueError(f"{where} must be finite and >= 0 (the mean divides by the valid rows' "
                             "sum of it); got a negative, NaN or infinite weight")
        if self.metric_only:
            raise ValueError(f"{where}: {self.name} is a metric (a mean over the valid rows), which "
                             "takes no class weights")
        if normalize == "sequence":
            raise ValueError(f"{where} weighs rows by their label, normalised by the sum of those "
                             "weights: it takes normalize='tokens' or 'sum', not 'sequence'")
        if self.formula.has(S.segment_mean) or not self.formula.has(S.target_logit, S.label):
            raise ValueError(f"{where} weighs each row by its label's class: {self.name} is not a "
                             "row term that reads the labels")

    def _param_names(self) -> set[str]:
        return {s.name[len(S.PARAM_PREFIX):] for s in self.formula.free_symbols
                if s.name.startswith(S.PARAM_PREFIX)}

    def __repr__(self) -> str:
        return f"<term {self.name}: {self.formula}>"


def declare_term(name: str, formula: sp.Expr, *, defaults: Mapping[str, Any] | None = None,
                 metric_only: bool = False,
                 domains: Mapping[str, tuple[float, float]] | None = None) -> TermFactory:
    """Declare a per-token loss term from its formula. Returns a factory: ``Term = declare_term(...)``,
    then ``Term(weight=..., param=...)`` in a ``HeadLoss``. Anything the code generator cannot
    compute where it stands is refused here, naming it (docs/api.md, "What is refused").
    ``domains``: the range ``(low, high)`` of a per-row token's values the formula is meant for,
    which ``losscodegen.testing`` draws it from (otherwise inferred: ``testing.token_domains``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"term name must be an identifier, got {name!r}")
    formula = sp.sympify(formula)
    if not isinstance(formula, sp.Expr):
        raise TypeError(f"{name}: formula must be a sympy expression, got {type(formula).__name__}")
    _check_constructs(name, formula)
    _check_symbols(name, formula)
    _check_levels(name, formula)
    S.check_exponentials(name, formula)
    if metric_only:
        check_metric(name, formula)
    # (the package's own terms, built-ins and integrations', are checked in every regime by its tests,
    # not lowered again at each declaration)
    if not sys._getframe(1).f_globals.get("__name__", "").startswith(__package__ + "."):
        _warn_unsafe(name, formula)
    return TermFactory(name, formula, dict(defaults or {}), metric_only, _domains(name, formula, domains or {}))


def _warn_unsafe(name: str, formula: sp.Expr) -> None:
    """A warning naming each quotient of the term's derived forms that the compiler could not make
    safe (0/0 on a finite row: stable.numerics_report), from the term lowered alone with its
    parameters as run-time values. A formula that does not lower alone is left to the head, which
    refuses it naming why."""
    import warnings

    from .lower import lower
    from .stable import numerics_report
    params = {s: S.runtime(name, s.name[len(S.PARAM_PREFIX):]) for s in formula.free_symbols
              if s.name.startswith(S.PARAM_PREFIX)}
    try:
        report = numerics_report(lower(((name, formula.xreplace(params), False),)))
    except Exception:   # (refused at the head, with its message)
        return
    for line in report:
        warnings.warn(f"{name}: {line}; rewrite that part (docs/adding-a-loss.md, 'Numerics')", stacklevel=3)


def _domains(name: str, formula: sp.Expr, domains: Mapping[str, tuple[float, float]]):
    """``declare_term``'s ``domains``, checked: each a token of the formula and a finite ``low < high``."""
    tokens = {s.name[len(S.TOKEN_PREFIX):] for s in formula.free_symbols if s.name.startswith(S.TOKEN_PREFIX)}
    out = []
    for token, bounds in sorted(domains.items()):
        if token not in tokens:
            raise ValueError(f"{name}: domains names {token!r}, which is no token of the formula "
                             f"(its tokens: {sorted(tokens)})")
        try:
            low, high = (float(b) for b in bounds)
        except (TypeError, ValueError):
            raise TypeError(f"{name}: domains[{token!r}] must be a pair (low, high), got {bounds!r}") from None
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"{name}: domains[{token!r}] must be finite with low < high, got {bounds!r}")
        out.append((token, (low, high)))
    return tuple(out)


def check_metric(name: str, formula: sp.Expr) -> None:
    """A metric is a mean of per-row values, each taken as its row is read; a batch or segment
    statistic is known only once every row of the batch or segment has been read (the segment step),
    so a formula that reads one is refused as a metric, here (a metric_only term) or by the head
    (a term passed in ``metrics=``), naming what the formula reads."""
    how = "pass the term in the head's terms with weight=0.0 to log it"
    if formula.has(S.row_quantile):
        raise ValueError(f"{name}: a row quantile (S.row_quantile, GRPO's top_entropy_quantile) cannot be a "
                         "metric: a metric is a mean of per-row values taken as the rows are read, and the "
                         f"quantile is known only once every valid row of the call has been; {how}")
    if formula.has(S.segment_mean):
        raise ValueError(f"{name}: a segment term cannot be a metric: it reads segment statistics "
                         "(segment_mean, segment_sum, segment_sorted), known only once every row of the "
                         f"segments has been read, and a metric is a mean of per-row values; {how}")


# what a formula may be made of besides S.FUNCTIONS and the constructs of losscodegen.symbols
_STRUCTURE = (sp.Add, sp.Mul, sp.Pow, sp.Symbol, ExprCondPair, Relational, sp.And, sp.Or, sp.Not, sp.ITE,
              BooleanAtom)
_SUPPORTED = (f"the functions {', '.join(f.__name__ for f in S.FUNCTIONS)}; +, -, *, / and powers "
              "(sqrt included); relations with And/Or/Not in Piecewise; finite constants; and "
              "losscodegen.symbols' own (vsum, topk_sum, segment_mean, lse_at, ...)")
# the keywords a term factory takes itself: a parameter of that name could never be set
_FACTORY_KEYWORDS = tuple(p.name for p in inspect.signature(TermFactory.__call__).parameters.values()
                          if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                          and p.name != "self")
# the head's own call arguments and keywords: a per-row token of that name could never be passed
_CALL_NAMES = S.CALL_ARGUMENTS + S.STANDARD_INPUTS


def _check_constructs(name: str, formula: sp.Expr) -> None:
    """Every node is one the printers print correctly (and sympy differentiates into such nodes)."""
    for node in sp.preorder_traversal(formula):
        if isinstance(node, (sp.Number, sp.NumberSymbol)):
            if not (node.is_finite and node.is_extended_real):
                raise ValueError(f"{name}: the constant {node} is not supported (constants must be "
                                 f"finite real numbers): {formula}")
        elif not (isinstance(node, _STRUCTURE + S.FUNCTIONS) or type(node).__module__ == S.__name__):
            what = type(node).__name__
            raise ValueError(f"{name}: {what} ({node}) is not supported in a formula; supported: "
                             f"{_SUPPORTED}")


def _check_symbols(name: str, formula: sp.Expr) -> None:
    """Symbols come from losscodegen.symbols: token and param names free of the head's own names."""
    known = set(S.ELEMENT_SYMBOLS + S.TOPK_SYMBOLS + S.ROW_SYMBOLS + S.SEGMENT_SYMBOLS)
    for sym in sorted(formula.free_symbols - known, key=str):
        for prefix, make, taken, where in (
                (S.TOKEN_PREFIX, S.token, _CALL_NAMES, "an argument or keyword of the head's call"),
                (S.PARAM_PREFIX, S.param, tuple(dict.fromkeys(_FACTORY_KEYWORDS + _CALL_NAMES)),
                 "a keyword of the term factory or an argument or keyword of the head's call"),
                (S.VECTOR_PREFIX, S.vector, _CALL_NAMES, "an argument or keyword of the head's call")):
            short = sym.name[len(prefix):]
            if sym.name.startswith(prefix) and short.isidentifier() and sym == make(short):
                if short in taken:
                    raise ValueError(f"{name}: {make.__name__}({short!r}) clashes with {where} "
                                     f"(names taken: {', '.join(taken)}); choose another name")
                if make is S.token and short.startswith(S.CLASS_WEIGHT_PREFIX):
                    raise ValueError(f"{name}: token names starting with {S.CLASS_WEIGHT_PREFIX!r} are "
                                     "the head's own (a term's class weight at the label); choose another name")
                break
        else:
            raise ValueError(
                f"{name}: unknown symbol {sym} (a raw sympy Symbol?): formulas are written in "
                f"losscodegen.symbols' own symbols ({', '.join(str(s) for s in sorted(known, key=str))}), "
                f"S.token(name) for a per-row input and S.param(name) for a constant")


def _check_levels(name: str, formula: sp.Expr) -> None:
    """Element symbols live inside their own reduction; reductions do not nest; a log-normaliser's
    coefficients are numbers or params."""
    reductions = (S.vsum, S.topk_sum, S.segment_mean)
    for red in formula.atoms(*reductions):
        inner = red.args[0]
        # one level of vsum inside vsum (LogitNorm's ||z|| inside its softmax): the inner sum is
        # read first, the outer one in a second read (lower.py checks the inner one is a first-read sum)
        if isinstance(red, S.vsum) and not inner.has(S.topk_sum, S.segment_mean) and not any(
                r.args[0].has(*reductions) or r.has(S.row_max) for r in inner.atoms(S.vsum)):
            continue
        # a segment mean of a row quantity, a vocabulary or top-k sum included (the mean entropy)
        if isinstance(red, S.segment_mean) and not inner.has(S.segment_mean):
            continue
        if inner.has(*reductions):
            raise ValueError(f"{name}: nested reductions are not supported beyond a vsum(...) of the first "
                             f"read inside another vsum(...): {red}")
    # (each sum as a symbol, not 0: log(vsum(...)) would be zoo, which a Max beside it cannot compare)
    outside = formula.replace(lambda e: isinstance(e, (S.vsum, S.topk_sum)), lambda e: sp.Dummy(real=True))
    vectors = tuple(S.vectors_in(formula))
    for sym, where in ((S.ELEMENT_SYMBOLS + vectors, "vsum(...)"), (S.TOPK_SYMBOLS, "topk_sum(...)")):
        if outside.has(*sym):
            # (sympy folds a Piecewise inside a sum out of it where the sum sits in a condition:
            # Piecewise((a, vsum(Piecewise((p, u > 0), (q, True))) > 0), ...) becomes ITE(u > 0, ...))
            hoisted = " (sympy moved a condition on an element out of its sum, as it does where the sum is " \
                "compared in a Piecewise condition: give the sum's condition as a factor, e.g. " \
                "S.Heaviside(u) * p + (1 - S.Heaviside(u)) * q, or compare a separate term's value)" \
                if formula.has(sp.ITE) else ""
            raise ValueError(f"{name}: element symbols {[str(s) for s in sym]} may only appear "
                             f"inside {where}: {formula}{hoisted}")
    for red, other, where in ((S.vsum, S.TOPK_SYMBOLS, "topk_sum(...)"),
                              (S.topk_sum, S.ELEMENT_SYMBOLS + vectors, "vsum(...)")):
        for r in formula.atoms(red):
            if r.has(*other):
                raise ValueError(f"{name}: {[str(s) for s in other]} may only appear inside {where}, "
                                 f"not inside {red.__name__}(...): {r}")

    if formula.has(*S.SEGMENT_SYMBOLS):
        inside = [r for r in formula.atoms(*reductions) if r.has(*S.SEGMENT_SYMBOLS)]
        if inside or not formula.has(S.segment_mean):
            raise ValueError(f"{name}: segment_count (a segment's valid rows) belongs to a term of "
                             f"segment_mean(...)/segment_sum(...), outside them and outside vsum(...); for "
                             f"a row term averaged over its sequence write normalize='sequence'"
                             f"{f' ({inside[0]})' if inside else ''}")
    for lse in formula.atoms(S.LSE):
        if any(not s.name.startswith((S.PARAM_PREFIX, S.TOKEN_PREFIX)) for s in lse.free_symbols):
            raise ValueError(f"{name}: a log-normaliser's temperature must be a number, a param or a "
                             f"token, got {lse}")


def planned_params(formula: sp.Expr) -> set[str]:
    """The parameters that decide the plan, which the kernel keeps as numbers when given one: those
    inside a log-normaliser (a temperature: ``lse_at(T)`` is read as its own sum) or in the exponent
    of an element-level ``exp`` (which decides whether a sum is kept online). Given a tensor, such a
    parameter is a kernel argument like any other, and its sums are read relative to the row maxima
    in a read after the stats (stable.run_time_temperatures)."""
    found: set[sp.Symbol] = set()
    for lse in formula.atoms(S.LSE):
        found |= lse.free_symbols
    for e in formula.atoms(sp.exp):
        if e.args[0].has(*S.ELEMENT_SYMBOLS, *S.TOPK_SYMBOLS):
            found |= e.args[0].free_symbols
    return {s.name[len(S.PARAM_PREFIX):] for s in found if s.name.startswith(S.PARAM_PREFIX)}


def _owner(term: Term, key: str, head_terms: tuple[Term, ...]) -> tuple[Term, Any]:
    """(the term whose value a parameter takes, that value): a FromTerm default is the named term's
    own parameter (so it follows that one, a tensor included), else its fallback."""
    value = dict(term.params)[key]
    if isinstance(value, FromTerm):
        source = next((t for t in head_terms if t.name == value.term), None)
        if source is not None and key in dict(source.params):
            return _owner(source, key, head_terms)
        return term, value.fallback
    return term, value


def _runtime(term: Term, key: str, value: Any) -> bool:
    """Whether a parameter is a kernel argument: a tensor, or a number that does not decide the plan
    and is not 0 or infinite, which are folded (0 often removes a term and what it reads: GRPO's kl_beta=0
    reads no ref_logprobs, CrossEntropy's label_smoothing=0 no sum of the logits; an infinite bound
    is dropped: GRPO's delta=inf)."""
    return is_tensor(value) or (key not in planned_params(term.formula) and math.isfinite(float(value))
                                and float(value) != 0)


def _sign(value: Any) -> int:
    """A runtime parameter's sign when the head is built, which its kernel assumes (a tensor's value
    is read once, here: a schedule keeps a parameter's sign)."""
    number = float(value)
    return (number > 0) - (number < 0)


def bind(term: Term, head_terms: tuple[Term, ...]) -> sp.Expr:
    """The term's formula as the kernel computes it: each runtime parameter a symbol the kernel
    reads from its scalars (``S.runtime``, named after the term that owns the value), the others
    substituted as numbers; a term with ``normalize="sequence"`` becomes the mean over its segment (a
    row term of segment statistics its value over its segment's valid rows).
    A parameter's value (a tensor's, as it is now) where the formula is undefined is refused
    (``_check_defined``); a division by a parameter that a product cancels is cancelled first, so
    that the formula has its limit there (``_limit_form``)."""
    values, numbers = {}, {}
    formula = _limit_form(term.formula)
    for key, _ in term.params:
        owner, value = _owner(term, key, head_terms)
        values[S.param(key)] = S.runtime(owner.name, key, _sign(value)) if _runtime(owner, key, value) \
            else _number(value)
        numbers[S.param(key)] = (key, value, _number(value))
    _check_defined(term.name, formula, numbers)
    formula = formula.xreplace(values)
    if term.class_weight is not None:
        formula = S.class_weight(term.name) * formula
    if term.normalize != "sequence":
        return formula
    if not formula.has(S.segment_mean):
        return S.segment_mean(formula)
    # a row term of segment statistics: each valid row's value over its segment's valid rows, so that
    # the rows' sum is the sum of the segments' means (the kernel then divides by the segments); a
    # formula of segment statistics alone is the same on every row of its segment: its mean already
    return formula / S.segment_count if reads_rows(formula) else formula


def reads_rows(formula: sp.Expr) -> bool:
    """Whether a formula of segment statistics reads row quantities outside them (GSPO-token): a row
    term of segment statistics, evaluated row by row (lower.SegmentTerm's ``rows``)."""
    outside = formula.replace(lambda e: isinstance(e, S.segment_mean), lambda e: sp.Dummy(real=True))
    return bool(outside.atoms(S.LSE, S.vsum, S.topk_sum)) or any(
        not s.name.startswith(S.RUNTIME_PREFIX) and s not in S.SEGMENT_SYMBOLS and not isinstance(s, sp.Dummy)
        for s in outside.free_symbols)


def _limit_form(formula: sp.Expr) -> sp.Expr:
    """Each product of a parameter and a sum that divides by that parameter distributed, so that
    nothing is 0 * inf where the parameter is 0: SimPO's ``beta * (x - gamma / beta)`` is
    ``beta*x - gamma``, its limit (``-gamma``) at ``beta = 0``. The same function elsewhere."""
    params = {s for s in formula.free_symbols if s.name.startswith(S.PARAM_PREFIX)}

    def cancels(node: sp.Expr) -> bool:
        if not isinstance(node, sp.Mul):
            return False
        factors = {f.base if f.is_Pow and f.exp.is_positive else f for f in node.args}
        return any(isinstance(f, sp.Add) and any(t.has(1 / p) for t in f.args for p in params & factors)
                   for f in node.args)
    return formula.replace(cancels, sp.expand_mul) if params else formula


def _check_defined(name: str, formula: sp.Expr, numbers: dict) -> None:
    """Refuse parameter values where the formula is undefined (sympy's ``zoo``/``nan``: IPO's
    ``1 / (2*beta)`` at ``beta = 0``, SAPO's ``4 / tau`` at a temperature of 0), naming the parameter,
    its value and the smallest part of the formula that breaks, rather than printing a kernel of
    inf or NaN (a tensor's value is looked at once, here, as its sign is)."""
    probe = {sym: number for sym, (_, _, number) in numbers.items()}

    def undefined(e: sp.Expr) -> bool:
        try:
            return e.xreplace(probe).has(sp.zoo, sp.nan)
        except (ValueError, TypeError):   # (sympy comparing a nan: "The argument 'nan' is not comparable")
            return True
    if not probe or not undefined(formula):
        return
    culprit = formula
    while True:
        inner = next((a for a in culprit.args if isinstance(a, sp.Basic) and undefined(a)), None)
        if inner is None:
            break
        culprit = inner
    named = [f"{key}={float(value)!r}" for sym, (key, value, _) in numbers.items() if culprit.has(sym)]
    raise ValueError(f"{name}: parameter {', '.join(named)}: the formula is undefined there ({culprit} "
                     f"is infinite or 0/0); give a value where it is finite")


def kernel_normalize(term: Term) -> str:
    """How the kernel reduces a term's rows. A term with class weights is a plain sum there: the
    head divides each row's class weight by the term's divisor (the valid rows' sum of class
    weights, or the call's divisor) before the kernel reads it (inputs.class_weight_rows)."""
    return "sum" if term.class_weight is not None else term.normalize


def scalar_values(terms: tuple[Term, ...], metrics: tuple[Term, ...]) -> dict[str, Any]:
    """Every runtime scalar a head's kernel may read, by its name there: each loss term's weight
    (``interface.weight_name``) and each runtime parameter (``S.runtime``); numbers or 0-dim tensors."""
    out: dict[str, Any] = {weight_name(t.name): t.weight for t in terms}
    head_terms = terms + metrics
    for term in head_terms:
        for key, _ in term.params:
            owner, value = _owner(term, key, head_terms)
            if _runtime(owner, key, value):
                out[S.runtime(owner.name, key, _sign(value)).name] = value
    return out


def _number(value: float) -> sp.Expr:
    """A parameter's value, exact: the decimal it prints as, or +-oo (``math.inf``: no bound)."""
    value = float(value)
    return sp.oo if value == math.inf else -sp.oo if value == -math.inf else sp.Rational(str(value))


@dataclass(frozen=True)
class _CrossEntropyFactory(TermFactory):
    """CrossEntropy: torch's label smoothing with class weights weighs every class of the smoothing
    sum (``-sum_i w_i log p_i``), which a per-row weight cannot express: refused, not approximated."""

    def __call__(self, *positional: Any, weight: Any = 1.0, normalize: str = "tokens",
                 class_weight: Any = None, **params: Any) -> Term:
        if positional:
            self._refuse_positional(positional)
        smoothing = params.get("label_smoothing", self.defaults["label_smoothing"])
        if class_weight is not None and (is_tensor(smoothing) or smoothing != 0):
            raise ValueError(
                f"{self.name}: class_weight with label_smoothing is not supported: torch's weighted "
                "smoothing term -sum_i class_weight[i] * log p_i reads the weight of every class, and the "
                "kernel reads class weights at the label only (docs/decisions.md); declare it with "
                "S.vector for the smoothing sum and a one-segment normaliser (docs/adding-a-loss.md, "
                "'A per-class vector')")
        return super().__call__(*positional, weight=weight, normalize=normalize, class_weight=class_weight,
                                **params)


class _GRPOFactory(TermFactory):
    """GRPO: ``top_entropy_quantile=q`` < 1 is TRL's high-entropy token mask (Wang et al., arXiv
    2506.01939): the policy term only where the token's entropy is at or above the ``1 - q`` quantile
    of the valid tokens' entropies (``S.row_quantile``, detached), the KL penalty everywhere."""

    def __call__(self, *positional: Any, top_entropy_quantile: float = 1.0, **options: Any) -> Term:
        if isinstance(top_entropy_quantile, bool) or not isinstance(top_entropy_quantile, (int, float)) \
                or not 0 <= top_entropy_quantile <= 1:
            raise ValueError(f"{self.name}: top_entropy_quantile must be a number in [0, 1] (TRL's: the share "
                             f"of the highest-entropy tokens kept), got {top_entropy_quantile!r}")
        if top_entropy_quantile == 1:
            return super().__call__(*positional, **options)
        entropy = -S.vsum(S.softmax * S.logsoftmax)
        high = S.Piecewise((1, entropy >= S.row_quantile(entropy, 1 - float(top_entropy_quantile))), (0, True))
        kl = self.formula - self.formula.xreplace({S.param("kl_beta"): 0})
        masked = declare_term(self.name, high * (self.formula - kl) + kl, defaults=self.defaults)
        return masked(*positional, **options)


# ----- built-in terms ---------------------------------------------------------------------------
# Each group is declared on first use of one of its names (the module's __getattr__), not when the
# package is imported: their formulas and declare_term's checks are most of this module's import.
_GROUP_OF: dict[str, Callable[[], tuple[TermFactory, ...]]] = {}   # a built-in's name -> its group


def _declares(*names: str) -> Callable:
    """Registers a group of built-ins: the function declaring them, returning them in this order."""
    def register(group: Callable[[], tuple[TermFactory, ...]]) -> Callable[[], tuple[TermFactory, ...]]:
        _GROUP_OF.update(dict.fromkeys(names, group))
        return group
    return register


@dataclass(frozen=True)
class _JSDFactory(TermFactory):
    """``JSD``: ``beta`` weighs the student ``p`` in the mixture ``m = beta p + (1 - beta) q``;
    ``JSD.trl(...)`` takes TRL's (and Liger's) convention by name."""

    def trl(self, *, beta: float = 0.5, temperature: Any = 1.0, weight: Any = 1.0, normalize: str = "tokens") -> Term:
        """TRL's generalized JSD (``GKDTrainer.generalized_jsd_loss``, Liger's ``LigerJSD``): ``beta``
        weighs the *teacher* in the mixture ``m = (1 - beta) p + beta q``, the loss is
        ``beta KL(q || m) + (1 - beta) KL(p || m)``, both logits divided by ``temperature``; TRL's
        ``beta=0`` is the forward KL ``KL(q || p)`` and ``beta=1`` the reverse KL ``KL(p || q)`` (not the
        formula's limits, which vanish): those two are ``ForwardKL`` / ``ReverseKL``, named so. Otherwise
        ``JSD(beta=1 - beta)``. ``beta`` is a number (its endpoints choose the term)."""
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
            raise ValueError(f"JSD.trl: beta must be a number in [0, 1], got {beta!r}")
        options = dict(temperature=temperature, weight=weight, normalize=normalize)
        if beta == 0:
            return ForwardKL(**options)
        if beta == 1:
            return ReverseKL(**options)
        return self(beta=1.0 - beta, **options)

    def __call__(self, *positional: Any, **params: Any) -> Term:
        if is_tensor(params.get("temperature")):
            # (lower.py would refuse it at the head's first use; here it names the parameter)
            raise ValueError(f"{self.name}: temperature as a tensor is not supported: log(beta*p + (1-beta)*q) "
                             "reads both normalisers inside its sum, and at a run-time temperature they are "
                             "sums of the read after the stats; give the temperature as a number (one kernel "
                             "per value), or use ForwardKL / ReverseKL, which take a tensor")
        term = super().__call__(*positional, **params)
        # the mixture beta*p + (1-beta)*q is a distribution only for beta in [0, 1]: outside, its log is
        # NaN where it goes negative (a tensor's value looked at once, here, as _check_value looks at it)
        beta = float(dict(term.params)["beta"])
        if not 0 <= beta <= 1:
            raise ValueError(f"{self.name}: beta must be in [0, 1] (the student's weight in the mixture "
                             f"beta*p + (1-beta)*q), got {beta}")
        return term


@_declares("CrossEntropy", "ZLoss", "Entropy", "TokenAccuracy")
def _token_terms() -> tuple[TermFactory, ...]:
    _e = S.param("label_smoothing")
    CrossEntropy = _CrossEntropyFactory(**vars(declare_term(
        "cross_entropy",
        (1 - _e) * (S.lse - S.target_logit) + _e * (S.lse - S.vsum(S.logit) / S.vocab_size),
        defaults={"label_smoothing": 0.0})))
    ZLoss = declare_term("z_loss", S.lse ** 2)
    Entropy = declare_term("entropy", -S.vsum(S.softmax * S.logsoftmax))
    TokenAccuracy = declare_term(
        "token_accuracy", S.Piecewise((1, sp.Eq(S.argmax, S.label)), (0, True)), metric_only=True)
    return CrossEntropy, ZLoss, Entropy, TokenAccuracy


@_declares("ForwardKL", "ReverseKL", "JSD", "TopKForwardKL")
def _distillation_terms() -> tuple[TermFactory, ...]:
    _T = S.param("temperature")
    _p, _logp = S.softmax_at(_T), S.logsoftmax_at(_T)
    _q, _logq = S.teacher_prob_at(_T), S.teacher_logprob_at(_T)
    ForwardKL = declare_term("forward_kl", S.vsum(_q * (_logq - _logp)), defaults={"temperature": 1.0})
    ReverseKL = declare_term("reverse_kl", S.vsum(_p * (_logp - _logq)), defaults={"temperature": 1.0})
    _beta = S.param("beta")
    _logm = S.log(_beta * _p + (1 - _beta) * _q)
    JSD = _JSDFactory(**vars(declare_term(
        "jsd", _beta * S.vsum(_p * (_logp - _logm)) + (1 - _beta) * S.vsum(_q * (_logq - _logm)),
        defaults={"beta": 0.5, "temperature": 1.0})))
    TopKForwardKL = declare_term(
        "topk_forward_kl",
        S.topk_sum(S.exp(S.topk_logprob) * (S.topk_logprob - (S.topk_logit / _T - S.lse_at(_T)))),
        defaults={"temperature": 1.0})
    return ForwardKL, ReverseKL, JSD, TopKForwardKL


@_declares("GRPO", "RefKL", "CISPO", "SAPO", "GSPO", "RatioMean", "ClipFraction", "ClipRatioLow",
           "ClipRatioHigh", "ClipRatioRegion", "CISPOClipRatio", "KLNewOld", "LogProb")
def _policy_terms() -> tuple[TermFactory, ...]:
    # policy gradient: l = log p_y, r = exp(l - old), A = advantages. Sources: TRL 1.16
    # GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py), token-level importance sampling.
    _l = S.target_logit - S.lse
    _r = S.exp(_l - S.token("old_logprobs"))
    _A = S.token("advantages")
    _lo, _hi = 1 - S.param("eps_low"), 1 + S.param("eps_high")
    _delta = S.param("delta")
    _d = S.token("ref_logprobs") - _l
    # TRL: per_token_kl = exp(ref - logp) - (ref - logp) - 1, times coef_1 (= r, before delta's clamp)
    # when use_bias_correction_kl (DeepSeek-V3.2): kl_bias_correction=1.0 here, 0.0 leaves it out
    _kl = (S.exp(_d) - _d - 1) * (1 + S.param("kl_bias_correction") * (_r - 1))
    # TRL: coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high); with delta (INTELLECT-2's two-sided
    # clipping) coef_1 = clamp(coef_1, max=delta) (the lower bound 0 here never binds: r > 0; delta=inf
    # binds nowhere either); loss = -min(coef_1 * A, coef_2 * A) + beta * kl
    GRPO = _GRPOFactory(**vars(declare_term(
        "grpo", -S.Min(S.clamp(_r, 0, _delta) * _A, S.clamp(_r, _lo, _hi) * _A) + S.param("kl_beta") * _kl,
        defaults={"eps_low": 0.2, "eps_high": 0.2, "kl_beta": 0.0, "delta": math.inf, "kl_bias_correction": 0.0})))
    # TRL's KL penalty on its own, for the losses that take one beside their policy term (CISPO, SAPO)
    RefKL = declare_term("ref_kl", _kl, defaults={"kl_bias_correction": 0.0})
    # CISPO, MiniMax-M1 (arXiv 2506.13585) eq. 4: the clipped importance weight is detached. TRL's
    # loss_type="cispo": -clamp(coef_1, max=epsilon_high).detach() * A * logp, its epsilon_high being
    # the bound itself (1 + eps_high here; ScaleRL's recommended 5.0 is eps_high=4.0)
    CISPO = declare_term("cispo", -S.stop_gradient(S.Min(_r, 1 + S.param("eps_high"))) * _A * _l,
                         defaults={"eps_high": 4.0})
    # SAPO (arXiv 2511.20347), TRL's loss_type="sapo": tau = tau_pos if A > 0 else tau_neg,
    # loss = -sigmoid(tau * (coef_1 - 1)) * 4 / tau * A
    _tau = S.Piecewise((S.param("temperature_pos"), _A > 0), (S.param("temperature_neg"), True))
    SAPO = declare_term("sapo", -4 / _tau / (1 + S.exp(-_tau * (_r - 1))) * _A,
                        defaults={"temperature_pos": 1.0, "temperature_neg": 1.05})
    _R = S.exp(S.segment_mean(_l - S.token("old_logprobs")))
    _As = S.segment_mean(_A)
    GSPO = declare_term(
        "gspo", -S.Min(_R * _As, S.clamp(_R, _lo, _hi) * _As),
        defaults={"eps_low": 3e-4, "eps_high": 4e-4})

    _eps_from_grpo = {"eps_low": FromTerm("grpo", 0.2), "eps_high": FromTerm("grpo", 0.2)}
    RatioMean = declare_term("ratio_mean", _r, metric_only=True)
    ClipFraction = declare_term(
        "clip_fraction", S.Piecewise((1, sp.Or(_r < _lo, _r > _hi)), (0, True)),
        defaults=_eps_from_grpo, metric_only=True)
    # TRL's clip ratios (sign-aware): low counts coef_1 < 1 - epsilon_low where A < 0, high counts
    # coef_1 > 1 + epsilon_high where A > 0, region either; coef_1 after delta's clamp, as TRL has it
    _rd = S.clamp(_r, 0, _delta)
    _clipped_low, _clipped_high = sp.And(_rd < _lo, _A < 0), sp.And(_rd > _hi, _A > 0)
    _from_grpo = {**_eps_from_grpo, "delta": FromTerm("grpo", math.inf)}
    ClipRatioLow = declare_term("clip_ratio_low", S.Piecewise((1, _clipped_low), (0, True)),
                                defaults=_from_grpo, metric_only=True)
    ClipRatioHigh = declare_term("clip_ratio_high", S.Piecewise((1, _clipped_high), (0, True)),
                                 defaults=_from_grpo, metric_only=True)
    ClipRatioRegion = declare_term("clip_ratio_region", S.Piecewise((1, sp.Or(_clipped_low, _clipped_high)), (0, True)),
                                   defaults=_from_grpo, metric_only=True)
    # TRL's cispo_clip_ratio: coef_1 > epsilon_high where A > 0
    CISPOClipRatio = declare_term("cispo_clip_ratio", S.Piecewise((1, sp.And(_r > _hi, _A > 0)), (0, True)),
                                  defaults={"eps_high": FromTerm("cispo", 4.0)}, metric_only=True)
    KLNewOld = declare_term("kl_new_old", _r - (_l - S.token("old_logprobs")) - 1, metric_only=True)
    LogProb = declare_term("logprob", _l)
    return (GRPO, RefKL, CISPO, SAPO, GSPO, RatioMean, ClipFraction, ClipRatioLow, ClipRatioHigh,
            ClipRatioRegion, CISPOClipRatio, KLNewOld, LogProb)


BUILTIN_NAMES = tuple(_GROUP_OF)
_declaring = threading.Lock()


def __getattr__(name: str) -> Any:
    """A built-in term (declared with its group at first use, then a plain global), or BUILTINS:
    every built-in, in BUILTIN_NAMES' order."""
    if name == "BUILTINS":
        return tuple(__getattr__(n) for n in BUILTIN_NAMES)
    group = _GROUP_OF.get(name)
    if group is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _declaring:
        if name not in globals():
            names = [n for n, g in _GROUP_OF.items() if g is group]
            globals().update(zip(names, group(), strict=True))
    return globals()[name]
