"""Stage 1a, declare: the symbols a loss formula is written in.

Three levels of quantities (see docs/architecture.md):

* element symbols -- one entry ``i`` of the vocabulary row: ``logit`` (z_i), ``teacher_logit`` (t_i),
  and for top-k teacher inputs ``topk_logit`` (z at id_k) and ``topk_logprob`` (l_k);
* row symbols -- one float per token: ``target_logit``, ``label``, ``argmax``, ``row_max``, ``vocab_size``,
  ``token(name)`` inputs, and the log-normalisers ``lse_at(T)`` / ``teacher_lse_at(T)``;
* reductions -- ``vsum(element expr)`` over the vocabulary, ``topk_sum(expr)`` over the K teacher
  entries, and ``segment_mean(row expr)`` over the valid rows of a segment (``segment_sum(row expr)``:
  its sum, ``segment_count`` times the mean); ``segment_sorted(row expr)``: the segments' sums of it,
  sorted over the call's segments (an order statistic: TRL's DPO ``aot``); ``row_quantile(row expr, q)``:
  a quantile of it over the call's valid rows (TRL's GRPO ``top_entropy_quantile``).

A term is a sympy expression at row level. Nothing here knows how it is computed.
"""
from __future__ import annotations

import re

import sympy as sp
from sympy import Abs, Max, Min, Piecewise, cos, erf, exp, log, sign, sin, sqrt, tanh  # for formulas

__all__ = [
    "Abs", "Max", "Min", "Piecewise", "exp", "log", "sqrt", "sign", "tanh", "sin", "cos", "erf",
    "logit", "teacher_logit", "topk_logit", "topk_logprob",
    "target_logit", "label", "argmax", "row_max", "vocab_size",
    "lse", "teacher_lse", "lse_at", "teacher_lse_at",
    "softmax", "logsoftmax", "softmax_at", "logsoftmax_at",
    "teacher_prob", "teacher_logprob", "teacher_prob_at", "teacher_logprob_at",
    "vsum", "topk_sum", "segment_mean", "segment_sum", "segment_count", "segment_sorted", "row_quantile", "token", "vector", "param", "LSE",
    "stop_gradient", "clamp",
]


def _real(name: str) -> sp.Symbol:
    return sp.Symbol(name, real=True)


# element level
logit = _real("z")
teacher_logit = _real("t")
topk_logit = _real("z_k")
topk_logprob = _real("l_k")

# row level
target_logit = _real("z_y")
label = _real("label")
argmax = _real("argmax")
# max_i z_i, the row's largest logit: the value at argmax (its derivative goes to the first index
# of the maximum, as torch's z.gather(-1, z.argmax(-1)) has it); a row quantity, not for inside vsum
row_max = _real("z_max")
vocab_size = _real("vocab_size")

# keyword inputs every head accepts; a head's per-row tokens come on top (inputs.py checks them)
STANDARD_INPUTS = ("teacher_logits", "loss_mask", "teacher_topk_ids", "teacher_topk_logprobs",
                   "segment_ids", "num_segments", "process_group", "segment_group", "divisor",
                   "reduction")
# the named arguments of HeadLoss.forward and HeadLoss.linear (their other inputs come as keywords);
# with STANDARD_INPUTS, names no token may take (tests/compiler/test_refusals.py reads the signatures)
CALL_ARGUMENTS = ("logits", "labels", "hidden", "weight", "bias", "teacher_hidden", "teacher_weight",
                  "teacher_bias", "chunk_rows")

TOKEN_PREFIX = "tok_"
PARAM_PREFIX = "param_"
RUNTIME_PREFIX = "p_"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def token(name: str) -> sp.Symbol:
    """A per-row input, passed at call time as keyword ``name=`` (shaped like ``labels``)."""
    if not _NAME.match(name):
        raise ValueError(f"token name {name!r} is not a Python identifier")
    return _real(TOKEN_PREFIX + name)


VECTOR_PREFIX = "vec_"


def vector(name: str) -> sp.Symbol:
    """A per-class input: entry ``i`` of a ``[V]`` float tensor passed at call time as keyword
    ``name=`` (the whole vocabulary, also on a vocab shard). An element symbol: inside ``vsum``."""
    if not _NAME.match(name):
        raise ValueError(f"vector name {name!r} is not a Python identifier")
    return _real(VECTOR_PREFIX + name)


def vectors_in(expr: sp.Expr) -> set[sp.Symbol]:
    """The ``vector(...)`` symbols of ``expr``."""
    return {s for s in expr.free_symbols if s.name.startswith(VECTOR_PREFIX)}


# The per-row token of a term given class weights (``Term(class_weight=...)``): the term's
# class_weight at the row's label. The head fills it at each call (inputs.py); no user passes it,
# and no declared token may take a name with this prefix.
CLASS_WEIGHT_PREFIX = "class_weight__"


def class_weight(term: str) -> sp.Symbol:
    """The per-row class weight of term ``term``, a token the head fills (``class_weight[label]``)."""
    return token(CLASS_WEIGHT_PREFIX + term)


