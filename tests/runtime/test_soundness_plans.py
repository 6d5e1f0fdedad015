"""Soundness: a head the compiler accepts computes its float64 value and gradient under every plan
the runtime may choose (split launches, small tiles, vocab-parallel ranks), and a kernel file that
Triton's compiler would refuse is refused when it is generated, not only on a GPU. Each test here
is a bug the differential fuzzer (losscodegen/fuzz.py) found."""
import ast
import os

import pytest
import sympy as sp
import torch

import losscodegen as lcg
from losscodegen import interface
from losscodegen import symbols as S
from losscodegen.fuzz import Plan, check
from losscodegen.testing import random_inputs, reference

# token-level unlikelihood: a top-k sum that needs the final lse, and no exact read of the vocabulary
Unlikelihood = lcg.declare_term("unlikelihood", -S.topk_sum(S.log(1 - S.exp(S.topk_logit - S.lse))))


@pytest.mark.parametrize("plan", [Plan(tile=(16, 4, True)), Plan(tile=(16, 4, True), reduction="none"),
                                  Plan(dtype="bfloat16", tile=(32, 4, True))], ids=str)
def test_token_level_unlikelihood_with_split_launches(plan, device):
    check(lcg.HeadLoss(Unlikelihood(), lcg.CrossEntropy()), plan, rows=8, vocab=64, seed=1, device=device)


@pytest.mark.cpu   # (the fuzzer's gloo ranks)
def test_token_level_unlikelihood_on_two_gloo_ranks(fuzz_ranks2):
    check(lcg.HeadLoss(Unlikelihood(), lcg.CrossEntropy()),
          Plan(kind="sharded", world=2, shards=(32, 32)), rows=8, vocab=64, seed=1, ranks=fuzz_ranks2)


def test_a_topk_gradient_kernel_keeps_its_values_in_scope():
    """The top-k part of the gradient reads nothing that the vocabulary loop computed: Triton's
    compiler refuses a name used after the loop that defines it (the interpreter does not)."""
    head = lcg.HeadLoss(Unlikelihood())
    head.source()   # generation runs interface.check_interface, which refuses a name read out of its scope


def test_a_kernel_reading_a_loop_value_after_the_loop_is_refused_at_generation():
    text = ("def k(V, BLOCK):\n"
            "    acc = 0.0\n"
            "    for start in range(0, V, BLOCK):\n"
            "        d0 = start * 2\n"
            "        acc += d0\n"
            "    if V > 0:\n"
            "        e = acc\n"
            "    else:\n"
            "        e = 1.0\n"
            "    return acc + d0 + e\n")
    fn = ast.parse(text).body[0]
    assert interface._read_out_of_scope(fn, {"range"} | {"V", "BLOCK"}) == ["d0 (line 10)"]


def test_a_kink_of_a_log_normaliser_and_a_number_builds(device):
    """S.Max(S.lse, 0): a log-normaliser is a row value, not a number sympy fails to compare."""
    Hinge = lcg.declare_term("hinge", S.Max(S.lse - S.target_logit, 1) + S.Min(S.lse_at(2), 3))
    check(lcg.HeadLoss(Hinge()), Plan(tile=(16, 4, False)), rows=6, vocab=40, seed=0, device=device)


def test_a_row_coefficient_in_an_exponent_not_linear_in_the_element_is_refused_naming_it(device):
    """exp(z**2 / token) inside vsum has no maximum to subtract and overflowed fp32: refused at
    declare_term, naming the exponential (a linear one, exp(z / token), is read relative to the row
    maximum: tests/compiler/test_language.py)."""
    with pytest.raises(ValueError, match=r"exp\(z\*\*2/tok_tau\).*token\('tau'\).*linear in the element"):
        lcg.declare_term("tempered_lse", S.log(S.vsum(S.exp(S.logit ** 2 / S.token("tau")))))
    # a number or a param there is a coefficient the kernel shifts by: accepted, and right past 88
    Tempered = lcg.declare_term("tempered_lse", S.log(S.vsum(S.exp(S.logit / S.param("tau")))))
    check(lcg.HeadLoss(Tempered(tau=0.02)), Plan(tile=(16, 4, True)), rows=6, vocab=40, seed=0, device=device)


