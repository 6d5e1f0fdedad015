"""Stage 3, plan: reads over the vocabulary, the packed per-row statistics, and the launches.

The first read keeps every online accumulator; an exact accumulator adds a second read; the gradient
is one more read. Everything the first read produces for a row lives in one packed fp32 row of
``stats``, with a merge rule per column, so that splitting a row across ranks (vocab-parallel) or
across launches (segment terms) costs one exchange of that tensor whatever the terms.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import sympy as sp

from .lower import Lowered


class Merge(enum.StrEnum):
    """How a packed statistic's partial values (one per vocab shard) combine."""

    MAX = "max"
    SUM = "sum"
    ARGMAX = "argmax"    # the column of the largest maximum
    SCALED = "scaled"    # a running sum: each rescaled to the merged maxima (``Column.alpha``, ``beta``), then summed


@dataclass(frozen=True)
class Column:
    """One packed statistic and how partial values of it (one per vocab shard) combine."""

    name: str
    merge: Merge
    alpha: sp.Expr = sp.S.Zero  # for SCALED: rescale by exp(alpha*(m_r - m) + beta*(m_t,r - m_t))
    beta: sp.Expr = sp.S.Zero


class Then(enum.StrEnum):
    """What the host does after a launch."""

    NOTHING = ""
    GATHER = "gather"          # all-gather every rank's packed stats
    SUM_EXACT = "sum_exact"    # all-reduce the exact sums
    SEGMENTS = "segments"      # the segment step (it needs every row's values)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: which phases it runs, and what the host does after it.

    A launch that writes row values (``rows``) also finishes them: its last program reduces every
    row's values into the terms, the metrics and the loss."""

    stats: bool = False        # run the first read
    exchange: bool = False     # send the packed stats to every vocab shard in-kernel, and wait for theirs
    merge: bool = False        # merge the packed stats gathered from every vocab shard
    exact: bool = False        # run the exact read (heads that have one)
    store_stats: bool = False  # keep what this launch computed for a later launch
    rows: bool = False         # write per-row values (and segment sums), then finish
    grad: bool = False
    then: Then = Then.NOTHING

@dataclass(frozen=True)
class Sweep:
    """One pass over a row's vocabulary tiles.

    Each pass runs opposite to the one before it in the same launch, so that it starts on the
    tiles read last, which are the likeliest still in L2. The last read of a row asks L2 to drop
    its lines first, since nothing reads them again, and streams its stores (the gradient) past L2
    so that they do not push out the rows other programs are about to re-read."""

    name: str               # "stats" | "exact" | "grad"
    reverse: bool
    streams: tuple[str, ...]  # "x" (logits), "t" (teacher logits)
    evict_first: bool
    stream_stores: bool = False


@dataclass(frozen=True)
class Plan:
    lowered: Lowered
    softcap: bool
    columns: tuple[Column, ...]   # the first read's packed per-row stats, gathered across vocab shards
    exact: tuple[str, ...]        # the exact sums (the exact read's, and the top-k entries' that need
                                  # the final normalisers), summed across vocab shards: a launch with
                                  # the final stats computes them (``launch_sequence``'s has_exact)

    @property
    def reads(self) -> int:
        """Reads of the logits per row for the loss (the gradient read not counted)."""
        return 1 + int(self.lowered.has_exact)

    def launches(self, *, sharded: bool, grad: bool, split: bool = False,
                 exchange: bool = False) -> tuple[Launch, ...]:
        return launch_sequence(has_exact=bool(self.exact), segments=bool(self.lowered.segments),
                               sharded=sharded, grad=grad, split=split, exchange=exchange)

    @property
    def state(self) -> tuple[str, int, int]:
        """What a program keeps and loads per element, which decides its best tile: the streams the
        first read loads, its running values (sums, and the argmax, a second reduction of each tile),
        and the sums of the exact read."""
        accs = [a for a in self.lowered.accumulators if a.domain == "vocab"]
        running = sum(a.online for a in accs) + sum(c.merge is Merge.ARGMAX for c in self.columns)
        return ("".join(self.sweeps[0].streams), running, sum(not a.online for a in accs))

    @property
    def sweeps(self) -> tuple[Sweep, ...]:
        """The reads of a row in one launch, in order: stats, exact (when the head has one), grad."""
        lw = self.lowered
        streams = ("x", "t") if lw.uses_teacher else ("x",)
        grad_streams = ("x", "t") if lw.grad_uses_teacher else ("x",)
        exact = (Sweep("exact", True, streams, False),) if lw.has_exact else ()
        return (Sweep("stats", False, streams, False), *exact,
                Sweep("grad", not lw.has_exact, grad_streams, True, True))

    def bytes_per_element(self, logit_bytes: int = 2, teacher_bytes: int = 2,
                          grad: bool = True) -> float:
        """HBM bytes per vocabulary element if no read hits L2: every sweep's streams, and the
        gradient written (the teacher's too, for a variant that writes it)."""
        size = {"x": logit_bytes, "t": teacher_bytes}
        reads = sum(size[s] for w in self.sweeps if grad or w.name != "grad" for s in w.streams)
        writes = logit_bytes + (teacher_bytes if self.lowered.teacher_grad else 0)
        return reads + (writes if grad else 0)

    def __str__(self) -> str:
        lw = self.lowered
        lines = [f"reads of the vocabulary: {self.reads} for the loss"
                 + (" (online stats + exact)" if lw.has_exact else " (online stats)")
                 + " + 1 for the gradient",
                 f"bytes per element (bf16 in, bf16 grad): {self.bytes_per_element():g}",
                 f"packed per-row stats ({len(self.columns)} fp32): "
                 + ", ".join(f"{c.name}:{c.merge}" for c in self.columns)
                 + (f"; exact sums: {', '.join(self.exact)}" if self.exact else ""),
                 "vocab-parallel: one all-gather of the packed stats"
                 + (" + one all-reduce of the exact sums" if self.exact else ""),
                 f"per-element state {self.state}; reads "
                 + ", ".join(f"{w.name} {'backward' if w.reverse else 'forward'}" for w in self.sweeps)]
        for label, sharded, exchange in (("single device", False, False), ("sharded", True, False),
                                         ("sharded, in-kernel exchange", True, True)):
            seq = self.launches(sharded=sharded, grad=True, exchange=exchange)
            lines.append(f"{label}: {len(seq)} launch(es): " + " -> ".join(_describe(l, bool(self.exact)) for l in seq))
        return "\n".join(lines)


