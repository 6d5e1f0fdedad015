"""The per-element cost that explain() and the kernel header print: the special-function ops each read
needs, counted by hand from each head's formulas (SFU-bound heads are timed by these counts)."""
import sympy as sp

import losscodegen as lcg
import losscodegen.symbols as S
from losscodegen.backends import get
from losscodegen.emit import label_part
from losscodegen.lower import IS_Y, ZM

# {read: SFU ops per vocabulary element}, from the formulas:
CASES = [
    # p_i = exp(z_i - lse): one exp to sum, one for the gradient p_i - [i == y]
    (lambda: lcg.HeadLoss(lcg.CrossEntropy()), {"stats": 1, "gradient": 1}),
    # entropy's sum p z shares the exp of the normaliser's sum
    (lambda: lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())), {"stats": 1, "gradient": 1}),
    # the student's and the teacher's exps to sum; p_i and q_i for the gradient
    (lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(), metrics=(lcg.Entropy(),)),
     {"stats": 2, "gradient": 2}),
    # at a temperature the exponents are (z - m)/T: the division by T is a multiply, not a reciprocal
    (lambda: lcg.HeadLoss(lcg.ForwardKL(temperature=2.0)), {"stats": 2, "gradient": 2}),
    # the exact read: p_i, q_i and log M_i (M = beta p + (1 - beta) q). The gradient, beta p (log p -
    # log M - KL(p||M)) with no 1/M (sympy cancels (beta p + (1 - beta) q) / M once the two KL sums'
    # gradients are one sum), log M from the larger of the exponents a, b of p and q: h + log(c_h +
    # c_l u) with u = exp(-|a - b|), and p as exp(h) or exp(h) u: exp(h), u and a log
    (lambda: lcg.HeadLoss(lcg.JSD()), {"stats": 2, "exact": 3, "gradient": 3}),
    (lambda: lcg.HeadLoss(lcg.JSD(beta=0.3)), {"stats": 2, "exact": 3, "gradient": 3}),
]


def test_sfu_ops_per_element_match_the_formulas():
    for make, expected in CASES:
        head = make()
        costs = get().describe_costs(head.plan())
        found = {line.split(" read:")[0].strip(): int(line.split(": ")[1].split(" SFU")[0])
                 for line in costs.splitlines() if " read: " in line}
        assert found == expected, (head, costs)
        assert costs in head.explain()


def _values(symbols, seed):
    import random
    rng = random.Random(seed)
    # (a parameter in (0, 1), as JSD's beta, a sum positive, anything else of either sign)
    return {s: rng.uniform(0.1, 0.9) if s.name.startswith("p_") else rng.uniform(0.5, 3.0)
            if s.name.startswith("acc") else rng.uniform(-6.0, 2.0) for s in symbols}


def test_the_log_space_mixture_is_the_plain_log_with_one_comparison():
    """JSD's gradient summand, rewritten by mixtures_in_log_space: equal to the plain formula at
    either sign of a1 - a2; one comparison (h, the coefficients and min(a - b, 0) all pick by it);
    p = exp(a1) itself where exp(a2) is not needed outside the log."""
    import sympy as sp
    from losscodegen.emit import TINY, mixtures_in_log_space, no_underflow_nan
    from losscodegen.lower import TM, ZM
    l0, l1, beta, g = sp.symbols("L0 L1 beta g", real=True)
    a1, a2 = ZM - l0, TM - l1
    log_m = sp.log(beta * sp.exp(a1) + (1 - beta) * sp.exp(a2))
    grad = g * sp.exp(a1) * (a1 - log_m)
    elements = (ZM, TM)
    rewritten = mixtures_in_log_space(no_underflow_nan(grad, elements), elements)
    assert len(rewritten.atoms(sp.Rel)) == 1
    assert rewritten.has(sp.exp(a1)) and not rewritten.has(sp.exp(a2)) and rewritten.has(sp.Min)
    for seed in range(8):
        at = {**_values(grad.free_symbols, seed), beta: 0.3, TINY: 0.0}
        assert abs(float(rewritten.subs(at)) - float(grad.subs(at))) < 1e-12 * (1 + abs(float(grad.subs(at))))


