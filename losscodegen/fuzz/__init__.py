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

Formulas are trees of functions over ``S`` (``losscodegen.symbols``, ``fuzz.grammar``): applied to
the symbols they are the formula, applied to a writer of code the code a user would write, so that
a case prints as that code and its head is built from the same objects. A ``randn`` case is kept where its float64 value is finite and well
conditioned: a formula whose reference moves by more than a fraction of the tolerance when the
inputs move by a few fp32 ulps (a kink at a near tie, a cancellation) is not a fair test of fp32
arithmetic and is skipped (counted as ``skipped``); a case of another regime, only for the latter.

The package: ``grammar`` (random formulas), ``cases`` (terms, heads and plans of a case),
``checking`` (one case against the reference; the gloo ranks), ``shrinking`` (a mismatch made
small and printed as a test), and here the loop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Iterator

from .cases import Case, Plan, Tensor, TermSpec, build_head, generate_case, plans
from .checking import Mismatch, Ranks, Refused, Skip, check, nan_workspaces, refused
from .grammar import Node
from .shrinking import regression_test, shrink, sympy_builds

__all__ = ["Case", "Plan", "Tensor", "TermSpec", "Node", "Mismatch", "Skip", "Refused", "check", "refused",
           "sympy_builds", "generate_case", "build_head", "shrink", "regression_test", "fuzz"]


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


def _report(case: Case, message: str, counts: "Counts", ranks: dict, budget: int, out) -> None:
    small, found = shrink(case, ranks=ranks, budget=budget)
    test = regression_test(small, found if found != "no longer fails" else message)
    counts.mismatches.append(test)
    out(f"MISMATCH: {message.splitlines()[0]}\n{test}")
