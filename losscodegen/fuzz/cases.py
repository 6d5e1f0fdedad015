"""The fuzzer's cases: a head's terms (declared from random formulas, built in, preference losses),
the plans it runs under, and the head built from them (``build_head``), printable as a test."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable

import sympy as sp
import torch

import losscodegen as lcg
from .. import preference as P
from .. import symbols as S
from ..terms import reads_rows
from ..testing import REGIMES
from .grammar import _logit_norm, _ROW_OF_SEGMENT, _SEGMENT_OF_ROW, _SEGMENT_TERMS, Generator, Node, leaf


@dataclass(frozen=True)
class Tensor:
    """A tensor weight or parameter of a case, created on the case's device (``device``, a name of
    the printed test)."""

    value: float

    def __repr__(self) -> str:
        return f"torch.tensor({self.value!r}, device=device)"

    def make(self, device: str) -> torch.Tensor:
        return torch.tensor(self.value, device=device)


def _value(v: Any, device: str) -> Any:
    return v.make(device) if isinstance(v, Tensor) else v


def _keywords(keywords: tuple[tuple[str, Any], ...]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in keywords)


def _printed_name(fn: Callable) -> str:
    """``lcg.X`` or ``P.X``: how a printed test names a constructor (a term factory or a function)."""
    for prefix, module in (("lcg", lcg), ("P", P)):
        for name in module.__all__:
            if getattr(module, name) is fn:
                return f"{prefix}.{name}"
    raise ValueError(f"factory: {fn!r} is neither losscodegen's nor losscodegen.preference's")


@dataclass(frozen=True)
class TermSpec:
    """A term of a case: a declared formula (``formula`` set, declared as ``name``) or a built-in
    (``factory``, called; ``star``: a function returning several terms), with its keywords."""

    keywords: tuple[tuple[str, Any], ...] = ()
    name: str = ""
    formula: Node | None = None
    metric: bool = False
    factory: Callable | None = None
    star: bool = False

    @classmethod
    def declared(cls, name: str, formula: Node, *, metric: bool = False, **keywords: Any) -> "TermSpec":
        return cls(tuple(keywords.items()), name=name, formula=formula, metric=metric)

    @classmethod
    def builtin(cls, factory: Callable, *, metric: bool = False, star: bool = False, **keywords: Any) -> "TermSpec":
        return cls(tuple(keywords.items()), metric=metric, factory=factory, star=star)

    @property
    def key(self) -> str:
        """Its name in the head (a built-in twice is one term)."""
        return self.name or ("*" if self.star else "") + _printed_name(self.factory)

    def lines(self, i: int) -> list[str]:
        if self.formula is None:
            return []
        return [f"T{i} = lcg.declare_term({self.name!r}, {self.formula.code()})"]

    def call(self, i: int) -> str:
        if self.formula is not None:
            return f"T{i}({_keywords(self.keywords)})"
        return f"{'*' if self.star else ''}{_printed_name(self.factory)}({_keywords(self.keywords)})"

    def make(self, declared: Any, device: str) -> list:
        """The head's terms (``declared``: the term factory ``declare_term`` made of the formula)."""
        made = (declared or self.factory)(**{k: _value(v, device) for k, v in self.keywords})
        return list(made) if self.star else [made]


@dataclass(frozen=True)
class Plan:
    """How the runtime computes a case. ``kind``: "call" (``head(logits, ...)``), "linear"
    (``head.linear``, ``chunk_rows``; the teacher's hidden and weight too where the head reads a
    teacher), "sharded" (``world`` gloo ranks holding ``shards`` columns
    each), "compile" (``torch.compile`` of a call). ``tile``: a forced ``(block_v, num_warps, split)``
    (None: the runtime's own choice). ``backend``: the head built on that backend ("": the head's own).
    ``inplace``: the head built with ``inplace_backward=True`` (the gradient written over the logits).
    ``teacher_grad``: teacher logits that require grad (co-distillation), their gradient checked too.
    ``slices``: the row-slices kernel forced, its slices at most ``(columns, copy_bytes)`` a thread's
    chunk (one warp: chunks of 64 columns)."""

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
    slices: tuple[int, int] | None = None

    def code(self) -> str:
        fields_ = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Plan({', '.join(fields_)})"