def test_cse_arranged_is_the_same_expression_with_fewer_operations_an_element():
    """The gradient's statements (common subexpressions, negations shared, element factors taken
    out, row values combined first) evaluate to the expression they came from; JSD's gradient
    costs 21 operations an element besides its 3 special-function ones (29 before: a second
    comparison, p as a select times an exponential, three multiplies by row values, d0 - d1 as two
    operations)."""
    import sympy as sp
    from losscodegen.backends.triton.render import element_costs
    from losscodegen.emit import Once, TINY, cse_arranged, printed_bodies
    for make in (lambda: lcg.HeadLoss(lcg.JSD()), lambda: lcg.HeadLoss(lcg.ReverseKL()),
                 lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(), metrics=(lcg.Entropy(),))):
        lw = make().plan().lowered
        body, (grad, _) = printed_bodies(lw)
        exprs = [grad] + [body[a.name] for a in lw.accumulators if not a.online]
        temps, reduced = cse_arranged(exprs, "c")
        for seed in range(4):
            at = {**_values(set().union(*(e.free_symbols for e in exprs)), seed), TINY: 0.0}
            values = dict(at)
            for s, e, _ in temps:
                values[s] = e.replace(lambda n: isinstance(n, Once), lambda n: n.args[0]).subs(values)
            for e, r in zip(exprs, reduced):
                got = float(r.replace(lambda n: isinstance(n, Once), lambda n: n.args[0]).subs(values))
                want = float(e.subs(at))
                assert abs(got - want) <= 1e-9 * (1 + abs(want)), (e, r)
    assert element_costs(lcg.HeadLoss(lcg.JSD()).plan())["gradient"] == (3, 21)


def test_the_reads_after_the_first_floor_the_relative_element():
    """A per-element saving of the Triton template (bench/sass_costs.py counts it): the reads after
    the first, whose expressions read the logits only relative to their maxima, floor zm = z - m
    (one multiply-add with the logits' scale) rather than z, where the first read floors z itself
    (its running max is of z)."""
    triton = lcg.backends.get("triton")
    for head, first_read_floors in ((lcg.HeadLoss(lcg.JSD()), 0), (lcg.HeadLoss(lcg.JSD(), metrics=(lcg.Entropy(),)), 1)):
        text = head.source(triton).text.split("\n@gluon.jit")[0]     # (the head kernel's, not the row-slices kernel's)
        assert text.count("zm = tl.maximum(z - m, FLOOR") == text.count("tm = tl.maximum(t - m_t, FLOOR") == 2
        assert text.count("z = tl.maximum(z, FLOOR") == text.count("t = tl.maximum(t, FLOOR") == first_read_floors


def test_the_label_part_of_the_gradient_is_added_at_its_column_once_a_row():
    """A per-element saving of the Triton template: cross-entropy's dL/dz_i = p_i - [i == y] stores
    p_i over the row and adds the label's -1 at its column once, after the read, rather than a
    compare and a multiply-add an element; where ``is_y`` is multiplied by an element value, or a
    top-k part (whose ids may hold the label) is there, it stays in the read."""
    g0, g1 = sp.symbols("g0 g1", real=True)
    assert label_part(g0 * sp.exp(ZM) + g1 * IS_Y) == (g0 * sp.exp(ZM), g1)
    assert label_part(g0 * sp.exp(ZM) + g1 * IS_Y * ZM) == (g0 * sp.exp(ZM) + g1 * IS_Y * ZM, 0)
    assert label_part(g0 * sp.exp(ZM)) == (g0 * sp.exp(ZM), 0)
    triton = get("triton")
    text = lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())).source(triton).text
    read = text[text.index("# Gradient read"):text.index("# The label's column")]
    assert "is_y" not in read and "tl.store(grad_row + y_local" in text
    topk = lcg.declare_term("ce_topk", S.lse - S.target_logit - S.topk_sum(S.exp(S.topk_logprob) * S.topk_logit))
    text = lcg.HeadLoss(topk()).source(triton).text
    assert "is_y = tl.where(cols == y_local" in text and "# The label's column" not in text