@pytest.mark.parametrize("normalize", ["sum", "sequence"])
def test_a_metric_asked_for_another_normalisation_is_refused(normalize):
    """A metric is a mean over the valid rows: Entropy(normalize="sum") as a metric was silently a mean."""
    with pytest.raises(ValueError, match=f"entropy: a metric is a mean.*normalize='{normalize}'"):
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(normalize=normalize),))


@pytest.mark.parametrize("term", [lambda: lcg.TopKForwardKL(temperature=2.0), lambda: Unlikelihood()],
                         ids=["topk_forward_kl", "unlikelihood"])
def test_a_bf16_gradient_at_the_topk_ids_is_rounded_once(term, device):
    """The dense and the sparse parts of the gradient at a top-k id summed in fp32 and rounded to
    bf16 once: within one rounding of the float64 gradient (half an ulp; a whole one in Triton's
    interpreter, whose fp32 -> bf16 conversion truncates). The dense part was rounded to bf16, read
    back, added to and rounded again: 64 half-ulps off where the two parts nearly cancel."""
    head = lcg.HeadLoss(term(), lcg.CrossEntropy())
    logits, labels, kw = random_inputs(head, rows=16, vocab=64, dtype=torch.bfloat16, device=device, seed=4)
    x = logits.clone().requires_grad_()
    head(x, labels, **kw).loss.backward()
    want = reference(head)(logits.cpu(), labels.cpu(), **{k: v.cpu() for k, v in kw.items()})[2]
    ids = kw["teacher_topk_ids"].cpu()
    got_k, want_k = x.grad.double().cpu().gather(1, ids), want.gather(1, ids)
    rounding = 2.0 ** (torch.floor(torch.log2(want_k.abs().clamp_min(1e-30))) - 8)  # half a bf16 ulp
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        rounding = 2 * rounding
    assert ((got_k - want_k).abs() <= rounding * 1.001).all(), ((got_k - want_k).abs() / rounding).max()


def test_parity_of_a_formula_whose_token_simplifies_away(device):
    """Min(1 + a**2, vsum(softmax)) is 1: the kernel reads no token a (the head accepts none), and
    the float64 reference, which evaluates the formula as written, still gets values for it."""
    Flat = lcg.declare_term("flat", S.Min(1 + S.token("a") ** 2, S.vsum(S.softmax)) * S.lse)
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(Flat(),))
    assert "a" not in head.kernel.TOKENS
    check(head, Plan(), rows=4, vocab=40, seed=0, device=device)


def test_a_doubly_stopped_gradient_compiles(device):
    """stop_gradient(stop_gradient(x)): the value x, no gradient (the inner one reached the printer)."""
    Stopped = lcg.declare_term("stopped", S.stop_gradient(S.stop_gradient(S.vsum(S.softmax * S.logit))) * S.lse)
    check(lcg.HeadLoss(Stopped()), Plan(), rows=4, vocab=40, seed=0, device=device)


def test_a_constant_term_and_a_stopped_constant_metric(device):
    """Formulas with no row quantity at all: 0.5 summed over rows, and stop_gradient(log(2)) (the
    reference printed (0.693...).detach(), on a float)."""
    Half = lcg.declare_term("half", sp.Rational(1, 2))
    Log2 = lcg.declare_term("log2", S.stop_gradient(S.log(2)))
    check(lcg.HeadLoss(Half(weight=0.3, normalize="sum"), metrics=(Log2(),)), Plan(), rows=3, vocab=40, seed=0,
          device=device)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("summand", [S.tanh(S.exp(S.topk_logit - S.lse)),
                                     S.exp(S.topk_logit - S.lse) * (S.topk_logit - S.lse),
                                     S.log(1 - S.exp(S.topk_logit - S.lse))], ids=str)