@dataclass(frozen=True)
class Case:
    """A head's terms, a plan, the inputs' sizes and seed, and the device it runs on: its tensor
    weights and parameters are created there, as the logits are (a printed test names it)."""

    terms: tuple[TermSpec, ...]
    plan: Plan = Plan()
    head_options: tuple[tuple[str, Any], ...] = ()     # e.g. (("softcap", 20.0),)
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
            ([_keywords(self.head_options)] if self.head_options else [])
        return lines + [f"head = lcg.HeadLoss({', '.join(args)})"]

    def code(self) -> str:
        return "\n".join([f"device = {self.device!r}"] + self.head_code() + [
            f"check(head, {self.plan.code()}, rows={self.rows}, vocab={self.vocab}, seed={self.seed}, "
            f"device=device{f', layout={self.layout!r}' if self.layout else ''}"
            f"{f', regime={self.regime!r}' if self.regime != 'randn' else ''})"])


def build_head(case: Case) -> lcg.HeadLoss:
    """The head ``case.head_code()`` writes, built from the case's objects: its formulas declared
    first, then each term made, in order."""
    declared = {i: lcg.declare_term(t.name, t.formula.expr()) for i, t in enumerate(case.terms)
                if t.formula is not None}
    made = [(t.metric, t.make(declared.get(i), case.device)) for i, t in enumerate(case.terms)]
    metrics = [term for metric, terms in made if metric for term in terms]
    return lcg.HeadLoss(*(term for metric, terms in made if not metric for term in terms),
                        **({"metrics": tuple(metrics)} if metrics else {}), **dict(case.head_options))


# the built-in terms and metrics: (constructor, its keywords from the drawn parameters, needs), needs
# in {"teacher", "topk", "policy", "segments"}
_NONE: Callable[[dict], dict] = lambda d: {}   # noqa: E731
_BUILTIN_TERMS = [
    (lcg.CrossEntropy, lambda d: dict(label_smoothing=d["ls"]), ()), (lcg.ZLoss, lambda d: dict(weight=0.01), ()),
    (lcg.Entropy, lambda d: dict(weight=d["w"]), ()), (lcg.LogProb, _NONE, ()),
    (lcg.ForwardKL, lambda d: dict(temperature=d["T"]), ("teacher",)),
    (lcg.ReverseKL, lambda d: dict(temperature=d["T"]), ("teacher",)),
    (lcg.JSD, lambda d: dict(beta=d["b"], temperature=d["T"]), ("teacher",)),
    (lcg.TopKForwardKL, lambda d: dict(temperature=d["T"]), ("topk",)),
    (lcg.GRPO, lambda d: dict(kl_beta=d["kb"], eps_low=d["el"], eps_high=d["eh"]), ("policy",)),
    (lcg.CISPO, _NONE, ("policy",)), (lcg.SAPO, _NONE, ("policy",)), (lcg.RefKL, _NONE, ("policy",)),
    (lcg.GSPO, _NONE, ("policy", "segments")),
]
_BUILTIN_METRICS = [(lcg.Entropy, _NONE, ()), (lcg.TokenAccuracy, _NONE, ()), (lcg.LogProb, _NONE, ()),
                    (lcg.RatioMean, _NONE, ("policy",)), (lcg.KLNewOld, _NONE, ("policy",)),
                    (lcg.ClipFraction, _NONE, ("policy",))]


# the preference terms (losscodegen/preference.py), on their inputs' layout: "pairs" (DPO, CPO, SimPO,
# ORPO, ChosenNLL: a pair's chosen and rejected rows one segment) or "sequences" (KTO: one a sequence)
_PAIR_LOSSES = [lambda f: TermSpec.builtin(P.DPO, loss_type=f["dpo"], beta=f["beta"], **f["dpo_options"]),
                lambda f: TermSpec.builtin(P.CPO, loss_type=f["cpo"], beta=f["beta"]),
                lambda f: TermSpec.builtin(P.SimPO, beta=f["simpo_beta"]),
                lambda f: TermSpec.builtin(P.ORPO, beta=f["beta"]), lambda f: TermSpec.builtin(P.ChosenNLL, weight=0.5)]
