"""Teacher logits that require grad (co-distillation, deep mutual learning): every teacher term gives
them their gradient, from the head's teacher-gradient kernel, checked against float64 torch autograd
of the formulas (``lcg.testing.reference``), on both backends, fp32 and bf16, with ignored and
masked rows; ``head.linear``'s teacher hidden states, weight and bias; vocab shards; Liger's
symmetric JSD call. A teacher that does not require grad runs the head's default kernel: nothing of
the teacher's gradient is generated, computed or written."""
import os

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen.testing import compare
from helpers import DEVICE, policy_inputs, run_ranks

DTYPES = (torch.float32, torch.bfloat16)
# a user's term of both logits inside one sum: the squared difference of the logits (logit matching)
LogitMSE = lcg.declare_term("logit_mse", S.vsum((S.logit - S.teacher_logit) ** 2) / S.vocab_size)


def _swapped(term: lcg.terms.Term) -> lcg.terms.Term:
    """``term`` with the student's and the teacher's logits exchanged (z <-> t, LSE(a, b) as
    LSE(b, a)): its gradient with respect to the logits is ``term``'s with respect to the teacher's."""
    formula = term.formula.xreplace({S.logit: S.teacher_logit, S.teacher_logit: S.logit})
    formula = formula.replace(lambda e: isinstance(e, S.LSE), lambda e: S.LSE(e.args[1], e.args[0]))
    return lcg.declare_term(term.name, formula, defaults=dict(term.params))(weight=term.weight,
                                                                             normalize=term.normalize)


def _reference(head, logits, labels, teacher, **inputs):
    """float64 (loss, values, dL/dlogits, dL/dteacher_logits): lcg.testing.reference of the head, and
    of its teacher-reading terms with the roles swapped (the terms that do not read the teacher add
    nothing to its gradient; the rows are the head's, the labels and loss_mask marking the valid ones)."""
    loss, values, grad = lcg.testing.reference(head)(logits, labels, teacher_logits=teacher, **inputs)
    reads = [t for t in head.loss_terms
             if t.formula.has(S.teacher_logit) or any(a.args[1] != 0 for a in t.formula.atoms(S.LSE))]
    swapped = lcg.HeadLoss(*[_swapped(t) for t in reads], ignore_index=head.ignore_index)
    # (its teacher's logits are read as given: the student's after its softcap and scale)
    z = logits.double() if head.softcap is None else head.softcap * torch.tanh(logits.double() / head.softcap)
    _, _, tgrad = lcg.testing.reference(swapped)(teacher, labels, teacher_logits=z * head.logit_scale, **inputs)
    return loss, values, grad, tgrad


def _inputs(R, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * 2).to(dtype)
    teacher = (torch.randn(R, V, generator=g) * 2 + 0.5 * logits.float()).to(dtype)
    labels = torch.randint(0, V, (R,), generator=g)
    labels[[1, 5]] = -100
    mask = torch.ones(R, dtype=torch.bool)
    mask[[2, 9]] = False
    return logits, teacher, labels, mask


def _check(head, logits, teacher, labels, *, student_grad=True, **inputs):
    """The head's loss, values and the gradients of both logits (the teacher's alone where not
    ``student_grad``) against the float64 reference, compared as lcg.testing.assert_parity compares."""
    dtype = logits.dtype
    x = logits.clone().to(DEVICE).requires_grad_(student_grad)
    t = teacher.clone().to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), teacher_logits=t, **{k: v.to(DEVICE) for k, v in inputs.items()})
    out.loss.sum().backward()
    ref_loss, ref_values, ref_grad, ref_tgrad = _reference(head, logits, labels, teacher, **inputs)
    compare("loss", out.loss, ref_loss, dtype)
    for name, value in out.terms.items():
        compare(name, value, ref_values[name], dtype)
    if student_grad:
        compare("gradient", x.grad, ref_grad, dtype)
    else:
        assert x.grad is None
    assert t.grad.dtype == dtype and t.grad.shape == teacher.shape
    compare("gradient", t.grad, ref_tgrad, dtype, where="(teacher) ")
    # an ignored or masked row gives the teacher nothing
    valid = (labels != -100) & inputs.get("loss_mask", True)
    assert (t.grad[~valid] == 0).all()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
@pytest.mark.parametrize("term", [lcg.ForwardKL(temperature=2.0), lcg.ReverseKL(), lcg.JSD(beta=0.3)],
                         ids=["forward_kl", "reverse_kl", "jsd"])