def param(name: str) -> sp.Symbol:
    """A parameter, given its value when the term is built (``Term(name=value)``): a kernel argument
    (``runtime``), or a number in the kernel where it decides the plan (terms.planned_params)."""
    if not _NAME.match(name):
        raise ValueError(f"param name {name!r} is not a Python identifier")
    return _real(PARAM_PREFIX + name)


def runtime(term: str, name: str, sign: int = 0) -> sp.Symbol:
    """Parameter ``name`` of term ``term`` once bound as a kernel argument: a row-level constant that
    the kernel reads from its scalars at each call. ``sign`` (1, -1, or 0: unknown) is assumed by
    sympy, which keeps clamps' piecewise forms small (``1 - eps < 1 + eps`` for a positive eps)."""
    assume = {1: {"positive": True}, -1: {"negative": True}}.get(sign, {"real": True})
    return sp.Symbol(f"{RUNTIME_PREFIX}{term}__{name}", **assume)


class _RowValue(sp.Function):
    """A function of the row (a normaliser, a reduction) whose arguments may all be numbers."""

    @property
    def is_number(self) -> bool:
        # a row value, not a constant: with number arguments sympy would take it for one, which it
        # cannot compare (S.Max(S.lse, 0) raised "The argument 'LSE(1, 0)' is not comparable", and
        # S.Max(S.vsum(0 * S.logit), 1), found by the fuzzer, "The argument 'vsum(0)' ...")
        return False


class LSE(_RowValue):
    """``LSE(alpha, beta) = log sum_i exp(alpha*z_i + beta*t_i)``: a log-normaliser of the row."""

    nargs = 2
    is_real = True


class _SumOf(_RowValue):
    """A sum (or mean) over a row's elements or rows: of 0, it is 0 (``vsum(z - z)``), which the
    lowering would otherwise take for a sum sharing another's gradient coefficient by a ratio 0/0."""

    nargs = 1
    is_real = True

    @classmethod
    def eval(cls, x):
        if x == 0:
            return sp.S.Zero
        return None


class vsum(_SumOf):
    """Sum over the vocabulary of an element-level expression."""


class topk_sum(_SumOf):
    """Sum over the K sparse teacher entries of an expression in ``topk_logit``/``topk_logprob``."""


class segment_mean(_SumOf):
    """Mean of a row-level expression over the valid rows of the row's segment (``segment_ids``)."""


# The number of valid rows of a segment, in a segment term outside ``segment_mean`` (F's own
# level): the segment kernel's per-segment row count, a variable it names ``count``
# (templates/head_loss.py.j2), which this symbol prints as; testing.py's reference fills it too.
segment_count = _real("count")


class segment_sorted(segment_mean):
    """An order statistic over the segments: at the k-th non-empty segment (in id order), the k-th
    smallest of the non-empty segments' ``segment_sum(expr)`` (``torch.sort(sums).values[k]``). Its
    gradient is sort's: dL/d(the k-th smallest) goes to the segment whose sum it is. Two of them in
    one formula pair the k-th smallest of each: TRL's DPO ``aot`` compares the sorted log-ratios of
    the policy with the sorted ones of the reference. A segment statistic (a kind of
    ``segment_mean``, checked as one): it belongs to a segment term, whose value per segment the
    segment kernel computes after the segment step has sorted the sums on the device."""


class row_quantile(segment_mean):
    """``row_quantile(u, q)``: the ``q``-quantile (0 <= q <= 1, a number) of the row quantity ``u``
    over the call's valid rows, ``torch.quantile(u[valid], q)`` (linear interpolation), detached: a
    row-level constant of the batch with no gradient (TRL's GRPO ``top_entropy_quantile`` masks the
    loss where ``entropy >= row_quantile(entropy, 1 - q)``). A batch statistic: the rows' ``u`` come
    from the first read, the segment step takes the quantile on the device, and the row terms that
    read it are evaluated row by row once it is known (as row terms of segment statistics are)."""

    nargs = 2

    @classmethod
    def eval(cls, x, q):
        # (is_real first: sympy refuses to compare NaN, I or oo with a TypeError of its own)
        if not (q.is_number and q.is_real and 0 <= q <= 1):
            raise ValueError(f"row_quantile(u, q): q must be a number in [0, 1], got {q}")
        return None


def segment_sum(expr: sp.Expr) -> sp.Expr:
    """Sum of a row-level expression over the valid rows of the row's segment:
    ``segment_count * segment_mean(expr)`` (a sequence's log-probability, no length token needed)."""
    return segment_count * segment_mean(expr)


class stop_gradient(sp.Function):
    """``stop_gradient(x)``: the value of ``x``, derivative 0 (torch's ``x.detach()``). Allowed at
    any level: around a row quantity, inside ``vsum`` or ``segment_mean``, or around either."""

    nargs = 1
    is_real = True

    @classmethod
    def eval(cls, x):
        if x.is_number or isinstance(x, stop_gradient):  # a constant (log(2) too) has no gradient
            return x                                     # to stop, nor one stopped already

    def fdiff(self, argindex=1):
        return sp.S.Zero