def pow2(n: int) -> int:
    """The least power of two >= n (``triton.next_power_of_2`` costs microseconds a call, on the hot
    path of a call)."""
    return 1 << max(n - 1, 0).bit_length()


def launch_sequence(*, has_exact: bool, segments: bool, sharded: bool, grad: bool,
                    split: bool = False, exchange: bool = False) -> tuple[Launch, ...]:
    """The launches of one call. On one device a head without segment terms is one launch (or, if
    measured faster, one launch a read: ``split``); a segment term needs every row's values before
    any gradient (rows, segments, then gradient); under vocab parallelism each exchange of row
    statistics ends a launch, unless the shards exchange them in-kernel (``exchange``: GPUs that map
    each other's memory), which keeps a head without exact sums in one launch (exact sums need
    every shard's normalisers before them, and are all-reduced after them). ``has_exact``: the head
    has exact sums, of the vocabulary or of the top-k entries alone (those read no vocabulary, but
    split or sharded, the launch that reads them back would find them unwritten without an exact
    launch)."""
    out = []
    if sharded and exchange and not has_exact:
        first = dict(stats=True, exchange=True, merge=True)
    elif sharded or split:
        out.append(Launch(stats=True, store_stats=True, then=Then.GATHER if sharded else Then.NOTHING))
        if has_exact:
            out.append(Launch(merge=sharded, exact=True, store_stats=True,
                              then=Then.SUM_EXACT if sharded else Then.NOTHING))
            first = {}
        else:
            first = dict(merge=True) if sharded else {}
    else:
        first = dict(stats=True, exact=True)
    then = Then.SEGMENTS if segments else Then.NOTHING
    if segments and grad:
        out += [Launch(**first, store_stats=bool(first), rows=True, then=then), Launch(grad=True)]
    else:
        out.append(Launch(**first, rows=True, grad=grad, then=then))
    return tuple(out)


def _describe(launch: Launch, has_exact: bool) -> str:
    parts = [n for n, on in (("stats", launch.stats), ("exchange", launch.exchange), ("merge", launch.merge),
                             ("exact", launch.exact and has_exact), ("rows", launch.rows),
                             ("grad", launch.grad)) if on]
    return "[" + "+".join(parts) + "]" + (f" {launch.then}" if launch.then else "")


def plan(lowered: Lowered, *, softcap: bool) -> Plan:
    cols = [Column("m", Merge.MAX)]
    if lowered.uses_teacher:
        cols.append(Column("m_t", Merge.MAX))
    if lowered.uses_labels:
        cols.append(Column("z_y", Merge.SUM))
    if lowered.uses_argmax:
        cols.append(Column("argmax", Merge.ARGMAX))
    for acc in lowered.accumulators:
        if acc.online:
            cols.append(Column(acc.name, Merge.SCALED, acc.alpha, acc.beta))
    exact = tuple(acc.name for acc in lowered.accumulators if not acc.online)
    return Plan(lowered, softcap, tuple(cols), exact)