def test_teacher_terms_give_the_teacher_its_gradient(term, backend, dtype):
    logits, teacher, labels, mask = _inputs(12, 300, dtype)
    _check(lcg.HeadLoss(term), logits, teacher, labels, loss_mask=mask)


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_mixed_head_with_a_users_term_and_softcap(backend):
    """Cross-entropy (no path to the teacher) beside forward KL and a user's term of both logits
    in one sum; the student softcapped and scaled (the teacher's logits are read as they are)."""
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.ForwardKL(weight=0.7), LogitMSE(weight=0.2),
                        softcap=30.0, logit_scale=0.8)
    logits, teacher, labels, mask = _inputs(12, 257, torch.float32, seed=1)
    _check(head, logits, teacher, labels, loss_mask=mask)


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_teacher_alone_requires_grad(backend):
    """Only the teacher's logits require grad (the logits are data): the teacher gets its gradient,
    the logits none, and they are left as they were (inplace_backward writes only into logits that
    asked for their gradient)."""
    head = lcg.HeadLoss(lcg.JSD(beta=0.5), inplace_backward=True)
    logits, teacher, labels, mask = _inputs(10, 200, torch.float32, seed=2)
    kept = logits.clone()
    _check(head, logits, teacher, labels, student_grad=False, loss_mask=mask)
    assert torch.equal(logits, kept)


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_reduction_none_upstream_gradients_reach_the_teacher(backend):
    """reduction="none": the deferred gradient launch gives the teacher its gradient for upstream
    gradients on the per-row loss and on a term's rows."""
    head = lcg.HeadLoss(lcg.ForwardKL(temperature=1.5), lcg.ReverseKL(weight=0.5))
    logits, teacher, labels, _ = _inputs(10, 200, torch.float32, seed=3)
    x, t = logits.clone().requires_grad_(), teacher.clone().requires_grad_()
    g = torch.Generator().manual_seed(4)
    up, up_rows = torch.randn(10, generator=g), torch.randn(10, generator=g)
    out = head(x, labels, teacher_logits=t, reduction="none")
    ((out.loss * up).sum() + (out.rows["reverse_kl"] * up_rows).sum()).backward()

    def reference_grad(h, first, second):
        # dL/d(first) for the same upstream gradients, from the reference's own rows (Reference.evaluate)
        xd, loss, _, rows = lcg.testing.reference(h).evaluate(first, labels, teacher_logits=second,
                                                              reduction="none")
        ((loss * up.double()).sum() + (rows["reverse_kl"] * up_rows.double()).sum()).backward()
        return xd.grad
    swapped = lcg.HeadLoss(*[_swapped(term) for term in head.loss_terms])
    compare("gradient", x.grad, reference_grad(head, logits, teacher), torch.float32)
    compare("gradient", t.grad, reference_grad(swapped, teacher, logits), torch.float32, where="(teacher) ")


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_beside_a_segment_term(backend):
    """A segment term (GSPO) beside JSD: the rows, the segment kernel, then the gradient launch, which
    writes the teacher's gradient."""
    logits, teacher, labels, mask = _inputs(12, 100, torch.float32, seed=8)
    policy = policy_inputs(logits, labels, torch.Generator().manual_seed(9), spread=0.3)
    head = lcg.HeadLoss(lcg.GSPO(), lcg.JSD(beta=0.4))
    _check(head, logits, teacher, labels, loss_mask=mask, segment_ids=torch.arange(12) // 4, **policy)


@pytest.mark.cpu
def test_nothing_extra_without_requires_grad():
    """A teacher that does not require grad (or one that does, under no_grad) runs the head's default
    kernel: the teacher-gradient kernel is neither generated nor launched, and nothing is written
    for the teacher. One that does gets the variant, whose interface adds the gradient's pointer."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), backend="torch")
    logits, teacher, labels, _ = _inputs(10, 64, torch.float32)
    x = logits.clone().requires_grad_()
    head(x, labels, teacher_logits=teacher).loss.backward()
    with torch.no_grad():
        head(x, labels, teacher_logits=teacher.clone().requires_grad_())
    assert head._teacher_kernel is None and not head.kernel.SPEC.teacher_grad
    assert "tgrad_ptr" not in head.kernel.SPEC.args
    assert "tgrad" not in head.source().text
    t = teacher.clone().requires_grad_()
    head(logits.clone().requires_grad_(), labels, teacher_logits=t).loss.backward()
    variant = head.kernel_for(True)
    assert variant.SPEC.teacher_grad and variant.KEY == head.teacher_key != head.key
    assert variant.SPEC.args[variant.SPEC.args.index("t_stride") + 1:][:2] == ("tgrad_ptr", "tgrad_stride")
    assert t.grad is not None


@pytest.mark.cpu
def test_top_k_log_probs_that_require_grad_are_refused():
    head = lcg.HeadLoss(lcg.TopKForwardKL(), backend="torch")
    logits, _, labels, _ = _inputs(10, 32, torch.float32)
    lps = torch.log_softmax(torch.randn(10, 3), -1).requires_grad_()
    with pytest.raises(ValueError, match="teacher_topk_logprobs requires grad.*detach"):
        head(logits, labels, teacher_topk_ids=torch.arange(3).repeat(10, 1), teacher_topk_logprobs=lps)


# ---- head.linear ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_linear_teacher_hidden_weight_and_bias_get_their_gradients(backend, dtype):
    """head.linear with a teacher whose hidden states, weight and bias require grad: their gradients
    through the chunk loop (two chunks and a ragged one), against float64 autograd of the unfused
    formula (the float64 reference's dL/dlogits and dL/dteacher_logits, through the two linear layers)."""
    R, H, Ht, V = 13, 16, 8, 72
    g = torch.Generator().manual_seed(5)
    h, w, b = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.5, torch.randn(V, generator=g) * 0.5
    th, tw, tb = torch.randn(R, Ht, generator=g), torch.randn(V, Ht, generator=g), torch.randn(V, generator=g)
    h, w, b, th, tw, tb = (a.to(dtype) for a in (h, w, b, th, tw, tb))
    labels = torch.randint(0, V, (R,), generator=g)
    labels[[1, 7]] = -100
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.JSD(beta=0.4, temperature=2.0, weight=0.5))
    leaves = [a.clone().requires_grad_() for a in (h, w, b, th, tw, tb)]
    out = head.linear(leaves[0], leaves[1], labels, bias=leaves[2], teacher_hidden=leaves[3],
                      teacher_weight=leaves[4], teacher_bias=leaves[5], chunk_rows=5)
    out.loss.backward()
    d = [a.double() for a in (h, w, b, th, tw, tb)]
    logits, teacher = d[0] @ d[1].t() + d[2], d[3] @ d[4].t() + d[5]
    ref_loss, _, dx, dt = _reference(head, logits, labels, teacher)
    want = [dx @ d[1], dx.t() @ d[0], dx.sum(0), dt @ d[4], dt.t() @ d[3], dt.sum(0)]
    # (bf16: the logits are rounded to bf16 by the products, as in tests/runtime/test_linear.py)
    tolerances = None if dtype == torch.float32 else (1e-2, 1e-2, 3e-2)
    compare("loss", out.loss, ref_loss, dtype, tolerances=tolerances)
    for name, leaf, expected in zip(("hidden", "weight", "bias", "teacher_hidden", "teacher_weight",
                                     "teacher_bias"), leaves, want):
        assert leaf.grad.dtype == dtype
        compare("gradient", leaf.grad, expected, dtype, where=f"({name}) ", tolerances=tolerances)


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_linear_reduction_none_gives_the_teacher_its_gradients_in_backward(backend):
    """head.linear under reduction="none": backward makes each chunk's logits (and the teacher's)
    again and runs the gradient launch with the rows' upstream gradients, the teacher's weight and
    hidden states getting theirs through the same products."""
    R, H, Ht, V = 11, 12, 6, 40
    g = torch.Generator().manual_seed(10)
    h, w = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    th, tw = torch.randn(R, Ht, generator=g), torch.randn(V, Ht, generator=g)
    labels = torch.randint(0, V, (R,), generator=g)
    labels[3] = -100
    up = torch.randn(R, generator=g)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5, temperature=2.0))
    leaves = [a.clone().requires_grad_() for a in (h, w, th, tw)]
    out = head.linear(leaves[0], leaves[1], labels, teacher_hidden=leaves[2], teacher_weight=leaves[3],
                      chunk_rows=4, reduction="none")
    (out.loss * up).sum().backward()
    d = [a.double() for a in (h, w, th, tw)]
    logits, teacher = d[0] @ d[1].t(), d[2] @ d[3].t()

    def reference_grad(ref_head, first, second):
        xd, loss, _, _ = lcg.testing.reference(ref_head).evaluate(first, labels, teacher_logits=second,
                                                                  reduction="none")
        (loss * up.double()).sum().backward()
        return xd.grad
    dx = reference_grad(head, logits, teacher)
    dt = reference_grad(lcg.HeadLoss(_swapped(head.loss_terms[1])), teacher, logits)
    for name, leaf, want in zip(("hidden", "weight", "teacher_hidden", "teacher_weight"), leaves,
                                (dx @ d[1], dx.t() @ d[0], dt @ d[3], dt.t() @ d[2])):
        compare("gradient", leaf.grad, want, torch.float32, where=f"({name}) ")