def test_a_topk_sum_of_the_final_lse_that_the_gpu_run_refused_is_generated_on_each_backend(backend, summand, device):
    """The fuzzer's H100 run (docs/perf/NVIDIA-H100-80GB-HBM3-fuzz-2026-11-25.txt): these heads,
    on the torch backend, read ``d0`` after the vocabulary loop that computed it (the generation-time
    scope check refused them; fixed in the torch backend's top-k block, 6acc534). Generation runs
    the scope check; the values are the reference's on a split plan."""
    term = lcg.declare_term("topk_term", S.topk_sum(summand))
    head = lcg.HeadLoss(term(weight=0.3, normalize="sum"), backend=backend)
    head.kernel
    check(head, Plan(tile=(16, 4, True)), rows=3, vocab=40, seed=372, device=device)


@pytest.mark.parametrize("formula", [S.tanh(S.lse), S.exp(S.tanh(S.lse - S.target_logit + 0.5))], ids=str)
def test_the_gradient_of_tanh_of_a_large_row_value_keeps_fp32_digits(formula, device):
    """tanh'(u) = 1 - tanh(u)**2 at u = 7 is 3e-6 from two terms of size 1: in fp32 (torch's autograd
    too) it keeps 5% of its digits, which the fuzzer's H100 run flagged (gradient errors 1.3e-6
    against a bound of 8.3e-7; one via head.linear). Lowered as 4 exp(-2|u|) / (1 + exp(-2|u|))**2,
    the gradient is within 1e-5 of the float64 one, relative (torch fp32: 2.6e-2 on the same rows)."""
    head = lcg.HeadLoss(lcg.declare_term("tanh_row", formula)(), backend="triton")
    logits = (torch.randn(6, 61, generator=torch.Generator().manual_seed(0)) * 2 + 3).to(device)   # lse ~ 8
    labels = (torch.arange(6) * 7).to(device)
    x = logits.clone().requires_grad_()
    head(x, labels).loss.backward()
    want = reference(head)(logits, labels)[2]
    assert float((x.grad.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


# (found by the fuzzer's new grammar: the Triton kernel's top-k block recomputes the dense gradient
# at the top-k ids, and read is_argmax (row_max's gradient) and vector inputs that only the
# vocabulary loop had loaded: the scope check refused the file. And on uneven vocab shards, 40
# columns as 21 + 19, the vector's size was checked against the local width times the ranks: 42 on
# one rank and 38 on the other, refused on both, differently)
RowMaxVectorTopK = lcg.declare_term(
    "rowmax_vector_topk", S.row_max * S.topk_sum(S.exp(S.topk_logit - S.lse))
    + S.vsum(S.vector("u") * S.softmax * S.logit) * S.topk_sum(S.exp(S.topk_logprob) * S.topk_logit))


@pytest.mark.parametrize("plan", [Plan(tile=(16, 4, True)), Plan(reduction="none"),
                                  Plan(kind="sharded", world=2, shards=(21, 19))], ids=str)
def test_a_head_reading_row_max_and_a_vector_beside_a_topk_sum(plan, device, request):
    if plan.kind == "sharded" and device != "cpu":
        pytest.skip("vocab-parallel plans run on gloo CPU ranks")
    ranks = request.getfixturevalue("fuzz_ranks2") if plan.kind == "sharded" else None
    check(lcg.HeadLoss(RowMaxVectorTopK(), backend="triton"), plan, rows=7, vocab=40, seed=3, device=device,
          ranks=ranks)


def test_a_max_of_a_sum_that_simplifies_to_a_number_is_declared(device):
    # (found by the fuzzer: vsum(0) took itself for a number, which sympy's Max cannot compare)
    t = lcg.declare_term("max_of_zero_sum", S.Max(S.vsum(S.logit - S.logit), S.lse - S.target_logit))
    check(lcg.HeadLoss(t()), Plan(), rows=5, vocab=40, seed=0, device=device)


def test_a_sum_inside_another_sums_summand_beside_a_second_normaliser(device):
    # (found by the fuzzer: TopKForwardKL(temperature=2) adds sums that are combined, and the
    # accumulators renumbered after it; the gradient's summand kept the old name of the inner sum,
    # and read the outer one's: a gradient error of 0.17 at every column, on both backends)
    inner = lcg.declare_term("abs_deviation", S.vsum(S.softmax * S.Abs(S.logit - S.vsum(S.softmax**2))))
    for backend in ("triton", "torch"):
        check(lcg.HeadLoss(lcg.TopKForwardKL(temperature=2.0), inner(weight=0.3), backend=backend),
              Plan(), rows=3, vocab=40, seed=231, device=device)


def test_a_sum_of_a_function_of_a_vector_past_the_rows_end(device):
    # (found by the fuzzer: a read that takes the columns past the row's end as -inf logits loaded
    # the vector there as 0, and softmax * log(u) was 0 * -inf: the loss was NaN)
    t = lcg.declare_term("log_prior", S.vsum(S.softmax * S.log(S.vector("u"))))
    check(lcg.HeadLoss(t(), backend="triton"), Plan(), rows=3, vocab=61, seed=441, device=device)


def test_a_sum_of_zero_beside_a_sum_at_a_temperature(device):
    # (found by the H100 fuzz run: vsum(z - z) is vsum(0), which the lowering grouped with the other
    # sum by a ratio 0/0: a NaN coefficient the printer refused; a sum of 0 is now 0)
    t = lcg.declare_term("zero_sum", S.vsum(S.softmax_at(2)) + S.vsum(S.logit - S.logit) + S.lse)
    check(lcg.HeadLoss(t()), Plan(), rows=3, vocab=64, seed=231, device=device)


def test_a_class_prior_under_torch_compile(device):
    # (found by the H100 fuzz run: the compiled op had no argument for S.vector inputs, and its
    # launch indexed past the empty tuple)
    t = lcg.declare_term("prior_sum", S.vsum(S.vector("u")) + S.vsum(S.vector("u") * S.softmax))
    check(lcg.HeadLoss(t(weight=0.3)), Plan(kind="compile"), rows=3, vocab=64, seed=232, device=device)


def test_a_top_k_sum_beside_a_run_time_temperature(device):
    # (found by the fuzzer: a run-time temperature elsewhere in the formula rewrites every sum
    # relative to the row maxima, the top-k sum too; its gradient at the top-k entries kept the
    # row_max symbol, which no kernel defines: the head failed to generate, "reads ['z_max']")
    t = lcg.declare_term("topk_min", S.Min(S.topk_sum(S.exp(S.topk_logprob) * S.exp(S.topk_logit - S.lse)),
                                           S.lse_at(S.param("T"))) * S.lse_at(1 + S.token("a") ** 2))
    for backend in ("triton", "torch"):
        check(lcg.HeadLoss(t(T=0.8), backend=backend), Plan(), rows=6, vocab=64, seed=249, device=device)


def test_a_vector_whose_sum_cancels(device):
    # (found by the H200 fuzz run: vsum(u - stop_gradient(u)) is 0, so the kernel reads no u and the
    # head takes none, but the float64 reference evaluated the formula as written, without u)
    t = lcg.declare_term("cancelled", S.vsum(S.vector("u") - S.stop_gradient(S.vector("u"))) + S.lse)
    head = lcg.HeadLoss(t(weight=0.3, normalize="sum"))
    assert head.kernel.SPEC.vectors == ()
    check(head, Plan(), rows=3, vocab=64, seed=878, device=device)


def test_a_recursion_inside_sympy_is_a_refusal(device):
    # (found by the H200 fuzz run: sympy's Piecewise evaluation recursed without end on the
    # derivative of this nesting; a RecursionError from deep inside sympy is now a ValueError that
    # names the terms and says what to write)
    t = lcg.declare_term("nested_max", S.Max(S.Max(S.lse_at(S.param("T")), S.exp(S.target_logit - S.lse)),
                                             S.vsum(S.logsoftmax)))
    with pytest.raises(ValueError, match="nested_max.*Max/Min"):
        lcg.HeadLoss(t(T=0.8)).kernel


def test_a_min_with_a_constant_exponential(device):
    # (found by the H200 fuzz run: the Triton printer's shared exponentials turned exp(tanh(2)), a
    # number, into a function sympy's Min cannot compare: the head failed to generate)
    t = lcg.declare_term("min_const", S.Min(S.lse, S.exp(S.tanh(2))))
    check(lcg.HeadLoss(t(weight=0.3, normalize="sum")), Plan(), rows=3, vocab=40, seed=96, device=device)


def test_teacher_probabilities_that_sum_to_one_at_a_tensor_temperature(device):
    # (found by the CPU fuzz run: vsum(teacher_prob_at(T)) is 1, so the kernel reads no teacher and
    # the head takes none, but the float64 reference evaluated the formula as written, without one)
    t = lcg.declare_term("teacher_total", S.vsum(S.teacher_prob_at(S.param("T"))) + S.lse)
    head = lcg.HeadLoss(t(weight=0.3, T=torch.tensor(2.5, device=device)))
    assert not head.kernel.SPEC.uses_teacher
    check(head, Plan(), rows=3, vocab=61, seed=135, device=device)


def test_sums_that_sympy_cannot_compare_stay_apart(device):
    # (found by the CPU fuzz run: combining two sums asked sympy's simplify for their ratio, which
    # raised "zoo is not comparable" on the condition of this Piecewise: the head failed to build)
    t = lcg.declare_term("cond", S.Piecewise(
        (S.vsum(S.vector("u") * S.softmax * S.logsoftmax),
         (S.vsum(S.softmax_at(2) * S.Max(S.lse, 0.5)) / (S.lse - S.target_logit + 0.5)) > 0),
        (S.stop_gradient(S.vsum(S.softmax_at(1 + S.token("a") ** 2) * S.logsoftmax_at(2))), True)))
    check(lcg.HeadLoss(lcg.declare_term("lse2", S.lse_at(2))(weight=0.8), metrics=(t(),)), Plan(),
          rows=7, vocab=40, seed=462, device=device)


def test_tanh_of_a_positive_function_of_a_sum_inside_an_exponential(device):
    # (found by the CPU fuzz run, seed 9202: the derivative of tanh(exp(...)) took sympy's |exp(...)|,
    # which it wrote with sinh, cosh and arg, not knowing log(acc) real: no backend printed it)
    t = lcg.declare_term("nested_tanh", S.exp(S.tanh(S.exp(S.tanh(S.lse)))))
    check(lcg.HeadLoss(t(weight=1.0)), Plan(), rows=3, vocab=40, seed=9, device=device)


def test_a_kink_of_a_sum_of_a_vector_builds_in_seconds(device):
    # (found by the H200 fuzz run, a head that never finished building: combining the two sums of
    # Min's derivative asked sympy's simplify for a quotient of Piecewise conditions, which ran for
    # many minutes; such sums now stay apart)
    t = lcg.declare_term("kink", S.Abs(S.Min(S.target_logit, S.vsum(S.vector("u") * S.softmax * S.log(S.softmax)))))
    check(lcg.HeadLoss(t(weight=0.8, normalize="sum")), Plan(), rows=7, vocab=64, seed=887, device=device)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_labels_at_the_edges_of_tiles_with_the_gradient_written_over_the_logits(dtype, split):
    """The label's part of the gradient is added at its column after the gradient read (the Triton
    template, ``emit.label_part``), from the label's raw logit read before the read overwrites it
    (``inplace_backward``): labels at the first and last column of a tile and of the row, with a
    softcap, against float64 autograd."""
    from losscodegen.backends.triton import tiles
    V, scale, cap = 70, 0.7, 20.0
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(9, V, generator=g, dtype=torch.float64) * 4).to(dtype)
    y = torch.tensor([0, 15, 16, 31, 32, 68, 69, -100, 47])
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), logit_scale=scale, softcap=cap,
                        inplace_backward=True, backend="triton")
    head.tile_override = tiles.Config(16, 4, split)
    base = x.clone().requires_grad_()
    head(base * 1.0, y).loss.backward()
    x64 = x.double().requires_grad_()
    z = scale * cap * torch.tanh(x64 / cap)
    lse, valid = torch.logsumexp(z, -1), y != -100
    rows = lse - z.gather(1, y.clamp(min=0)[:, None])[:, 0] + 0.1 * lse**2
    (rows[valid].sum() / valid.sum()).backward()
    lcg.testing.compare("gradient", base.grad, x64.grad, dtype)