_PAIR_STATISTICS = [lambda f: TermSpec.builtin(P.pair_statistics, star=True),
                    lambda f: TermSpec.builtin(P.cpo_statistics, star=True, loss_type=f["cpo"])]
_SEQUENCE_LOSSES = [lambda f: TermSpec.builtin(P.KTO, loss_type=f["kto"], beta=f["beta"], kl=f["kl"])]
_SEQUENCE_STATISTICS = [lambda f: TermSpec.builtin(P.sequence_statistics, star=True)]


def _preference(gen: Generator, layout: str) -> list[TermSpec]:
    """One or two preference losses of ``layout`` (and, at times, their statistics: weight-0 terms)."""
    r = gen.rng
    dpo = r.choice([t for t in P.DPO_LOSS_TYPES if t != "sft"])
    options: dict[str, Any] = {}
    if dpo in ("exo_pair", "robust"):
        options["label_smoothing"] = 0.1
    if dpo in ("sigmoid", "hinge", "ipo") and r.random() < 0.5:
        options["f_divergence_type"] = r.choice(['forward_kl', 'js_divergence', 'alpha_divergence'])
        if options["f_divergence_type"] == "alpha_divergence":
            options["f_alpha_divergence_coef"] = 0.5
    if r.random() < 0.2 and not dpo.startswith("aot"):   # (aot sorts the pairs: TRL refuses WPO with it)
        options["use_weighting"] = True   # WPO: a vocabulary sum inside the segment sums
    losses, statistics = (_PAIR_LOSSES, _PAIR_STATISTICS) if layout == "pairs" else (_SEQUENCE_LOSSES, _SEQUENCE_STATISTICS)
    picked = list(dict.fromkeys(r.choice(losses) for _ in range(r.choice([1, 1, 2]))))
    if r.random() < 0.3:
        picked.append(r.choice(statistics))
    fill = dict(dpo=dpo, dpo_options=options, cpo=r.choice(["sigmoid", "hinge", "ipo", "simpo"]),
                beta=r.choice([0.1, 0.5, 0.0, Tensor(0.0)]), simpo_beta=r.choice([0.5, 2.0, 0.0]),
                kto=r.choice(["kto", "apo_zero_unpaired"]), kl=r.choice([0.0, Tensor(0.05)]))
    return [make(fill) for make in picked]


def _builtin(gen: Generator, table, metric: bool) -> TermSpec | None:
    factory, keywords, needs = gen.pick(table)
    if ("teacher" in needs and not gen.teacher) or ("topk" in needs and not gen.topk) or \
            ("segments" in needs and not gen.segments):
        return None
    r = gen.rng
    # a tensor temperature (read relative to the row maxima) for the KLs; JSD refuses one
    # (and at their edges: temperatures near 0 and large, a clip bound of 0, JSD's endpoints, a
    # tensor at 0)
    temperatures = [1.0, 2.0, 0.7, 0.05, 20.0] + ([Tensor(1.5), Tensor(0.05)] if factory is not lcg.JSD else [])
    drawn = dict(ls=r.choice([0.0, 0.1, Tensor(0.0)]), w=r.choice([0.5, 1.0]), T=r.choice(temperatures),
                 b=r.choice([0.3, 0.5, 0.0, 1.0]), kb=r.choice([0.0, 0.04, Tensor(0.0)]),
                 el=r.choice([0.2, 0.0]), eh=r.choice([0.2, 0.28, 0.0]))
    return TermSpec.builtin(factory, metric=metric, **keywords(drawn))


def _row_of_segments(formula: Node) -> bool:
    """Whether a formula is a row term that reads segment statistics (GSPO-token's kind)."""
    try:
        expr = sp.sympify(formula.expr())
    except Exception:   # refused when the head is built, where the fuzzer tells a refusal from a crash
        return False
    return expr.has(S.segment_mean) and reads_rows(expr)