# ---- Liger-Kernel's symmetric JSD call --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
def test_liger_jsd_symmetry_with_the_roles_swapped(backend, dtype):
    """Liger-Kernel's test/transformers/test_jsd.py (``_test_correctness_once``) calls its JSD with
    the student's and the teacher's log-probs, then with the roles swapped and a teacher that
    requires grad (``target_jsd(target, x3)``), and asserts the two values equal (JSD at beta 0.5 is
    symmetric). The same calls through our head (``JSD.trl(beta=0.5)``, Liger's convention; its
    batchmean is our mean over rows without labels), and the gradients too: the swapped call's
    teacher gradient is the first call's student gradient."""
    B, T, V = 2, 8, 1271
    g = torch.Generator().manual_seed(42)
    inp = torch.randn(B * T, V, generator=g).to(dtype).log_softmax(dim=-1)
    x2, x3 = inp.detach().clone().requires_grad_(True), inp.detach().clone().requires_grad_(True)
    with torch.no_grad():
        target = torch.randn(B * T, V, generator=g).to(dtype).log_softmax(dim=-1)
    jsd = lcg.HeadLoss(lcg.JSD.trl(beta=0.5))
    output2 = jsd(x2.to(DEVICE), teacher_logits=target.to(DEVICE)).loss
    # symmetry
    output3 = jsd(target.to(DEVICE), teacher_logits=x3.to(DEVICE)).loss
    rtol = 1e-6 if dtype == torch.float32 else 5e-2
    assert torch.allclose(output3, output2, atol=1e-7, rtol=rtol)
    ref_loss, _, ref_grad = lcg.testing.reference(jsd)(inp, teacher_logits=target)
    compare("loss", output2, ref_loss, dtype)
    output2.backward()
    output3.backward()
    compare("gradient", x3.grad, ref_grad, dtype, where="(the swapped call's teacher) ")
    compare("gradient", x2.grad, ref_grad, dtype)


