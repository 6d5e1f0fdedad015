"""The differential fuzzer (losscodegen/fuzz.py): a fixed-seed slice of random heads under every plan
must match the float64 reference, and a mismatch is shrunk and printed as a test that fails."""
import ast
import random

import pytest
import sympy as sp

from losscodegen import fuzz
from losscodegen import symbols as S

pytestmark = pytest.mark.cpu   # CPU tensors throughout (conftest's ``cpu``)


def test_fixed_seed_slice_of_random_heads_and_plans_matches_the_reference():
    lines = []
    counts = fuzz.fuzz(seconds=float("inf"), cases=4, seed=2, sharded=False, compile_share=0.0,
                       out=lines.append)
    assert counts.heads == 4 and counts.plans >= 8, "\n".join(lines)
    assert not counts.mismatches, "\n".join(lines)


def test_fixed_seed_slice_on_two_gloo_ranks_matches_the_reference():
    rng = random.Random(5)
    ranks = fuzz.Ranks(2)
    checked = 0
    try:
        for case in [fuzz.generate_case(rng) for _ in range(3)]:
            case = fuzz.Case(case.terms, rows=case.rows, vocab=64, seed=case.seed)
            head = fuzz.build_head(case)
            plan = fuzz.Plan(kind="sharded", world=2, shards=(32, 32), reduction="none")
            try:
                fuzz.check(head, plan, rows=case.rows, vocab=64, seed=case.seed, ranks=ranks)
                checked += 1
            except fuzz.Skip:
                pass
    finally:
        ranks.close()
    assert checked >= 2


def test_generated_formulas_are_well_typed_and_print_as_code():
    rng = random.Random(0)
    for _ in range(30):
        case = fuzz.generate_case(rng)
        for spec in case.terms:
            if spec.formula is not None:
                formula = eval(spec.formula.code(), {"S": S})
                assert isinstance(sp.sympify(formula), sp.Expr)
        ast.parse(case.code())


def test_a_wrong_result_is_shrunk_and_printed_as_a_failing_test(monkeypatch):
    """A wrong gradient injected wherever a head sums over the vocabulary: the shrinker drops the
    other terms and the parts of the formula that do not sum, and prints a test that fails."""
    run_here = fuzz._run_here

    def wrong(head, plan, logits, labels, kw, up):
        loss, values, rows, grad = run_here(head, plan, logits, labels, kw, up)
        if any(f.has(S.vsum) for _, f, _ in head._bound):
            grad = grad * 1.1
        return loss, values, rows, grad
    monkeypatch.setattr(fuzz, "_run_here", wrong)
    T0 = "(S.lse_at(2) + S.vsum(S.softmax * S.Abs(S.logit)))"
    formula = fuzz.Node("({0} * {1})", (fuzz.Node(T0), fuzz.Node("S.target_logit")))
    case = fuzz.Case((fuzz.TermSpec("lcg.CrossEntropy()"),
                      fuzz.TermSpec("weight=0.5", name="f1", formula=formula)),
                     fuzz.Plan(reduction="sum", tile=(16, 4, True)), rows=8, vocab=40, seed=3)
    small, message = fuzz.shrink(case, budget=25)
    assert "gradient" in message
    assert len(small.terms) == 1 and "S.vsum" in small.terms[0].formula.code()
    assert len(small.terms[0].formula.code()) < len(formula.code())
    test = fuzz.regression_test(small, message, name="injected")
    namespace = {}
    exec(test, namespace)
    try:
        namespace["test_injected"]()
    except fuzz.Mismatch:
        pass
    else:
        raise AssertionError(f"the printed test passes:\n{test}")
