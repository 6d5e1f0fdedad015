"""The per-element cost that explain() and the kernel header print: the special-function ops each read
needs, counted by hand from each head's formulas (SFU-bound heads are timed by these counts)."""
import losscodegen as lcg
from losscodegen.backends import get

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