# ---- vocab-parallel ---------------------------------------------------------------------------------
def _sharded_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # (JSD: an exact read, whose sums are all-reduced after the stats' all-gather)
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.ForwardKL(temperature=2.0), lcg.JSD(beta=0.3))
    logits, teacher, labels, mask = _inputs(10, 125, torch.float32, seed=6)
    cols = torch.tensor_split(torch.arange(125), world)[rank]
    x, t = logits[:, cols].clone().requires_grad_(), teacher[:, cols].clone().requires_grad_()
    out = head(x, labels, teacher_logits=t, loss_mask=mask, process_group=dist.group.WORLD)
    out.loss.backward()
    ref_loss, _, ref_grad, ref_tgrad = _reference(head, logits, labels, teacher, loss_mask=mask)
    errors = []
    for name, got, want in (("loss", out.loss, ref_loss), ("gradient", x.grad, ref_grad[:, cols]),
                            ("gradient", t.grad, ref_tgrad[:, cols])):
        try:
            compare(name, got, want, torch.float32, where=f"(rank {rank}) ")
        except AssertionError as e:
            errors.append(str(e))
    queue.put(errors)
    dist.destroy_process_group()


@pytest.mark.cpu
@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_vocab_shards_give_each_rank_its_teacher_gradient(backend):
    """Teacher logits sharded by vocabulary (2 ranks, 63 and 62 columns): each rank gets its shard of
    the teacher's gradient, from the stats merged across the shards."""
    errors = run_ranks(_sharded_worker, 2, 2)
    assert errors == [[]] * 2, errors


@pytest.mark.cpu
def test_under_torch_compile_the_call_runs_eagerly_and_the_teacher_gets_its_gradient():
    """Under torch.compile a call whose teacher requires grad runs eagerly (a graph break, as
    head.linear's: the compiled op returns the logits' gradient only), with both gradients."""
    head = lcg.HeadLoss(lcg.ReverseKL(temperature=2.0), backend="torch")
    logits, teacher, labels, _ = _inputs(10, 48, torch.float32, seed=7)
    x, t = logits.clone().requires_grad_(), teacher.clone().requires_grad_()
    step = torch.compile(lambda x, t: head(x, labels, teacher_logits=t).loss, backend="aot_eager")
    step(x, t).backward()
    _, _, ref_grad, ref_tgrad = _reference(head, logits, labels, teacher)
    compare("gradient", x.grad, ref_grad, torch.float32)
    compare("gradient", t.grad, ref_tgrad, torch.float32, where="(teacher) ")
