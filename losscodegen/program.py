"""The phase program: what a head's kernel computes in the phases that are the same for every
backend, decided once here from the plan, and ``Dialect``, what a backend supplies to write it.

The program is backend-neutral: typed steps holding sympy expressions and the names of the plan's
stats, never text. A backend is a dialect over it: a printer (its op table: ``emit.ArrayPrinter``
subclassed) and a few primitives (a select, a row value, how the shards' stats are held while they
merge). Its template lays the printed steps into its loops; no decision is left to the template.

- ``online``: the first read's online sums, grouped by exponent, with each group's rescale when the
  running maxima grow, the shift of a sum of elements relative to the maxima (``Shift``) and the
  sums added up compensated (``two_sum``: stable.compensated_sums);
- ``merge``: the vocab shards' packed stats merged, by each column's rule (``Merge``: the maxima
  first, then the sums, each rank's rescaled from its maxima to the global ones, the argmax of the
  first rank that holds the maximum);
- ``row_loss``: the per-row loss of ``reduction="none"``, the loss terms' weights times their row values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy as sp

from .emit import M_REF, MT_REF, ArrayPrinter, online_exponent, online_groups
from .lower import M, MT, base_of, shift
from .plan import Merge, Plan
from .stable import compensated_sums

# a rank's own maxima (one per rank of the merge), beside the global ones (M, MT)
RANK_M, RANK_MT = sp.Symbol("m_r", real=True), sp.Symbol("m_t_r", real=True)


@dataclass(frozen=True)
class Shift:
    """A running sum of elements relative to the maxima (``z - m``), moved when the maxima grow:
    ``moved`` (the maxima's growth times ``base``, the sum of its weights) is added where ``base`` is
    positive (an empty sum moves by nothing: its maximum is still -inf)."""
    acc: str
    base: str
    moved: sp.Expr


@dataclass(frozen=True)
class OnlineGroup:
    """The online sums sharing one exponent: ``exponent`` (0: no exponential), each sum's summand
    (``accs``: name, body), ``rescale`` (the exponent of the factor the sums so far take when the
    maxima grow; 0: none), the sums that move (``shifts``) and those added up compensated
    (``compensated``: a normaliser's, none of which moves)."""
    index: int
    exponent: sp.Expr
    rescale: sp.Expr
    accs: tuple[tuple[str, sp.Expr], ...]
    shifts: tuple[Shift, ...]
    compensated: tuple[str, ...] = ()


def online(plan: Plan, body: dict[str, sp.Expr]) -> tuple[OnlineGroup, ...]:
    """The first read's online groups; ``body``: each sum's summand as printed (emit.printed_bodies)."""
    out, compensated = [], compensated_sums(plan.lowered)
    for i, ((alpha, beta), accs) in enumerate(online_groups(plan).items()):
        shifts = []
        for a in accs:
            cz, ct = shift(a)
            if (cz, ct) != (0, 0):
                base = base_of(a, plan.lowered.accumulators).name
                moved = (cz * (M - M_REF) + ct * (MT - MT_REF)) * sp.Symbol(base, real=True)
                shifts.append(Shift(a.name, base, moved))
        kept = tuple(a.name for a in accs if a.name in compensated)
        # (a compensated sum is a normaliser's, whose summand is 1: it never moves, and two_sum has no move)
        assert not set(kept) & {s.acc for s in shifts}, f"compensated sums {kept} that move"
        out.append(OnlineGroup(i, online_exponent(alpha, beta), alpha * (M - M_REF) + beta * (MT - MT_REF),
                               tuple((a.name, body[a.name]) for a in accs), tuple(shifts), kept))
    return tuple(out)


def two_sum(acc: str, tile: str, rescale: str | None) -> list[str]:
    """The statements adding a tile's sum ``tile`` to the running sum ``acc`` (times ``rescale``,
    the group's factor when the maxima grow; None: none), compensated: ``acc_lo`` keeps what the
    fp32 addition rounds away (Knuth's two-sum, exact in any order of magnitudes where the addition
    is rounded on its own: a compiler that fuses it with the rescale's product into one fma, when
    the maxima grow, leaves that product's rounding), and the read folds it in once, after its
    last tile (``acc = acc + acc_lo``). Plain arithmetic: every dialect's."""
    r = f" * {rescale}" if rescale else ""
    return [f"{acc}_a = {acc}{r}", f"{acc}_lo = {acc}_lo{r}", f"{acc}_s = {acc}_a + {tile}",
            f"{acc}_b = {acc}_s - {acc}_a",
            f"{acc}_lo = {acc}_lo + (({acc}_a - ({acc}_s - {acc}_b)) + ({tile} - {acc}_b))", f"{acc} = {acc}_s"]


@dataclass(frozen=True)
class MergeStep:
    """One packed column merged over the vocab shards: ``rule`` (the plan's ``Merge``) at column ``at``; a scaled sum's ``rescale`` (the exponent taking a
    rank's sum from its maxima, ``RANK_M``/``RANK_MT``, to the global ones) and, for a sum of elements
    relative to the maxima, ``moved`` (the maxima's difference, times the column ``base_at``, its
    weights' sum)."""
    name: str
    rule: Merge
    at: int
    rescale: sp.Expr = sp.S.Zero
    moved: sp.Expr | None = None
    base_at: int | None = None


def merge(plan: Plan) -> tuple[MergeStep, ...]:
    """The merge of the shards' stats: every maximum first (the sums are rescaled to them), then the
    other columns in the packed order."""
    at = {c.name: i for i, c in enumerate(plan.columns)}
    accs = {a.name: a for a in plan.lowered.accumulators}
    steps = [MergeStep(c.name, Merge.MAX, at[c.name]) for c in plan.columns if c.merge is Merge.MAX]
    for c in plan.columns:
        if c.merge is Merge.SCALED:
            acc = accs.get(c.name)
            cz, ct = shift(acc) if acc is not None and acc.online else (0, 0)
            moved, base_at = None, None
            if (cz, ct) != (0, 0):
                moved = cz * (RANK_M - M) + ct * (RANK_MT - MT)
                base_at = at[base_of(acc, plan.lowered.accumulators).name]
            steps.append(MergeStep(c.name, Merge.SCALED, at[c.name], c.alpha * (RANK_M - M) + c.beta * (RANK_MT - MT),
                               moved, base_at))
        elif c.merge is not Merge.MAX:
            steps.append(MergeStep(c.name, c.merge, at[c.name]))
    return tuple(steps)


def row_loss(row_loss_terms: tuple[str, ...], row_values: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """The per-row loss as (loss term, index of its row value) pairs."""
    return tuple((n, row_values.index(n)) for n in row_loss_terms)


class Dialect:
    """A backend's way of writing the program: ``printer`` (the op table) and the primitives below.
    A backend subclasses it, overriding ``summand``, ``row_value`` and ``merge``; ``where`` too where
    its select is not ``where(c, a, b)`` of its array module."""

    printer: ArrayPrinter

    def print(self, expr: sp.Expr) -> str:
        return self.printer.doprint(expr)

    def where(self, cond: str, a: str, b: str) -> str:
        return f"{self.printer.module}.where({cond}, {a}, {b})"

    def summand(self, group: OnlineGroup, body: sp.Expr) -> str:
        """One online sum's summand of ``group`` (before any tile reduction)."""
        raise NotImplementedError

    def row_value(self, index: int) -> str:
        """The row's value ``index`` of the head's row values, as the kernel holds them."""
        raise NotImplementedError

    def merge(self, steps: tuple[MergeStep, ...]) -> Any:
        """The merge's statements, in whatever arrangement the backend's template places."""
        raise NotImplementedError

    # the name of an online group's rescale factor (``index``: the group's), which the dialect's
    # template assigns and reads as ``rescale_var``
    rescale_name = "r{index}"

    def online(self, groups: tuple[OnlineGroup, ...]) -> list[dict[str, Any]]:
        """Each online group printed: ``scale`` (its exponential; None without one), ``rescale``
        (None: none) and ``rescale_var`` (the name it is held in), ``accs`` (name, printed summand),
        ``shifts`` (name -> printed move), ``compensated`` (name -> the statements adding its tile
        sum, ``<name>_tile``: ``two_sum``)."""
        return [self._online_group(g) for g in groups]

    def _online_group(self, g: OnlineGroup) -> dict[str, Any]:
        rescale_var = self.rescale_name.format(index=g.index)
        rescaled = g.rescale != 0 and g.exponent != 0
        return dict(index=g.index, scale=None if g.exponent == 0 else self.print(sp.exp(g.exponent)),
                    rescale=None if g.rescale == 0 else self.print(sp.exp(g.rescale)), rescale_var=rescale_var,
                    accs=[(name, self.summand(g, body)) for name, body in g.accs],
                    shifts={s.acc: self.where(f"{s.base} > 0.0", self.print(s.moved), "0.0") for s in g.shifts},
                    compensated={name: two_sum(name, f"{name}_tile", rescale_var if rescaled else None)
                                 for name in g.compensated})

    def row_loss(self, terms: tuple[tuple[str, int], ...], weight: Callable[[str], str]) -> str:
        """The per-row loss: each term's weight (``weight(term)``: its name) times its row value."""
        return " + ".join(f"{weight(n)} * {self.row_value(i)}" for n, i in terms) or "0.0"
