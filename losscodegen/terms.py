"""Stage 1b, declare: loss terms as sympy formulas.

Every built-in below is one formula; the gradient of each is derived later by sympy (lower.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy as sp

from . import symbols as S


@dataclass(frozen=True)
class FromTerm:
    """A parameter default taken from another term of the same head (e.g. ClipFraction's eps from GRPO)."""

    term: str
    fallback: float


@dataclass(frozen=True)
class Term:
    """One term of a head: a name, a row-level formula with its parameters bound, and a weight."""

    name: str
    formula: sp.Expr
    weight: float = 1.0
    params: tuple[tuple[str, float], ...] = ()
    metric_only: bool = False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.name}({args}; weight={self.weight!r}): {self.formula}"


@dataclass(frozen=True)
class TermFactory:
    """What ``declare_term`` returns: call it with ``weight=`` and the term's parameters."""

    name: str
    formula: sp.Expr
    defaults: Mapping[str, Any] = field(default_factory=dict)
    metric_only: bool = False

    def __call__(self, weight: float = 1.0, **params: Any) -> Term:
        unknown = set(params) - set(self.defaults) - self._param_names()
        if unknown:
            raise TypeError(f"{self.name}: unknown parameter(s) {sorted(unknown)}; "
                            f"it takes {sorted(self._param_names())}")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            raise TypeError(f"{self.name}: weight must be a number, got {type(weight).__name__}")
        values = {**self.defaults, **params}
        missing = self._param_names() - set(values)
        if missing:
            raise TypeError(f"{self.name}: missing parameter(s) {sorted(missing)}")
        for k, v in values.items():
            if not isinstance(v, (int, float, FromTerm)) or isinstance(v, bool):
                raise TypeError(f"{self.name}: parameter {k} must be a number, got {v!r}")
        numbers = {S.param(k): sp.Rational(str(float(v))) for k, v in values.items()
                   if not isinstance(v, FromTerm)}
        for lse in self.formula.xreplace(numbers).atoms(S.LSE):
            if any(a.is_number and not (a.is_finite and a.is_extended_real and a >= 0) for a in lse.args) \
                    or all(a == 0 for a in lse.args):
                raise ValueError(f"{self.name}: a temperature must be > 0 (got {lse}, from {params})")
        return Term(self.name, self.formula, float(weight), tuple(sorted(values.items())),
                    self.metric_only)

    def _param_names(self) -> set[str]:
        return {s.name[len(S.PARAM_PREFIX):] for s in self.formula.free_symbols
                if s.name.startswith(S.PARAM_PREFIX)}

    def __repr__(self) -> str:
        return f"<term {self.name}: {self.formula}>"


def declare_term(name: str, formula: sp.Expr, *, defaults: Mapping[str, Any] | None = None,
                 metric_only: bool = False) -> TermFactory:
    """Declare a per-token loss term from its formula. Returns a factory: ``Term = declare_term(...)``,
    then ``Term(weight=..., param=...)`` in a ``HeadLoss``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"term name must be an identifier, got {name!r}")
    formula = sp.sympify(formula)
    if not isinstance(formula, sp.Expr):
        raise TypeError(f"{name}: formula must be a sympy expression, got {type(formula).__name__}")
    _check_levels(name, formula)
    return TermFactory(name, formula, dict(defaults or {}), metric_only)


def _check_levels(name: str, formula: sp.Expr) -> None:
    """Element symbols live inside their reduction; reductions do not nest."""
    reductions = (S.vsum, S.topk_sum, S.segment_mean)
    for red in formula.atoms(*reductions):
        inner = red.args[0]
        if inner.has(*reductions):
            raise ValueError(f"{name}: nested reductions are not supported: {red}")
    outside = formula.replace(lambda e: isinstance(e, (S.vsum, S.topk_sum)), lambda e: sp.S.Zero)
    for sym, where in ((S.ELEMENT_SYMBOLS, "vsum(...)"), (S.TOPK_SYMBOLS, "topk_sum(...)")):
        if outside.has(*sym):
            raise ValueError(f"{name}: element symbols {[str(s) for s in sym]} may only appear "
                             f"inside {where}: {formula}")


def bind(term: Term, head_terms: tuple[Term, ...]) -> sp.Expr:
    """The term's formula with its parameters substituted (FromTerm defaults resolved in ``head_terms``)."""
    values = {}
    for key, value in term.params:
        if isinstance(value, FromTerm):
            source = next((t for t in head_terms if t.name == value.term), None)
            value = dict(source.params).get(key, value.fallback) if source else value.fallback
        values[S.param(key)] = sp.Rational(str(float(value)))
    return term.formula.xreplace(values)