class clamp(sp.Function):
    """``clamp(x, lo, hi) = min(max(x, lo), hi)`` with torch.clamp's derivative: 1 in ``x`` on the
    closed interval ``lo <= x <= hi`` (where ``Min(Max(x, lo), hi)`` would split a tie in half).
    A bound that never binds (a parameter set to ``math.inf``, 0 below a ratio ``exp(...)``) is
    dropped from the printed code."""

    nargs = 3
    is_real = True

    @classmethod
    def eval(cls, x, lo, hi):
        if all(isinstance(a, sp.Number) for a in (x, lo, hi)):
            return sp.Min(sp.Max(x, lo), hi)
        if sp.Ge(x, lo) == sp.true and sp.Le(x, hi) == sp.true:
            return x

    def fdiff(self, argindex=1):
        # torch's clamp_backward and clamp_backward_min_max (lo > hi: the value is hi)
        x, lo, hi = self.args
        inside = {1: sp.And(x >= lo, x <= hi), 2: sp.And(x < lo, lo < hi), 3: sp.Or(x > hi, hi < lo)}
        return sp.Piecewise((1, inside[argindex]), (0, True))


def check_exponentials(name: str, formula: sp.Expr) -> None:
    """Refuse an exponential inside ``vsum`` whose coefficient of the element (``d arg / d z_i``,
    ``d arg / d t_i``) reads a row value (a token, the label, a log-normaliser, an inner sum, ...)
    and the element itself: ``exp(z**2 / token)`` has no maximum the kernel knows. An exponent linear
    in the element, ``a*z + b*t + r`` with ``a, b`` row values (``exp(z / token("tau"))``, a per-row
    temperature), is read relative to the row maxima (stable.run_time_temperatures)."""
    for red in formula.atoms(vsum):
        for e in red.args[0].atoms(sp.exp):
            # inner reductions and normalisers are row values here, not functions of the element
            rows_of = {r: sp.Dummy(str(r)) for r in e.args[0].atoms(LSE, vsum, topk_sum, segment_mean)}
            arg = e.args[0].xreplace(rows_of)
            for elem in ELEMENT_SYMBOLS:
                coefficient = arg.diff(elem)
                rows = sorted(f"token({s.name[len(TOKEN_PREFIX):]!r})" if s.name.startswith(TOKEN_PREFIX)
                              else str(s) for s in coefficient.free_symbols
                              if s not in ELEMENT_SYMBOLS and not s.name.startswith(PARAM_PREFIX))
                if rows and coefficient.has(*ELEMENT_SYMBOLS):
                    raise ValueError(
                        f"{name}: {e} inside vsum(...): the coefficient of {elem} in an exponential, "
                        f"{coefficient.xreplace({d: r for r, d in rows_of.items()})}, reads a row value "
                        f"({', '.join(rows)}) and the element, so the sum has no maximum to subtract and "
                        "overflows float32; write the exponent linear in the element (a * S.logit + r, "
                        "a >= 0 a row value: exp(S.logit / S.token('tau')) is read relative to the row's "
                        "maximum)")


def _inv(temperature) -> sp.Expr:
    if isinstance(temperature, (int, float)):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        temperature = sp.Rational(str(temperature))
    return 1 / sp.sympify(temperature)


def lse_at(temperature=1) -> sp.Expr:
    """``logsumexp(z / T)``."""
    return LSE(_inv(temperature), 0)


def teacher_lse_at(temperature=1) -> sp.Expr:
    """``logsumexp(t / T)``."""
    return LSE(0, _inv(temperature))


def logsoftmax_at(temperature=1) -> sp.Expr:
    return logit * _inv(temperature) - lse_at(temperature)


def softmax_at(temperature=1) -> sp.Expr:
    return exp(logsoftmax_at(temperature))


def teacher_logprob_at(temperature=1) -> sp.Expr:
    return teacher_logit * _inv(temperature) - teacher_lse_at(temperature)


def teacher_prob_at(temperature=1) -> sp.Expr:
    return exp(teacher_logprob_at(temperature))


lse = lse_at(1)
teacher_lse = teacher_lse_at(1)
softmax = softmax_at(1)
logsoftmax = logsoftmax_at(1)
teacher_prob = teacher_prob_at(1)
teacher_logprob = teacher_logprob_at(1)

ELEMENT_SYMBOLS = (logit, teacher_logit)
TOPK_SYMBOLS = (topk_logit, topk_logprob)
ROW_SYMBOLS = (target_logit, label, argmax, row_max, vocab_size)
SEGMENT_SYMBOLS = (segment_count,)

# The sympy functions a formula may use besides the constructs defined in this module: both
# printers (the Triton kernel's, backends/triton/render.TritonPrinter, and the float64 reference's,
# emit.TorchPrinter) print them, and sympy writes their derivatives in them (sign, Abs, Min and Max
# are differentiated as Piecewise). declare_term refuses any other function. (Powers, sqrt
# included, are Pow: printed too.)
FUNCTIONS = (exp, log, Abs, sign, Min, Max, Piecewise, tanh, sin, cos, erf)
