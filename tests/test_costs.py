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
    # p_i, q_i, log M_i and 1/M_i (M = beta p + (1 - beta) q) in the exact and the gradient reads;
    # p_i q_i / M_i is a product of the two exps, not a third exp of (z - lse_z) + (t - lse_t)
    (lambda: lcg.HeadLoss(lcg.JSD()), {"stats": 2, "exact": 4, "gradient": 4}),
    (lambda: lcg.HeadLoss(lcg.JSD(beta=0.3)), {"stats": 2, "exact": 4, "gradient": 4}),
]


def test_sfu_ops_per_element_match_the_formulas():
    for make, expected in CASES:
        head = make()
        costs = get().describe_costs(head.plan())
        found = {line.split(" read:")[0].strip(): int(line.split(": ")[1].split(" SFU")[0])
                 for line in costs.splitlines() if " read: " in line}
        assert found == expected, (head, costs)
        assert costs in head.explain()