# ----- built-in terms ---------------------------------------------------------------------------
_e = S.param("label_smoothing")
CrossEntropy = declare_term(
    "cross_entropy",
    (1 - _e) * (S.lse - S.target_logit) + _e * (S.lse - S.vsum(S.logit) / S.vocab_size),
    defaults={"label_smoothing": 0.0})
ZLoss = declare_term("z_loss", S.lse ** 2)
Entropy = declare_term("entropy", -S.vsum(S.softmax * S.logsoftmax))
TokenAccuracy = declare_term(
    "token_accuracy", S.Piecewise((1, sp.Eq(S.argmax, S.label)), (0, True)), metric_only=True)

_T = S.param("temperature")
_p, _logp = S.softmax_at(_T), S.logsoftmax_at(_T)
_q, _logq = S.teacher_prob_at(_T), S.teacher_logprob_at(_T)
ForwardKL = declare_term("forward_kl", S.vsum(_q * (_logq - _logp)), defaults={"temperature": 1.0})
ReverseKL = declare_term("reverse_kl", S.vsum(_p * (_logp - _logq)), defaults={"temperature": 1.0})
_beta = S.param("beta")
_logm = S.log(_beta * _p + (1 - _beta) * _q)
JSD = declare_term(
    "jsd", _beta * S.vsum(_p * (_logp - _logm)) + (1 - _beta) * S.vsum(_q * (_logq - _logm)),
    defaults={"beta": 0.5, "temperature": 1.0})
TopKForwardKL = declare_term(
    "topk_forward_kl",
    S.topk_sum(S.exp(S.topk_logprob) * (S.topk_logprob - (S.topk_logit / _T - S.lse_at(_T)))),
    defaults={"temperature": 1.0})

# policy gradient: l = log p_y, r = exp(l - old), A = advantages
_l = S.target_logit - S.lse
_r = S.exp(_l - S.token("old_logprobs"))
_A = S.token("advantages")
_lo, _hi = 1 - S.param("eps_low"), 1 + S.param("eps_high")
_d = S.token("ref_logprobs") - _l
GRPO = declare_term(
    "grpo",
    -S.Min(_r * _A, S.Min(S.Max(_r, _lo), _hi) * _A) + S.param("kl_beta") * (S.exp(_d) - _d - 1),
    defaults={"eps_low": 0.2, "eps_high": 0.2, "kl_beta": 0.0})
_R = S.exp(S.segment_mean(_l - S.token("old_logprobs")))
_As = S.segment_mean(_A)
GSPO = declare_term(
    "gspo", -S.Min(_R * _As, S.Min(S.Max(_R, _lo), _hi) * _As),
    defaults={"eps_low": 3e-4, "eps_high": 4e-4})

_eps_from_grpo = {"eps_low": FromTerm("grpo", 0.2), "eps_high": FromTerm("grpo", 0.2)}
RatioMean = declare_term("ratio_mean", _r, metric_only=True)
ClipFraction = declare_term(
    "clip_fraction", S.Piecewise((1, sp.Or(_r < _lo, _r > _hi)), (0, True)),
    defaults=_eps_from_grpo, metric_only=True)
KLNewOld = declare_term("kl_new_old", _r - (_l - S.token("old_logprobs")) - 1, metric_only=True)
LogProb = declare_term("logprob", _l, metric_only=True)

BUILTINS = (CrossEntropy, ZLoss, Entropy, TokenAccuracy, ForwardKL, ReverseKL, JSD, TopKForwardKL,
            GRPO, GSPO, RatioMean, ClipFraction, KLNewOld, LogProb)
