"""The differential fuzzer: random formulas, heads and plans, each compared with the float64 reference.

``python -m losscodegen fuzz [--minutes N] [--seed S] [--device cpu|cuda]``. A *case* is a head (1-3
terms, declared from random formulas or built in, and metrics), a *plan* (how the runtime computes
it: tile and split, vocab-parallel ranks and shard widths, ``head.linear`` and its chunks,
``reduction``, ``out.rows``, ``torch.compile``, the logits' dtype) and a seed for the inputs. Every
case is compared, value and gradient, with ``losscodegen.testing``'s reference (the declared
formulas evaluated directly in float64 torch), within ``testing.TOLERANCES``. A mismatch is shrunk
(terms dropped, sub-formulas replaced by smaller ones, the plan made plainer) while it still fails,
and printed as a pytest test that runs ``check(...)`` on the minimal case.

Each case draws its inputs in an input *regime* (``testing.REGIMES``: late training's rows on
purpose, saturated labels, one-hot and masked teachers, spreads up to 1e4, ratios at the clip
bounds and past exp's overflow, ...), and the grammar puts parameters at their edges (0 as a
number and a tensor, large, a clip bound of 0, temperatures near 0 and large). The yardstick is
plain torch's fp32 evaluation of the same formulas (``testing.compare``'s ``plain``): wherever it is
finite the head's output must be too, and no further from float64 than the tolerance or
``testing.PEER_FACTOR`` times torch's own error.

Formulas are trees of Python text over ``S`` (``losscodegen.symbols``), so that a case prints as
the code a user would write. A ``randn`` case is kept where its float64 value is finite and well
conditioned: a formula whose reference moves by more than a fraction of the tolerance when the
inputs move by a few fp32 ulps (a kink at a near tie, a cancellation) is not a fair test of fp32
arithmetic and is skipped (counted as ``skipped``); a case of another regime, only for the latter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import queue as queue_mod
import random
import socket
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import sympy as sp
import torch

import losscodegen as lcg
from . import preference as P
from . import symbols as S
from .testing import REGIMES, TOLERANCES, _reads_rows, compare, gradient_floor, random_inputs, reference

__all__ = ["Case", "Plan", "Mismatch", "Skip", "Refused", "check", "refused", "sympy_builds", "generate_case", "shrink",
           "regression_test", "fuzz"]


# ---- formulas -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    """A formula: ``text`` with ``{0}, {1}, ...`` standing for its children's texts. ``level``: "row",
    "elem" (inside vsum) or "topk" (inside topk_sum); ``pos``: positive and away from 0."""

    text: str
    kids: tuple["Node", ...] = ()
    level: str = "row"
    pos: bool = False

    def code(self) -> str:
        return self.text.format(*(k.code() for k in self.kids))

    def nodes(self) -> Iterator["Node"]:
        yield self
        for k in self.kids:
            yield from k.nodes()

    def replace(self, old: "Node", new: "Node") -> "Node":
        if self is old:
            return new
        return dataclasses.replace(self, kids=tuple(k.replace(old, new) for k in self.kids))


def _leaf(text: str, level: str = "row", pos: bool = False) -> Node:
    return Node(text, (), level, pos)


# leaves by level; (text, positive)
_ROW_LEAVES = [("S.lse", False), ("S.target_logit", False), ("(S.target_logit - S.lse)", False),
               ("S.lse_at(2)", False), ("S.lse_at(0.5)", False), ("S.token('a')", False),
               ("S.param('c')", False), ("0.5", True), ("2", True), ("(S.lse - S.target_logit + 0.5)", True),
               ("S.exp(S.target_logit - S.lse)", True), ("(1 + S.token('a')**2)", True),
               ("S.row_max", False), ("(S.row_max - S.target_logit)", False), ("S.exp(S.row_max - S.lse)", True),
               # temperatures known at run time: a tensor parameter, a per-row one (> 0 either way)
               ("S.lse_at(S.param('T'))", False), ("S.lse_at(1 + S.token('a')**2)", False),
               # 1 - p_y, 0 where p_y rounds to 1 (poly-1), and the focal loss's power of it
               ("(1 - S.exp(S.target_logit - S.lse))", False),
               ("(1 - S.exp(S.target_logit - S.lse))**S.param('g') * (S.lse - S.target_logit)", False)]
_TEACHER_ROW_LEAVES = [("S.teacher_lse", False), ("S.teacher_lse_at(2)", False),
                       ("S.teacher_lse_at(S.param('T'))", False)]
_ELEM_LEAVES = [("S.logit", False), ("S.logsoftmax", False), ("S.softmax", True),
                ("S.logsoftmax_at(2)", False), ("S.token('a')", False), ("S.param('c')", False),
                ("S.lse", False), ("0.5", True), ("S.vector('u')", True)]
_TEACHER_ELEM_LEAVES = [("S.teacher_logit", False), ("S.teacher_logprob", False), ("S.teacher_prob", True),
                        ("S.teacher_prob_at(2)", True)]
# the weights of an online vocabulary sum: exp(alpha z + beta t) up to a row factor
_WEIGHTS = ["S.softmax", "S.softmax_at(2)", "S.softmax_at(0.5)", "S.exp(S.logit - S.lse_at(1))",
            "S.exp(S.param('k') * S.logit - S.lse)", "S.exp(S.logit - S.row_max)", "S.vector('u') * S.softmax",
            "S.softmax_at(S.param('T'))", "S.softmax_at(1 + S.token('a')**2)", "S.exp(S.logit / S.param('T'))"]
_TEACHER_WEIGHTS = ["S.teacher_prob", "S.teacher_prob_at(2)", "S.exp(S.logit / 2 + S.teacher_logit / 2 - S.lse)",
                    "S.teacher_prob_at(S.param('T'))"]
_TOPK_LEAVES = [("S.topk_logit", False), ("S.topk_logprob", False), ("(S.topk_logit - S.lse)", False),
                ("S.exp(S.topk_logprob)", True), ("S.exp(S.topk_logit - S.lse)", True),
                ("S.token('a')", False)]
_TOPK_TERMS = ["S.exp(S.topk_logprob) * (S.topk_logprob - (S.topk_logit - S.lse))",
               "S.log(1 - S.exp(S.topk_logit - S.lse))",                      # token-level unlikelihood
               "S.exp(S.topk_logit - S.lse)"]
# a sum of the first read, read inside another sum (its summand, or a row factor of it): online sums
_INNER_SUMS = ["S.vsum(S.softmax * S.logit)", "S.vsum(S.logit**2) / 64", "S.vsum(S.softmax**2)",
               "S.vsum(S.vector('u') * S.softmax)"]
# outer summands around an inner sum {1} ({0}: a random element)
_NESTED = ["S.softmax * {0} * {1}", "S.softmax * S.Abs(S.logit - {1})", "S.softmax * S.tanh(S.logit * {1}) * {0}",
           "S.exp(S.logit - S.row_max) * (S.logit - {1})**2"]
# LogitNorm (docs/adding-a-loss.md): an exponent scaled by a row value, relative to the row's maximum
_LOGIT_NORM = ("S.log(S.vsum(S.exp((S.logit - S.row_max) / (S.param('tau') * (S.sqrt(S.vsum(S.logit**2)) + 1e-7)))))"
               " + (S.row_max - S.target_logit) / (S.param('tau') * (S.sqrt(S.vsum(S.logit**2)) + 1e-7))")
_SEGMENT_TERMS = ["-S.Min(S.exp(S.segment_mean(S.target_logit - S.lse - S.token('old_logprobs'))) * "
                  "S.segment_mean(S.token('a')), 1.2 * S.segment_mean(S.token('a')))",
                  "S.segment_mean(S.lse - S.target_logit) ** 2",
                  "S.exp(S.segment_mean(S.target_logit - S.lse)) * S.segment_mean(S.lse)",
                  "-S.segment_sum(S.token('a') * (S.target_logit - S.lse)) / 8",
                  "S.segment_sum(S.lse - S.target_logit) / S.segment_count",
                  "S.segment_mean(S.token('a')) * S.segment_count",
                  # order statistics over the segments (DPO's aot: sorted log-ratios against sorted ones)
                  "-S.log(1 + S.exp(S.segment_sorted(S.token('old_logprobs')) - S.segment_sorted(S.target_logit - S.lse)))"]
# segment terms around a random row formula {0}: sums and means of it
_SEGMENT_OF_ROW = ["S.segment_sum({0}) / 4", "S.segment_mean({0})**2", "S.segment_count * S.tanh(S.segment_mean({0}))",
                   "S.tanh(S.segment_sorted({0}) / 8) * S.segment_mean(S.token('a'))"]
# row terms that read their segment's statistics (GSPO-token-like) around a random row formula {0}
_ROW_OF_SEGMENT = ["{0} * S.stop_gradient(S.exp(S.segment_mean(S.target_logit - S.lse - S.token('old_logprobs'))))"
                   " / S.segment_count",
                   "{0} / S.segment_mean(1 + S.token('a')**2)",
                   "{0} * (S.segment_sum(S.lse - S.target_logit) / S.segment_count - S.target_logit)",
                   # batch quantiles (TRL's top_entropy_quantile): a mask of the rows, and a value
                   "{0} * S.Piecewise((1, S.token('a') >= S.row_quantile(S.token('a'), 0.7)), (0, True))",
                   "{0} * S.row_quantile(S.lse - S.target_logit, 0.5)"]


class Generator:
    """Random well-typed formulas (``formula``), terms and heads (``case``), from one ``random.Random``."""

    def __init__(self, rng: random.Random, *, teacher: bool = True, topk: bool = True,
                 segments: bool = True) -> None:
        self.rng, self.teacher, self.topk, self.segments = rng, teacher, topk, segments

    def pick(self, options: list):
        return options[self.rng.randrange(len(options))]

    # -- elements (inside vsum) ------------------------------------------------------------------
    def elem(self, depth: int, pos: bool = False) -> Node:
        leaves = _ELEM_LEAVES + (_TEACHER_ELEM_LEAVES if self.teacher else [])
        if pos:
            leaves = [l for l in leaves if l[1]]
        if depth <= 0 or self.rng.random() < 0.35:
            return _leaf(*self.pick(leaves)[:1], level="elem", pos=pos)
        if pos:
            return self.pick([
                lambda: Node("({0} + {1})", (self.elem(depth - 1, True), self.elem(depth - 1, True)), "elem", True),
                lambda: Node("S.exp(S.tanh({0}))", (self.elem(depth - 1),), "elem", True),
                lambda: Node("(1 + {0}**2)", (self.elem(depth - 1),), "elem", True),
                lambda: Node("(1 + S.Abs({0}))", (self.elem(depth - 1),), "elem", True),
            ])()
        a = lambda: self.elem(depth - 1)
        return self.pick([
            lambda: Node("({0} + {1})", (a(), a()), "elem"),
            lambda: Node("({0} - {1})", (a(), a()), "elem"),
            lambda: Node("({0} * {1})", (a(), a()), "elem"),
            lambda: Node("S.log({0})", (self.elem(depth - 1, True),), "elem"),
            lambda: Node("S.Abs({0})", (a(),), "elem"),
            lambda: Node("S.Max({0}, {1})", (a(), a()), "elem"),
            lambda: Node("S.Min({0}, {1})", (a(), a()), "elem"),
            lambda: Node("S.tanh({0})", (a(),), "elem"),
            lambda: Node("S.clamp({0}, -1, 1)", (a(),), "elem"),
            lambda: Node("S.Piecewise(({0}, {1} > 0), ({2}, True))", (a(), a(), a()), "elem"),
            lambda: Node("S.stop_gradient({0})", (a(),), "elem"),
            lambda: Node("{0}**2", (a(),), "elem"),
        ])()

    def vsum(self, depth: int) -> Node:
        """A vocabulary sum: an online one (a weight exp(alpha z + beta t) times h), a sum with no
        weight, or an exact one (a log of the mixture, as JSD's)."""
        weights = _WEIGHTS + (_TEACHER_WEIGHTS if self.teacher else [])
        kind = self.rng.random()
        if kind < 0.1:   # a sum of the first read inside this one's summand
            inner = _leaf(self.pick(_INNER_SUMS))
            body = Node(self.pick(_NESTED), (self.elem(depth - 1), inner), "elem")
        elif kind < 0.6:
            body = Node("{0} * {1}", (_leaf(self.pick(weights), "elem", True), self.elem(depth)), "elem")
        elif kind < 0.75:
            body = self.elem(depth)
        elif self.teacher:
            body = Node("S.softmax * S.log(S.softmax / 2 + S.teacher_prob / 2 + {0})",
                        (_leaf(self.pick(["0", "S.softmax**2", "S.teacher_prob / 4"]), "elem"),), "elem")
        else:
            body = Node("S.log(1 + S.softmax * {0})", (self.elem(depth, True),), "elem")
        return Node("S.vsum({0})", (body,), "row")

    def topk_sum(self, depth: int) -> Node:
        if self.rng.random() < 0.5:
            return Node("S.topk_sum({0})", (_leaf(self.pick(_TOPK_TERMS), "topk"),), "row")
        w = _leaf(self.pick(["S.exp(S.topk_logprob)", "S.exp(S.topk_logit - S.lse)", "1"]), "topk", True)
        h = _leaf(self.pick(_TOPK_LEAVES)[0], "topk")
        if depth > 0 and self.rng.random() < 0.5:
            h = Node(self.pick(["S.Abs({0})", "S.tanh({0})", "{0}**2", "S.Max({0}, -1)"]), (h,), "topk")
        return Node("S.topk_sum({0} * {1})", (w, h), "row")

    # -- rows --------------------------------------------------------------------------------------
    def row(self, depth: int, pos: bool = False) -> Node:
        leaves = _ROW_LEAVES + (_TEACHER_ROW_LEAVES if self.teacher else [])
        if pos:
            leaves = [l for l in leaves if l[1]]
        if depth <= 0 or self.rng.random() < 0.25:
            if not pos and self.rng.random() < 0.5:
                return self.topk_sum(depth) if self.topk and self.rng.random() < 0.25 else self.vsum(1)
            return _leaf(self.pick(leaves)[0], pos=pos)
        if pos:
            return self.pick([
                lambda: Node("({0} + {1})", (self.row(depth - 1, True), self.row(depth - 1, True)), pos=True),
                lambda: Node("({0} * {1})", (self.row(depth - 1, True), self.row(depth - 1, True)), pos=True),
                lambda: Node("S.exp(S.tanh({0}))", (self.row(depth - 1),), pos=True),
                lambda: Node("(1 + {0}**2)", (self.row(depth - 1),), pos=True),
                lambda: Node("S.vsum(S.softmax**2)", (), pos=True),
                lambda: Node("S.sqrt({0})", (self.row(depth - 1, True),), pos=True),
            ])()
        a = lambda: self.row(depth - 1)
        return self.pick([
            lambda: Node("({0} + {1})", (a(), a())),
            lambda: Node("({0} - {1})", (a(), a())),
            lambda: Node("({0} * {1})", (a(), a())),
            lambda: Node("({0} / {1})", (a(), self.row(depth - 1, True))),
            lambda: Node("S.log({0})", (self.row(depth - 1, True),)),
            lambda: Node("S.exp(S.tanh({0}))", (a(),)),
            lambda: Node("S.Abs({0})", (a(),)),
            lambda: Node("S.Max({0}, {1})", (a(), a())),
            lambda: Node("S.Min({0}, {1})", (a(), a())),
            lambda: Node("S.clamp({0}, -1, 2)", (a(),)),
            lambda: Node("S.Piecewise(({0}, {1} > 0), ({2}, True))", (a(), a(), a())),
            lambda: Node("S.stop_gradient({0})", (a(),)),
            lambda: Node("S.tanh({0})", (a(),)),
            lambda: Node("{0}**2", (a(),)),
            lambda: Node("{0}**S.param('g')", (self.row(depth - 1, True),)),
            lambda: self.vsum(depth - 1),
            lambda: self.topk_sum(depth - 1) if self.topk else self.vsum(depth - 1),
        ])()


# ---- cases ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TermSpec:
    """A term of a case: a declared formula (``formula`` set; ``name``, its factory's keywords) or a
    built-in (``code``: its constructor call)."""

    code: str
    name: str = ""
    formula: Node | None = None
    metric: bool = False

    def lines(self, i: int) -> list[str]:
        if self.formula is None:
            return []
        return [f"T{i} = lcg.declare_term({self.name!r}, {self.formula.code()})"]

    def call(self, i: int) -> str:
        return f"T{i}({self.code})" if self.formula is not None else self.code


@dataclass(frozen=True)
class Plan:
    """How the runtime computes a case. ``kind``: "call" (``head(logits, ...)``), "linear"
    (``head.linear``, ``chunk_rows``; the teacher's hidden and weight too where the head reads a
    teacher), "sharded" (``world`` gloo ranks holding ``shards`` columns
    each), "compile" (``torch.compile`` of a call). ``tile``: a forced ``(block_v, num_warps, split)``
    (None: the runtime's own choice). ``backend``: the head built on that backend ("": the head's own).
    ``inplace``: the head built with ``inplace_backward=True`` (the gradient written over the logits).
    ``teacher_grad``: teacher logits that require grad (co-distillation), their gradient checked too."""

    kind: str = "call"
    dtype: str = "float32"
    reduction: str = "mean"
    divisor: float | None = None
    tile: tuple[int, int, bool] | None = None
    world: int = 1
    shards: tuple[int, ...] = ()
    chunk_rows: int | None = None
    backend: str = ""
    inplace: bool = False
    teacher_grad: bool = False

    def code(self) -> str:
        fields_ = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Plan({', '.join(fields_)})"


# a tensor weight or parameter, created on the case's device (``device``, a name of the printed test)
_TENSOR = "torch.tensor({}, device=device)"


@dataclass(frozen=True)
class Case:
    """A head's terms, a plan, the inputs' sizes and seed, and the device it runs on: its tensor
    weights and parameters are created there, as the logits are (a printed test names it)."""

    terms: tuple[TermSpec, ...]
    plan: Plan = Plan()
    head_options: str = ""     # e.g. "softcap=20.0"
    rows: int = 12
    vocab: int = 64
    seed: int = 0
    device: str = "cpu"
    layout: str = ""           # the preference terms' inputs: "pairs" or "sequences" (``_inputs``)
    regime: str = "randn"      # how the inputs are drawn (testing.REGIMES)

    def head_code(self) -> list[str]:
        specs = list(enumerate(self.terms))
        lines = [line for i, t in specs for line in t.lines(i)]
        terms = [t.call(i) for i, t in specs if not t.metric]
        metrics = [t.call(i) for i, t in specs if t.metric]
        args = terms + ([f"metrics=({', '.join(metrics)},)"] if metrics else []) + \
            ([self.head_options] if self.head_options else [])
        return lines + [f"head = lcg.HeadLoss({', '.join(args)})"]

    def code(self) -> str:
        return "\n".join([f"device = {self.device!r}"] + self.head_code() + [
            f"check(head, {self.plan.code()}, rows={self.rows}, vocab={self.vocab}, seed={self.seed}, "
            f"device=device{f', layout={self.layout!r}' if self.layout else ''}"
            f"{f', regime={self.regime!r}' if self.regime != 'randn' else ''})"])


def build_head(case: Case) -> lcg.HeadLoss:
    namespace: dict[str, Any] = {"lcg": lcg, "S": S, "P": P, "torch": torch, "math": math, "device": case.device}
    exec("\n".join(case.head_code()), namespace)
    return namespace["head"]


_BUILTIN_TERMS = [  # (code, needs): needs in {"teacher", "topk", "policy", "segments"}
    ("lcg.CrossEntropy(label_smoothing={ls})", ()), ("lcg.ZLoss(weight=0.01)", ()), ("lcg.Entropy(weight={w})", ()),
    ("lcg.LogProb()", ()), ("lcg.ForwardKL(temperature={T})", ("teacher",)),
    ("lcg.ReverseKL(temperature={T})", ("teacher",)), ("lcg.JSD(beta={b}, temperature={T})", ("teacher",)),
    ("lcg.TopKForwardKL(temperature={T})", ("topk",)), ("lcg.GRPO(kl_beta={kb}, eps_low={el}, eps_high={eh})", ("policy",)),
    ("lcg.CISPO()", ("policy",)), ("lcg.SAPO()", ("policy",)), ("lcg.RefKL()", ("policy",)),
    ("lcg.GSPO()", ("policy", "segments")),
]
_BUILTIN_METRICS = [("lcg.Entropy()", ()), ("lcg.TokenAccuracy()", ()), ("lcg.LogProb()", ()),
                    ("lcg.RatioMean()", ("policy",)), ("lcg.KLNewOld()", ("policy",)),
                    ("lcg.ClipFraction()", ("policy",))]


# the preference terms (losscodegen/preference.py), on their inputs' layout: "pairs" (DPO, CPO, SimPO,
# ORPO, ChosenNLL: a pair's chosen and rejected rows one segment) or "sequences" (KTO: one a sequence)
_PAIR_LOSSES = ["P.DPO(loss_type={dpo!r}, beta={beta}{dpo_options})", "P.CPO(loss_type={cpo!r}, beta={beta})",
                "P.SimPO(beta={simpo_beta})", "P.ORPO(beta={beta})", "P.ChosenNLL(weight=0.5)"]
_PAIR_STATISTICS = ["*P.pair_statistics()", "*P.cpo_statistics(loss_type={cpo!r})"]
_SEQUENCE_LOSSES = ["P.KTO(loss_type={kto!r}, beta={beta}, kl={kl})"]
_SEQUENCE_STATISTICS = ["*P.sequence_statistics()"]


def _preference(gen: Generator, layout: str) -> list[TermSpec]:
    """One or two preference losses of ``layout`` (and, at times, their statistics: weight-0 terms)."""
    r = gen.rng
    dpo = r.choice([t for t in P.DPO_LOSS_TYPES if t != "sft"])
    options = ""
    if dpo in ("exo_pair", "robust"):
        options += ", label_smoothing=0.1"
    if dpo in ("sigmoid", "hinge", "ipo") and r.random() < 0.5:
        options += f", f_divergence_type={r.choice(['forward_kl', 'js_divergence', 'alpha_divergence'])!r}"
        options += ", f_alpha_divergence_coef=0.5" if "alpha" in options else ""
    if r.random() < 0.2 and not dpo.startswith("aot"):   # (aot sorts the pairs: TRL refuses WPO with it)
        options += ", use_weighting=True"   # WPO: a vocabulary sum inside the segment sums
    losses, statistics = (_PAIR_LOSSES, _PAIR_STATISTICS) if layout == "pairs" else (_SEQUENCE_LOSSES, _SEQUENCE_STATISTICS)
    picked = list(dict.fromkeys(r.choice(losses) for _ in range(r.choice([1, 1, 2]))))
    if r.random() < 0.3:
        picked.append(r.choice(statistics))
    fill = dict(dpo=dpo, dpo_options=options, cpo=r.choice(["sigmoid", "hinge", "ipo", "simpo"]),
                beta=r.choice([0.1, 0.5, 0.0, _TENSOR.format(0.0)]), simpo_beta=r.choice([0.5, 2.0, 0.0]),
                kto=r.choice(["kto", "apo_zero_unpaired"]), kl=r.choice(["0.0", _TENSOR.format(0.05)]))
    return [TermSpec(code.format(**fill)) for code in picked]


def _builtin(gen: Generator, table, metric: bool) -> TermSpec | None:
    code, needs = gen.pick(table)
    if ("teacher" in needs and not gen.teacher) or ("topk" in needs and not gen.topk) or \
            ("segments" in needs and not gen.segments):
        return None
    r = gen.rng
    # a tensor temperature (read relative to the row maxima) for the KLs; JSD refuses one
    # (and at their edges: temperatures near 0 and large, a clip bound of 0, JSD's endpoints, a
    # tensor at 0)
    temperatures = [1.0, 2.0, 0.7, 0.05, 20.0] + ([_TENSOR.format(1.5), _TENSOR.format(0.05)]
                                                  if "JSD" not in code else [])
    code = code.format(ls=r.choice([0.0, 0.1, _TENSOR.format(0.0)]), w=r.choice([0.5, 1.0]), T=r.choice(temperatures),
                       b=r.choice([0.3, 0.5, 0.0, 1.0]), kb=r.choice([0.0, 0.04, _TENSOR.format(0.0)]),
                       el=r.choice([0.2, 0.0]), eh=r.choice([0.2, 0.28, 0.0]))
    return TermSpec(code, metric=metric)


def _row_of_segments(code: str) -> bool:
    """Whether a formula is a row term that reads segment statistics (GSPO-token's kind)."""
    try:
        formula = sp.sympify(eval(code, {"S": S}))
    except Exception:   # refused when the head is built, where the fuzzer tells a refusal from a crash
        return False
    return formula.has(S.segment_mean) and _reads_rows(formula)


def _declared(gen: Generator, i: int, metric: bool) -> TermSpec:
    r = gen.rng
    u = r.random()
    if gen.segments and not metric and u < 0.15:
        kind = r.random()
        if kind < 0.35:
            formula = _leaf(gen.pick(_SEGMENT_TERMS))
        elif kind < 0.65:
            formula = Node(gen.pick(_SEGMENT_OF_ROW), (gen.row(1),))
        else:
            formula = Node(gen.pick(_ROW_OF_SEGMENT), (gen.row(1),))
    elif u < 0.2:
        formula = _leaf(_LOGIT_NORM)
    else:
        formula = gen.row(r.choice([1, 2, 2, 3]))
    params = []
    code = formula.code()
    if "S.param('tau')" in code:
        params.append(f"tau={r.choice(['0.04', '0.5'])}")   # in an exponent: a number
    if "S.param('c')" in code:   # (at 0: the formula's limit, or refused naming c where it has none)
        params.append(f"c={r.choice(['0.7', '-1.3', _TENSOR.format(0.4), '0.0', _TENSOR.format(0.0)])}")
    if "S.param('g')" in code:   # an exponent: 0 and large too, as a number (folded) and a tensor
        params.append(f"g={r.choice(['2.0', '0.5', '0.0', '40.0', _TENSOR.format(2.0), _TENSOR.format(0.0)])}")
    if "S.param('T')" in code:   # a temperature: a number, or a tensor known at run time
        params.append(f"T={r.choice(['0.8', _TENSOR.format(0.8), _TENSOR.format(2.5)])}")
    if "S.param('k')" in code:
        params.append(f"k={r.choice(['1.0', '0.5', '2.0'])}")   # in an exponent: a number (it decides the plan)
    if not metric:
        weight = r.choice(["1.0", "0.3", _TENSOR.format(0.8)])
        params.insert(0, f"weight={weight}")
        if _row_of_segments(code):
            # normalize='sequence' for a third of them, decided by u (the draw that chose the formula: a
            # draw of their own would move every later case's); batch quantiles alone take tokens only
            if u < 0.05 and "row_quantile" not in code:
                params.append("normalize='sequence'")   # each segment's mean of its rows, over the segments
        elif r.random() < 0.15:
            params.append("normalize='sum'")
        elif gen.segments and r.random() < 0.2:
            params.append("normalize='sequence'")   # the mean over each segment's rows
    return TermSpec(", ".join(params), name=f"f{i}", formula=formula, metric=metric)


def generate_case(rng: random.Random, device: str = "cpu") -> Case:
    """A random head (1-3 terms, 0-2 metrics, declared and built in) with the plainest plan, its
    tensors on ``device``."""
    layout = rng.choice(["pairs", "sequences"]) if rng.random() < 0.12 else ""
    gen = Generator(rng, teacher=rng.random() < 0.4, topk=rng.random() < 0.3,
                    segments=bool(layout) or rng.random() < 0.15)
    specs: list[TermSpec] = _preference(gen, layout) if layout else []
    for metric, count in ((False, rng.choice([1, 1, 2, 3])), (True, rng.choice([0, 0, 1, 2]))):
        for _ in range(count):
            spec = _builtin(gen, _BUILTIN_METRICS if metric else _BUILTIN_TERMS, metric) \
                if rng.random() < 0.3 else None
            specs.append(spec or _declared(gen, len(specs), metric))
    # distinct names: a built-in twice keeps one
    seen, unique = set(), []
    for s in specs:
        key = s.name or s.code.split("(")[0]
        if key not in seen:
            seen.add(key)
            unique.append(s)
    if all(s.metric for s in unique):
        unique.insert(0, _declared(gen, len(unique), False))
    # (softcap=2.0 saturates on the spread regime's rows)
    options = rng.choice(["", "", "", "softcap=20.0", "logit_scale=0.5", "softcap=2.0"])
    regime = "randn" if rng.random() < 0.35 else rng.choice([r for r in REGIMES if r != "randn"])
    return Case(tuple(unique), Plan(), options, rows=12 if layout else rng.choice([7, 12]),
                vocab=rng.choice([40, 64, 61]), seed=rng.randrange(1000), device=device, layout=layout,
                regime=regime)


def plans(rng: random.Random, case: Case, *, compile_share: float = 0.0, sharded: bool = True,
          segments: bool = False, teacher: bool = False) -> list[Plan]:
    """The plans a case runs under: every reduction, forced tiles (several tiles a row, split
    launches), bf16, head.linear with chunks (and a teacher), vocab-parallel on 2 and 3 ranks.
    (``segments``: the head has segment terms, which have no per-row values: no reduction="none",
    refused at the call as the contract says.)"""
    none = "sum" if segments else "none"
    out = [Plan(), Plan(reduction="sum", tile=(16, 4, False)), Plan(reduction=none, tile=(16, 4, True)),
           Plan(dtype="bfloat16", tile=(32, 4, True), divisor=5.0),
           Plan(kind="linear", chunk_rows=rng.choice([3, 5]), tile=(16, 4, rng.random() < 0.5),
                reduction=rng.choice(["mean", none])),
           # the torch backend: one launch, split reads in blocks that do not divide the vocabulary
           Plan(backend="torch", reduction=rng.choice(["mean", none])),
           Plan(backend="torch", dtype="bfloat16", tile=(24, 4, True), reduction=rng.choice(["sum", none])),
           Plan(kind="linear", backend="torch", chunk_rows=rng.choice([3, 5]), reduction=rng.choice(["mean", none])),
           # the gradient over the logits: each value the gradient read needs is read before it is overwritten
           Plan(inplace=True, tile=(16, 4, rng.random() < 0.5), reduction=rng.choice(["mean", none]))]
    if sharded:
        V = case.vocab
        for world in (2, 3):
            if V % world == 0:
                out.append(Plan(kind="sharded", world=world, shards=(V // world,) * world,
                                reduction=rng.choice(["mean", "sum", none])))
            else:
                base = V // world
                out.append(Plan(kind="sharded", world=world,
                                shards=tuple(base + (r < V - base * world) for r in range(world))))
    if teacher:   # the teacher's own gradient (its second kernel), on either backend
        out += [Plan(teacher_grad=True, tile=(16, 4, rng.random() < 0.5), reduction=rng.choice(["mean", none])),
                Plan(teacher_grad=True, backend="torch", dtype=rng.choice(["float32", "bfloat16"]))]
    if rng.random() < compile_share:
        out.append(Plan(kind="compile", reduction=rng.choice(["mean", none])))
    return out


# ---- running a case ---------------------------------------------------------------------------------
class Mismatch(AssertionError):
    """A case whose output differs from the float64 reference (or that raised where it should not)."""


class Skip(Exception):
    """A case that is not a fair test: its reference is not finite or not well conditioned."""


class Refused(Exception):
    """A plan the head is refused under, with one clear error (``refused``) on every rank alike:
    the compiler's right, counted, not a mismatch."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _inputs(head: lcg.HeadLoss, case: Case, device: str):
    plan = case.plan
    logits, labels, kw = random_inputs(head, case.rows, case.vocab, _dtype(plan.dtype), device, case.seed,
                                       regime=case.regime)
    if case.layout and head.kernel.SPEC.segments:
        kw.update(_preference_inputs(head, case.layout, labels, kw))
    if plan.reduction != "mean":
        kw["reduction"] = plan.reduction
    if plan.divisor is not None:
        kw["divisor"] = plan.divisor
    return logits, labels, kw


def _preference_inputs(head, layout: str, labels: torch.Tensor, kw: dict) -> dict:
    """The preference terms' inputs as a user gets them (``P.pair_inputs`` / ``P.sequence_inputs``),
    for TRL's layout of the rows: [2B, T] (pair b: rows b and B + b) or [B, T], one sequence a row."""
    sequences = 2 if layout == "pairs" else 4
    shape = (sequences, labels.numel() // sequences)
    labels2, mask2 = labels.reshape(shape), kw["loss_mask"].reshape(shape)
    ref = kw.get("ref_logprobs")
    ref = None if ref is None else ref.reshape(shape)
    if layout == "pairs":
        given = P.pair_inputs(head, labels2, ref_logprobs=ref, ignore_index=head.ignore_index, loss_mask=mask2)
    else:
        desirable = torch.arange(sequences, device=labels.device) % 2 == 0
        given = P.sequence_inputs(head, labels2, desirable=desirable, ref_logprobs=ref,
                                  ignore_index=head.ignore_index, loss_mask=mask2)
    return {k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in given.items()}


def _reference(head, logits, labels, kw, up=None, precision: torch.dtype = torch.float64):
    """(loss, values, rows, dL/dlogits) in float64 (``precision=torch.float32``: plain torch's fp32
    of the same formulas); ``up``: upstream gradients (reduction="none"): on the per-row loss and
    on each term's rows."""
    ref = reference(head)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    x, out, values, rows = ref.evaluate(logits.cpu(), None if labels is None else labels.cpu(),
                                        precision=precision, **cpu)
    if kw.get("reduction") == "none":
        total = (out * up["loss"]).sum() + sum((rows[n] * g).sum() for n, g in up["rows"].items())
    else:
        total = out
    grad = torch.autograd.grad(total, x, allow_unused=True)[0] if total.requires_grad else None
    grad = torch.zeros_like(x) if grad is None else grad
    return out.detach(), values, {n: r.detach() for n, r in rows.items()}, grad.reshape(logits.shape)


def _teacher_gradient(head, logits, labels, kw, up, precision: torch.dtype = torch.float64) -> torch.Tensor:
    """dL/dteacher_logits of the reference (autograd through the teacher as a float64 leaf) in
    ``precision`` (float32: plain torch's)."""
    t = kw["teacher_logits"].detach().double().cpu().requires_grad_()
    cpu = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    _, out, _, rows = reference(head).evaluate(logits.cpu(), None if labels is None else labels.cpu(),
                                               precision=precision, **{**cpu, "teacher_logits": t})
    total = (out * up["loss"]).sum() + sum((rows[n] * g).sum() for n, g in up["rows"].items()) \
        if kw.get("reduction") == "none" else out
    grad = torch.autograd.grad(total, t, allow_unused=True)[0] if total.requires_grad else None
    return torch.zeros_like(t) if grad is None else grad


def _upstream(head, labels_shape, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    terms = [t.name for t in head.loss_terms if not t.formula.has(S.segment_mean) and t.normalize != "sequence"]
    return {"loss": torch.randn(labels_shape, generator=g, dtype=torch.float64),
            "rows": {n: torch.randn(labels_shape, generator=g, dtype=torch.float64) for n in terms[:2]}}


def _screen(head, logits, labels, kw, up, want, dtype, regime: str = "randn") -> None:
    """Skip a case whose reference is not finite, is huge, or moves by more than an eighth of the
    tolerance when the inputs move by a few fp32 ulps (a near tie at a kink, a cancellation). A case
    of another regime than ``randn`` means its infinities and huge values (the oracle, plain torch
    fp32, decides there): only the last is screened, where the reference is finite."""
    loss, values, rows, grad = want
    everything = [loss, grad, *values.values(), *rows.values()]
    if regime == "randn":
        if not all(torch.isfinite(t).all() for t in everything):
            raise Skip("reference not finite")
        if max(float(t.abs().max()) if t.numel() else 0.0 for t in everything) > 1e5:
            raise Skip("reference too large")
    g = torch.Generator().manual_seed(7)

    def jiggle(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return t.detach().double().cpu() * (1 + 4 * 2.0**-24 * torch.randn(t.shape, generator=g, dtype=torch.float64))
    kw2 = {k: (jiggle(v) if k in ("teacher_logits",) or k in head.kernel.SPEC.tokens else v) for k, v in kw.items()}
    other = _reference(head, jiggle(logits), labels, kw2, up)
    rtol, atol, gtol = TOLERANCES[dtype]
    tight = (rtol / 8, atol / 8, gtol / 8)

    def finite(a, b):   # (the elements where both are finite: infinities are the oracle's to judge)
        keep = torch.isfinite(a) & torch.isfinite(b)
        return a.masked_fill(~keep, 0.0), b.masked_fill(~keep, 0.0)
    try:
        compare("loss", *finite(other[0], loss), dtype, tolerances=tight)
        for name in values:
            compare(name, *finite(other[1][name], values[name]), dtype, tolerances=tight)
        compare("gradient", *finite(other[3], grad), dtype, tolerances=tight)
    except AssertionError as e:
        raise Skip(f"ill-conditioned: {e}") from None


def check(head: lcg.HeadLoss, plan: Plan, *, rows: int = 12, vocab: int = 64, seed: int = 0,
          device: str = "cpu", layout: str = "", regime: str = "randn", ranks: "Ranks | None" = None) -> None:
    """Run ``head`` under ``plan`` on random inputs drawn in ``regime`` (``testing.REGIMES``) and
    compare loss, terms, metrics, rows and the gradient with the float64 reference, plain torch fp32
    as the yardstick. Raises ``Mismatch`` naming what differs, ``Skip`` for a case that is no fair
    test. ``ranks``: a running pool of gloo ranks for a sharded plan (one is started for the call
    otherwise)."""
    case = Case((), plan, rows=rows, vocab=vocab, seed=seed, layout=layout, regime=regime)
    if plan.backend or plan.inplace:
        head = lcg.HeadLoss(*head.loss_terms, metrics=head.metric_terms, ignore_index=head.ignore_index,
                            logit_scale=head.logit_scale, softcap=head.softcap, backend=plan.backend or "auto",
                            inplace_backward=plan.inplace)
    dtype = _dtype(plan.dtype)
    logits, labels, kw = _inputs(head, case, device)
    shape = labels.shape if labels is not None else logits.shape[:-1]
    up = _upstream(head, shape, seed)
    if plan.kind == "linear":
        return _check_linear(head, plan, logits, labels, kw, up, device, seed, regime)
    want = _reference(head, logits, labels, kw, up)
    _screen(head, logits, labels, kw, up, want, dtype, regime)
    if plan.kind == "sharded":
        own = ranks is None
        ranks = ranks or Ranks(plan.world)
        try:
            got = ranks.run(plan, head, logits, labels, kw, up)
        finally:
            if own:
                ranks.close()
    else:
        if plan.teacher_grad:
            teacher = kw["teacher_logits"].clone().requires_grad_()
            kw = {**kw, "teacher_logits": teacher}
        got = _run_here(head, plan, logits, labels, kw, up)
    _compare(head, plan, got, want, dtype, _reference(head, logits, labels, kw, up, torch.float32))
    if plan.teacher_grad and head.loss_terms:
        got_t = teacher.grad if teacher.grad is not None else torch.zeros_like(teacher)
        try:
            compare("gradient of teacher_logits", got_t, _teacher_gradient(head, logits, labels, kw, up), dtype,
                    where=f"({plan.code()})", plain=_teacher_gradient(head, logits, labels, kw, up, torch.float32),
                    floor=gradient_floor(want[0]))
        except AssertionError as e:
            raise Mismatch(str(e)) from None


def _forced(head, plan: Plan, logits: torch.Tensor) -> Any:
    """The head's backend configuration for this call with the plan's tile and split forced (a
    dataclass: each field the backend's configuration has of ``block_v``, ``num_warps``, ``split``),
    or None: the runtime's own choice."""
    if plan.tile is None:
        return None
    config = head.backend.config(head, head.kernel, logits.shape[-1], logits.dtype, logits.device,
                                 sharded=plan.kind == "sharded")
    forced = dict(zip(("block_v", "num_warps", "split"), plan.tile))
    names = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(config, **{k: v for k, v in forced.items() if k in names})


def _run_here(head, plan: Plan, logits, labels, kw, up):
    """(loss, values, rows, dL/dlogits) of one call in this process."""
    head.tile_override = _forced(head, plan, logits)
    x = logits.clone().requires_grad_()
    try:
        if plan.kind == "compile":
            torch._dynamo.reset()

            def step(x, labels, kw):
                out = head(x, labels, **kw)
                return out.loss, out.terms, out.metrics, out.rows
            loss, terms, metrics, rows = torch.compile(step, fullgraph=True, backend="aot_eager")(x, labels, kw)
            values = {**terms, **metrics}
        else:
            # (inplace: a copy of the leaf, which the gradient overwrites)
            out = head(x * 1.0 if plan.inplace else x, labels, **kw)
            loss, values, rows = out.loss, {**out.terms, **out.metrics}, out.rows
        _backward(head, plan, x, loss, rows, up)
    finally:
        head.tile_override = None
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return loss.detach(), {n: v.detach() for n, v in values.items()}, \
        {n: r.detach() for n, r in (rows or {}).items()}, grad


def _backward(head, plan: Plan, x, loss, rows, up) -> None:
    if not head.loss_terms or not loss.requires_grad:
        return
    if plan.reduction == "none":
        total = (loss * up["loss"].to(loss)).sum()
        for name, g in up["rows"].items():
            total = total + (rows[name] * g.to(loss)).sum()
    else:
        total = loss
    total.backward()


def _compare(head, plan: Plan, got, want, dtype, plain) -> None:
    """``testing.compare`` of each output, ``plain`` (the same outputs of plain torch fp32) the yardstick."""
    g_loss, g_values, g_rows, g_grad = got
    w_loss, w_values, w_rows, w_grad = want
    p_loss, p_values, p_rows, p_grad = plain
    where = f"({plan.code()})"
    try:
        compare("loss", g_loss, w_loss, dtype, where=where, plain=p_loss)
        for name, value in w_values.items():
            compare(name, g_values[name], value, dtype, where=where, plain=p_values[name])
        if plan.reduction == "none":
            for name, value in w_rows.items():
                compare(f"rows[{name!r}]", g_rows[name], value, dtype, where=where, plain=p_rows[name])
        if head.loss_terms and g_grad is not None:
            compare("gradient", g_grad, w_grad, dtype, where=where, plain=p_grad, floor=gradient_floor(w_loss))
    except AssertionError as e:
        raise Mismatch(str(e)) from None


def _check_linear(head, plan: Plan, logits, labels, kw, up, device, seed, regime: str = "randn") -> None:
    """head.linear on hidden, weight (and a teacher's), fp32: against the reference on their logits,
    the gradients of hidden and weight from its dL/dlogits. Outside the ``randn`` regime the hidden
    states carry the regime's logits through an identity block of the weight (plus a small random
    part): a saturated row reaches head.linear as it is, where one non-finite gradient would
    poison the whole dW."""
    g = torch.Generator().manual_seed(seed + 2)
    R, V, H = logits.shape[0], logits.shape[1], 8
    hidden = torch.randn(R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    if regime != "randn":
        eye = torch.eye(V, dtype=torch.float64)
        hidden = torch.cat([logits.double().nan_to_num(neginf=-1e4), 0.1 * hidden], 1)
        weight = torch.cat([eye, 0.1 * weight], 1)
    lin_kw = dict(kw)
    if "teacher_logits" in kw:
        th = torch.randn(R, H, generator=g, dtype=torch.float64)
        tw = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
        kw = {**kw, "teacher_logits": (th @ tw.T).float()}
        lin_kw.pop("teacher_logits")
        lin_kw.update(teacher_hidden=th.float().to(device), teacher_weight=tw.float().to(device))
    z = (hidden.float().double() @ weight.float().double().T).float()
    want = _reference(head, z, labels, kw, up)
    _screen(head, z, labels, kw, up, want, torch.float32, regime)
    head.tile_override = _forced(head, plan, z)
    h, w = hidden.float().to(device).requires_grad_(), weight.float().to(device).requires_grad_()
    try:
        out = head.linear(h, w, labels, chunk_rows=plan.chunk_rows, **lin_kw)
        _backward(head, plan, h, out.loss, out.rows, up)
    finally:
        head.tile_override = None
    plain = _reference(head, z, labels, kw, up, torch.float32)
    got = (out.loss.detach(), {**out.terms, **out.metrics}, out.rows or {}, None)
    _compare(head, dataclasses.replace(plan), got, want, torch.float32, plain)
    if head.loss_terms:
        where = f"({plan.code()})"
        G, P32 = want[3].double(), plain[3].double()
        W, Hd = weight.float().double(), hidden.float().double()
        # (a dL/dlogits that cancels to 0 keeps the rounding of its parts, gradient_floor; the products
        # carry it times the other factor's largest column sum: the regimes' hidden states are large)
        floor = gradient_floor(want[0])
        for name, t, ref, torch_fp32, scale in (("gradient of hidden", h, G @ W, P32 @ W, W.abs().sum(0).max()),
                                                ("gradient of weight", w, G.T @ Hd, P32.T @ Hd, Hd.abs().sum(0).max())):
            grad = (t.grad if t.grad is not None else torch.zeros_like(t)).cpu()
            try:
                compare(name, grad, ref, torch.float32, where=where, plain=torch_fp32, floor=floor * float(scale))
            except AssertionError as e:
                raise Mismatch(str(e)) from None


# ---- vocab-parallel ranks -------------------------------------------------------------------------------
class Ranks:
    """``world`` gloo ranks in spawned processes, kept between cases: each gets the head (pickled),
    runs its columns of the logits, and returns (loss, values, rows, its gradient shard), or the
    error it raised."""

    def __init__(self, world: int, timeout: float = 300.0) -> None:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, plan: Plan, head, logits, labels, kw, up):
        bounds = [0]
        for w in plan.shards:
            bounds.append(bounds[-1] + w)
        for r in range(self.world):
            cols = slice(bounds[r], bounds[r + 1])
            skw = dict(kw)
            if "teacher_logits" in kw:
                skw["teacher_logits"] = kw["teacher_logits"][:, cols].contiguous()
            self.jobs[r].put((pickle.dumps(head), logits[:, cols].contiguous(), labels, skw, up))
        results = {}
        deadline = time.monotonic() + self.timeout
        while len(results) < self.world:
            try:
                rank, result = self.results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue_mod.Empty:
                self.close()
                raise Mismatch(f"vocab-parallel on {self.world} ranks ({plan.code()}): no answer from ranks "
                               f"{sorted(set(range(self.world)) - set(results))} in {self.timeout:.0f} s (a hang)")
            results[rank] = result
        errors = {r: res for r, res in results.items() if isinstance(res, dict)}
        if errors:
            messages = {res["error"] for res in errors.values()}
            if len(errors) == self.world and len(messages) == 1 and all(res["refused"] for res in errors.values()):
                raise Refused(f"vocab-parallel ({plan.code()}): {messages.pop()}")   # alike on every rank
            raise Mismatch(f"vocab-parallel ({plan.code()}): "
                           + "; ".join(f"rank {r}: {errors[r]['error'] if r in errors else 'a value'}"
                                       for r in sorted(results)))
        losses = [results[r][0] for r in range(self.world)]
        for r in range(1, self.world):
            # (NaN on every rank alike is one value: a regime's row with no distribution)
            if not torch.equal(losses[r].nan_to_num(), losses[0].nan_to_num()) \
                    or not torch.equal(losses[r].isnan(), losses[0].isnan()):
                raise Mismatch(f"vocab-parallel ({plan.code()}): rank {r}'s loss {losses[r]} is not rank 0's {losses[0]}")
        loss, values, rows, _ = results[0]
        grad = torch.cat([results[r][3] for r in range(self.world)], -1)
        return loss, values, rows, grad

    def close(self) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def nan_workspaces() -> None:
    """Every call's workspace starts as NaN, not as whatever memory held: a launch that reads a slot
    nothing wrote gives NaN, which no comparison passes (tests/conftest.py does the same)."""
    from . import launch
    launch.workspace = lambda size, device: torch.full((size,), float("nan"), device=device)


def _rank_main(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist
    nan_workspaces()
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        job = jobs.get()
        if job is None:
            break
        head, logits, labels, kw, up = job
        try:
            head = pickle.loads(head)
            x = logits.clone().requires_grad_()
            out = head(x, labels, process_group=dist.group.WORLD, **kw)
            plan = Plan(reduction=kw.get("reduction", "mean"))
            _backward(head, plan, x, out.loss, out.rows, up)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            results.put((rank, (out.loss.detach(), {**out.terms, **out.metrics},
                                {n: r.detach() for n, r in (out.rows or {}).items()}, grad)))
        except Exception as e:   # the same refusal on every rank is one; compared by the parent
            results.put((rank, {"error": f"{type(e).__name__}: {e}", "refused": refused(e)}))
    dist.destroy_process_group()


# ---- shrinking and printing ---------------------------------------------------------------------------
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def refused(e: Exception) -> bool:
    """Whether an error raised while a head is declared, built or generated is the compiler refusing
    it: a ValueError or TypeError raised by the package's declaring, lowering or planning code (a
    message naming the construct). A checks that emit.py runs on the generated file fails (a value
    read out of its scope, an interface the template does not keep), an error raised inside sympy,
    or any other exception: the compiler's own bug, a mismatch."""
    if not isinstance(e, (ValueError, TypeError)):
        return False
    frames = traceback.extract_tb(e.__traceback__)
    origin = os.path.abspath(frames[-1].filename) if frames else ""
    return origin.startswith(_PACKAGE + os.sep) and not (
        origin == os.path.join(_PACKAGE, "emit.py") or origin.startswith(os.path.join(_PACKAGE, "backends") + os.sep))


def sympy_builds(case: Case) -> bool:
    """Whether sympy itself builds each declared formula of ``case``, before losscodegen sees it.
    Its constructors can fail on what the grammar writes (found by the H200 fuzz run: a Piecewise
    whose condition compares another Piecewise, ``KeyError: 'pop from an empty set'`` inside
    sympy's rewrite of the condition): no formula a user can write, so no test of the compiler."""
    try:
        for t in case.terms:
            if t.formula is not None:
                eval(t.formula.code(), {"S": S})
    except Exception:
        return False
    return True


def _fails(case: Case, ranks: dict) -> str | None:
    """The mismatch's message if ``case`` still fails (a mismatch, or an error other than a refusal
    at declaration or construction: a shrink step that left the language)."""
    if not sympy_builds(case):
        return None
    try:
        head = build_head(case)
        head.kernel
    except Exception as e:
        return None if refused(e) else f"{type(e).__name__}: {e}"   # refused, or the compiler crashed
    try:
        check(head, case.plan, rows=case.rows, vocab=case.vocab, seed=case.seed, device=case.device,
              layout=case.layout, regime=case.regime,
              ranks=ranks.get(case.plan.world) if case.plan.kind == "sharded" else None)
    except Mismatch as e:
        return str(e)
    except (Skip, Refused):
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _kind(message: str) -> str:
    """What failed (``gradient``, ``loss``, ``ValueError:``, ...): a shrink step keeps the failure's kind."""
    return message.split(" ", 1)[0]


def _smaller_formulas(node: Node) -> Iterator[Node]:
    """Each sub-formula replaced by one of its own sub-formulas of the same level (and sign), or
    by a leaf: smaller formulas first."""
    for sub in node.nodes():
        for inner in list(sub.nodes())[1:]:
            if inner.level == sub.level and (inner.pos or not sub.pos):
                yield node.replace(sub, inner)
        if sub.kids and sub.level == "row" and not sub.pos:
            yield node.replace(sub, _leaf("S.lse"))


def _smaller_cases(case: Case) -> Iterator[Case]:
    if len(case.terms) > 1:
        for i in range(len(case.terms)):
            rest = case.terms[:i] + case.terms[i + 1:]
            if any(not t.metric for t in rest):
                yield dataclasses.replace(case, terms=rest)
    for i, t in enumerate(case.terms):
        if t.formula is not None:
            for f in _smaller_formulas(t.formula):
                code = f.code()
                params = ", ".join(p for p in t.code.split(", ") if p and not (
                    (p.startswith("c=") and "S.param('c')" not in code)
                    or (p.startswith("g=") and "S.param('g')" not in code)
                    or (p.startswith("k=") and "S.param('k')" not in code)))
                yield dataclasses.replace(case, terms=case.terms[:i] + (dataclasses.replace(t, formula=f, code=params),)
                                          + case.terms[i + 1:])
    if case.head_options:
        yield dataclasses.replace(case, head_options="")
    if case.regime != "randn":
        yield dataclasses.replace(case, regime="randn")
    if case.layout:
        yield dataclasses.replace(case, layout="")
    plan = case.plan
    for simpler in (dict(reduction="mean"), dict(divisor=None), dict(dtype="float32"), dict(tile=None),
                    dict(chunk_rows=None)):
        p = dataclasses.replace(plan, **simpler)
        if p != plan:
            yield dataclasses.replace(case, plan=p)
    if plan.tile and plan.tile[2]:
        yield dataclasses.replace(case, plan=dataclasses.replace(plan, tile=(plan.tile[0], plan.tile[1], False)))
    if case.rows > 3:
        yield dataclasses.replace(case, rows=max(case.rows // 2, 3))


def shrink(case: Case, *, ranks: dict | None = None, budget: int = 60) -> tuple[Case, str]:
    """The smallest case found, by greedy steps that keep it failing (on the case's device), and its
    message (at most ``budget`` checks)."""
    ranks = ranks or {}
    message = _fails(case, ranks) or "no longer fails"
    tries = 0
    improved = True
    while improved and tries < budget:
        improved = False
        for smaller in _smaller_cases(case):
            tries += 1
            found = _fails(smaller, ranks)
            if found is not None and _kind(found) == _kind(message):
                case, message, improved = smaller, found, True
                break
            if tries >= budget:
                break
    return case, message


def regression_test(case: Case, message: str, name: str = "") -> str:
    """A pytest test that fails while the mismatch is there."""
    name = name or f"fuzz_case_{abs(hash(case.code())) % 10**8}"
    body = "\n".join("    " + line for line in case.code().splitlines())
    comment = "\n".join("    # " + line for line in message.splitlines()[:3])
    return (f"def test_{name}():\n{comment}\n    import torch\n    import losscodegen as lcg\n"
            f"    from losscodegen import symbols as S\n    from losscodegen.fuzz import Plan, check\n{body}\n")


def _report(case: Case, message: str, counts: "Counts", ranks: dict, budget: int, out) -> None:
    small, found = shrink(case, ranks=ranks, budget=budget)
    test = regression_test(small, found if found != "no longer fails" else message)
    counts.mismatches.append(test)
    out(f"MISMATCH: {message.splitlines()[0]}\n{test}")


# ---- the loop ---------------------------------------------------------------------------------------------
@dataclass
class Counts:
    formulas: int = 0
    heads: int = 0
    plans: int = 0
    skipped: int = 0
    refused: int = 0
    refused_plans: int = 0
    unbuilt: int = 0     # cases with a formula that sympy cannot build (``sympy_builds``)
    mismatches: list[str] = field(default_factory=list)
    regimes: dict[str, int] = field(default_factory=dict)   # plans checked in each input regime

    def __str__(self) -> str:
        return (f"formulas {self.formulas}, heads {self.heads}, plans {self.plans} "
                f"(skipped {self.skipped}, refused heads {self.refused}, refused plans {self.refused_plans}, "
                f"not built by sympy {self.unbuilt}), "
                f"mismatches {len(self.mismatches)}; plans by regime "
                f"{', '.join(f'{r} {n}' for r, n in sorted(self.regimes.items())) or 'none'}")


def fuzz(*, seconds: float = 60.0, seed: int = 0, device: str = "cpu", cases: int | None = None,
         sharded: bool = True, compile_share: float = 0.02, shrink_budget: int = 60, stall_seconds: float = 300.0,
         out=print) -> Counts:
    """Random cases until ``seconds`` pass (or ``cases`` heads are tried); each mismatch shrunk and
    printed as a regression test; a head still running after ``stall_seconds`` printed with where
    the fuzzer is (``_watched``). Returns the counts."""
    with warnings.catch_warnings():
        # (the interpreter's numpy warns of the inf and NaN the kernels mean to compute)
        warnings.simplefilter("ignore")
        return _fuzz(seconds, seed, device, cases, sharded, compile_share, shrink_budget, stall_seconds, out)


@contextlib.contextmanager
def _watched(case: Case, seconds: float, out) -> Iterator[None]:
    """Prints ``case`` as a test, and where the fuzzer's thread is, once it has run ``seconds`` (a
    stall prints no mismatch: found on the H200, a run whose log stopped at 7 minutes with its
    process running 10 minutes later, and nothing said which head it was on)."""
    main = threading.get_ident()

    def report() -> None:
        frame = sys._current_frames().get(main)
        where = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else ""
        out(f"STALL: one head for {seconds:.0f} s so far\n{regression_test(case, 'a stall')}\n{where}")
    timer = threading.Timer(seconds, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _fuzz(seconds, seed, device, cases, sharded, compile_share, shrink_budget, stall_seconds, out) -> Counts:
    nan_workspaces()
    if device != "cpu" and sharded:
        # (the ranks are gloo processes on the CPU, each running Triton's interpreter)
        out("vocab-parallel plans run on the CPU only: left out on this device")
        sharded = False
    rng = random.Random(seed)
    counts = Counts()
    ranks: dict[int, Ranks] = {}
    start = reported = time.monotonic()
    try:
        while time.monotonic() - start < seconds and (cases is None or counts.heads < cases):
            if time.monotonic() - reported > 60:
                reported = time.monotonic()
                out(f"{(reported - start) / 60:.1f} min: {counts}")
            case = generate_case(rng, device)
            if not sympy_builds(case):
                counts.unbuilt += 1
                continue
            with _watched(case, stall_seconds, out):
                _try(case, rng, device, sharded, compile_share, shrink_budget, counts, ranks, out)
    finally:
        for r in ranks.values():
            r.close()
    out(str(counts))
    return counts


def _try(case: Case, rng: random.Random, device: str, sharded: bool, compile_share: float, shrink_budget: int,
         counts: Counts, ranks: dict[int, Ranks], out) -> None:
    """Builds one case's head and checks it under random plans, adding to ``counts``; the first
    mismatch of a head is shrunk and printed (its later plans would only repeat it)."""
    counts.formulas += sum(t.formula is not None for t in case.terms)
    try:
        head = build_head(case)
        head.kernel   # generated now: a refusal at generation counts as one
    except Exception as e:
        if refused(e):
            counts.refused += 1
            return
        counts.heads += 1     # the compiler crashed on a head it accepted
        _report(case, f"{type(e).__name__}: {e}", counts, ranks, shrink_budget, out)
        return
    counts.heads += 1
    for plan in plans(rng, case, compile_share=compile_share, sharded=sharded,
                      segments=bool(head.kernel.SPEC.segments), teacher=head.kernel.SPEC.uses_teacher):
        if plan.kind == "sharded" and plan.world not in ranks:
            ranks[plan.world] = Ranks(plan.world)
        planned = dataclasses.replace(case, plan=plan)
        counts.plans += 1
        try:
            check(head, plan, rows=case.rows, vocab=case.vocab, seed=case.seed, device=device,
                  layout=case.layout, regime=case.regime, ranks=ranks.get(plan.world))
            counts.regimes[case.regime] = counts.regimes.get(case.regime, 0) + 1
        except Skip:
            counts.skipped += 1
            return      # the same inputs under every plan: no plan of this head is a fair test
        except Refused:
            counts.refused_plans += 1
        except Exception as e:
            if plan.kind == "sharded" and isinstance(e, Mismatch) and "a hang" in str(e):
                ranks.pop(plan.world, None)
            message = str(e) if isinstance(e, Mismatch) else \
                f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            _report(planned, message, counts, ranks, shrink_budget, out)
            return