def _declared(gen: Generator, i: int, metric: bool) -> TermSpec:
    r = gen.rng
    u = r.random()
    if gen.segments and not metric and u < 0.15:
        kind = r.random()
        if kind < 0.35:
            formula = leaf(gen.pick(_SEGMENT_TERMS))
        elif kind < 0.65:
            formula = Node(gen.pick(_SEGMENT_OF_ROW), (gen.row(1),))
        else:
            formula = Node(gen.pick(_ROW_OF_SEGMENT), (gen.row(1),))
    elif u < 0.2:
        formula = leaf(_logit_norm)
    else:
        formula = gen.row(r.choice([1, 2, 2, 3]))
    params: dict[str, Any] = {}
    code = formula.code()
    if "S.param('tau')" in code:
        params["tau"] = r.choice([0.04, 0.5])   # in an exponent: a number
    if "S.param('c')" in code:   # (at 0: the formula's limit, or refused naming c where it has none)
        params["c"] = r.choice([0.7, -1.3, Tensor(0.4), 0.0, Tensor(0.0)])
    if "S.param('g')" in code:   # an exponent: 0 and large too, as a number (folded) and a tensor
        params["g"] = r.choice([2.0, 0.5, 0.0, 40.0, Tensor(2.0), Tensor(0.0)])
    if "S.param('T')" in code:   # a temperature: a number, or a tensor known at run time
        params["T"] = r.choice([0.8, Tensor(0.8), Tensor(2.5)])
    if "S.param('k')" in code:
        params["k"] = r.choice([1.0, 0.5, 2.0])   # in an exponent: a number (it decides the plan)
    if not metric:
        params = {"weight": r.choice([1.0, 0.3, Tensor(0.8)]), **params}
        if _row_of_segments(formula):
            # normalize='sequence' for a third of them, decided by u (the draw that chose the formula: a
            # draw of their own would move every later case's); batch quantiles alone take tokens only
            if u < 0.05 and "row_quantile" not in code:
                params["normalize"] = "sequence"   # each segment's mean of its rows, over the segments
        elif r.random() < 0.15:
            params["normalize"] = "sum"
        elif gen.segments and r.random() < 0.2:
            params["normalize"] = "sequence"   # the mean over each segment's rows
    return TermSpec.declared(f"f{i}", formula, metric=metric, **params)


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
        if s.key not in seen:
            seen.add(s.key)
            unique.append(s)
    if all(s.metric for s in unique):
        unique.insert(0, _declared(gen, len(unique), False))
    # (softcap=2.0 saturates on the spread regime's rows)
    options = rng.choice([(), (), (), (("softcap", 20.0),), (("logit_scale", 0.5),), (("softcap", 2.0),)])
    regime = "randn" if rng.random() < 0.35 else rng.choice([r for r in REGIMES if r != "randn"])
    rows = 12 if layout else rng.choice([7, 12])
    # (on a GPU, 128 too: the row-slices kernel's smallest chunks split it over two programs; drawn
    # after the rows, as before, so that a seed's cases on the CPU stay what they were)
    vocab = rng.choice([40, 64, 61] + ([128] if device == "cuda" else []))
    return Case(tuple(unique), Plan(), options, rows=rows, vocab=vocab, seed=rng.randrange(1000), device=device,
                layout=layout, regime=regime)
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
    if case.device == "cuda" and case.vocab % 16 == 0:
        # the row-slices kernel (Gluon, a GPU's only), its rows in slices of one or two 64-column chunks:
        # one program a row at 64 columns, two at 128
        out += [Plan(slices=(64, 4), dtype=rng.choice(["float32", "bfloat16"]), reduction=rng.choice(["mean", "sum"])),
                Plan(slices=(64, 4), dtype="bfloat16", divisor=3.0)]
    if teacher:   # the teacher's own gradient (its second kernel), on either backend
        out += [Plan(teacher_grad=True, tile=(16, 4, rng.random() < 0.5), reduction=rng.choice(["mean", none])),
                Plan(teacher_grad=True, backend="torch", dtype=rng.choice(["float32", "bfloat16"]))]
    if rng.random() < compile_share:
        out.append(Plan(kind="compile", reduction=rng.choice(["mean", none])))
    return out
