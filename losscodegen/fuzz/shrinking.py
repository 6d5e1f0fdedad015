"""Shrinking a mismatch: the smallest case found that still fails the same way, printed as a pytest
test (``regression_test``)."""
from __future__ import annotations

import dataclasses
from typing import Iterator

from .cases import Case, build_head
from .checking import Mismatch, Refused, Skip, check, refused
from .grammar import Node, leaf


def sympy_builds(case: Case) -> bool:
    """Whether sympy itself builds each declared formula of ``case``, before losscodegen sees it.
    Its constructors can fail on what the grammar writes (found by the H200 fuzz run: a Piecewise
    whose condition compares another Piecewise, ``KeyError: 'pop from an empty set'`` inside
    sympy's rewrite of the condition): no formula a user can write, so no test of the compiler."""
    try:
        for t in case.terms:
            if t.formula is not None:
                t.formula.expr()
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
            yield node.replace(sub, leaf(lambda S: S.lse))


def _smaller_cases(case: Case) -> Iterator[Case]:
    if len(case.terms) > 1:
        for i in range(len(case.terms)):
            rest = case.terms[:i] + case.terms[i + 1:]
            if any(not t.metric for t in rest):
                yield dataclasses.replace(case, terms=rest)
    for i, t in enumerate(case.terms):
        if t.formula is not None:
            for f in _smaller_formulas(t.formula):
                code = f.code()   # (a parameter the smaller formula no longer reads is dropped)
                keywords = tuple((k, v) for k, v in t.keywords if k not in ("c", "g", "k") or f"S.param({k!r})" in code)
                yield dataclasses.replace(case, terms=case.terms[:i] + (dataclasses.replace(t, formula=f, keywords=keywords),)
                                          + case.terms[i + 1:])
    if case.head_options:
        yield dataclasses.replace(case, head_options=())
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
