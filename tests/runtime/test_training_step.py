"""A head inside a training step: torch.compile(fullgraph=True), the gradient written into the logits'
storage, reduction="sum", and value checks that cost no host sync (on the CPU they raise at once)."""
import pytest
import torch

import losscodegen as lcg
from losscodegen import autograd
from losscodegen.inputs import check_call
from helpers import check_head, make_inputs, policy_inputs, topk_inputs

pytestmark = pytest.mark.cpu   # CPU tensors throughout (conftest's ``cpu``)


def _case(name, R=12, V=96):
    """A head and every input it reads: a teacher, per-row tokens, top-k ids, segments."""
    logits, labels, g = make_inputs(R=R, V=V, ignored=(1, 6))
    if name == "teacher":
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2), lcg.ForwardKL(weight=0.5),
                            metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
        return head, logits, labels, dict(teacher_logits=torch.randn(R, V, generator=g))
    if name == "tokens":
        head = lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction()))
        return head, logits, labels, policy_inputs(logits, labels, g, spread=0.1)
    if name == "topk":
        inputs = topk_inputs(R, V, 5, g)
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.3))
        return head, logits, labels, inputs
    head = lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1), metrics=(lcg.Entropy(),))
    return head, logits, labels, dict(policy_inputs(logits, labels, g, spread=0.1), segment_ids=torch.arange(R) // 4,
                                      num_segments=R // 4)


@pytest.mark.parametrize("name", ["teacher", "tokens", "topk", "segments"])
def test_compiled_fullgraph_equals_eager_without_recompiling(name):
    head, logits, labels, inputs = _case(name)

    def step(x, y, kw):
        out = head(x, y, **kw)
        return out.loss, out.terms, out.metrics

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for call in range(3):
        x = (logits + call).requires_grad_()
        with torch._dynamo.config.patch(error_on_recompile=call > 0):
            loss, terms, metrics = compiled(x, labels, inputs)
        loss.backward()
        grad, x.grad = x.grad, None
        ref = head(x, labels, **inputs)
        ref.loss.backward()
        assert torch.equal(loss, ref.loss)
        for k in ref.terms:
            assert torch.equal(terms[k], ref.terms[k]), k
        for k in ref.metrics:
            assert torch.equal(metrics[k], ref.metrics[k]), k
        assert torch.equal(grad, x.grad)


@pytest.mark.parametrize("name,reduction", [("tokens", "mean"), ("segments", "mean"), ("teacher", "none")])
def test_the_compile_op_is_registered_consistently(name, reduction):
    """torch.library's own checks of the op: its schema, its fake (shapes only) against the real
    outputs, and its autograd registration. (Its AOT check compares two calls' outputs, and the
    gradient handle differs from call to call by design.) The arguments come from the op's one
    declaration (autograd.op_args), as the compiled path's do."""
    head, logits, labels, inputs = _case(name)
    call = check_call(head, head.kernel.SPEC, logits, labels, dict(inputs, reduction=reduction))
    args = autograd.op_args(head, logits.requires_grad_(), call)
    results = torch.library.opcheck(torch.ops.losscodegen.head.default, tuple(args),
                                    test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(results.values()) == {"SUCCESS"}, results


def test_compiled_step_through_a_linear_layer():
    """hidden -> logits -> head -> backward, compiled whole: the weight's gradient equals eager's."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(80, 16, generator=g)
    labels = torch.randint(0, 80, (10,), generator=g)

    def step(w):
        return head(hidden @ w.t(), labels).loss

    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.compile(step, fullgraph=True, backend="aot_eager")(w1).backward()
    step(w2).backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["teacher", "topk", "segments"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_gradient_into_the_logits(name, dtype):
    head, logits, labels, inputs = _case(name)
    logits = logits.to(dtype)
    expected = logits.clone().requires_grad_()
    head(expected, labels, **inputs).loss.backward()

    inplace = lcg.HeadLoss(*head.loss_terms, metrics=head.metric_terms, inplace_backward=True)
    raw = logits.clone().requires_grad_()
    x = raw * 1.0                          # a non-leaf, as logits = hidden @ W.T would be
    storage = x.data_ptr()
    out = inplace(x, labels, **inputs)
    assert torch.equal(x.detach(), expected.grad)   # the logits now hold dL/dlogits
    (2.0 * out.loss).backward()
    assert raw.grad.data_ptr() != storage and x.data_ptr() == storage
    assert torch.equal(raw.grad, 2.0 * expected.grad)

    leaf = logits.clone().requires_grad_()   # a leaf: its .grad is its own storage, not a copy of it
    inplace(leaf, labels, **inputs).loss.backward()
    assert leaf.grad.data_ptr() == leaf.data_ptr()
    assert torch.equal(leaf.grad, expected.grad)


def test_inplace_backward_refuses_what_would_break():
    head = lcg.HeadLoss(lcg.CrossEntropy(), inplace_backward=True)
    logits, labels, _ = make_inputs(R=6, V=64)
    raw = logits.clone().requires_grad_()
    saved = torch.tanh(raw)                # TanhBackward keeps its output: these very logits
    out = head(saved, labels)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()
    strided = logits.t().contiguous().t().requires_grad_()  # column stride != 1: no in-place view
    with pytest.raises(ValueError, match="inplace_backward"):
        head(strided * 1.0, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduction_sum(dtype):
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=0.7), lcg.ZLoss(weight=1e-2),
                        metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    logits, labels, g = make_inputs(R=12, V=256, dtype=dtype, shape=(3, 4))
    check_head(head, logits, labels, reduction="sum")
    check_head(head, logits, labels, reduction="sum", loss_mask=torch.rand(3, 4, generator=g) > 0.3)
    with pytest.raises(ValueError, match="divisor"):
        head(logits, labels, reduction="sum", divisor=3.0)


def test_reduction_sum_of_a_segment_term():
    head, logits, labels, inputs = _case("segments")
    check_head(head, logits, labels, reduction="sum", **inputs)


def test_zero_valid_rows_sum_to_zero():
    logits, labels, _ = make_inputs(R=5, V=64)
    labels[:] = -100
    x = logits.clone().requires_grad_()
    out = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))(x, labels, reduction="sum")
    out.loss.backward()
    assert out.loss.item() == 0 and out.metrics["entropy"].item() == 0
    assert torch.count_nonzero(x.grad) == 0


def test_bad_label_raises_at_once_on_the_cpu_then_calls_go_on():
    head = lcg.HeadLoss(lcg.CrossEntropy())
    logits, labels, _ = make_inputs(R=6, V=64)
    bad = labels.clone()
    bad[4] = 70
    with pytest.raises(ValueError, match=r"labels: values must be in \[0, 64\).*found 70"):
        head(logits, bad)
    assert torch.isfinite(head(logits, labels).loss)       # the flag was reset
    loss = lcg.HeadLoss(lcg.CrossEntropy(), validate=False)(logits, bad).loss
    assert torch.isfinite(loss)                              # unchecked, but never out of bounds


def test_bad_segment_id_raises_and_names_the_value():
    head, logits, labels, inputs = _case("segments")
    inputs["segment_ids"] = inputs["segment_ids"].clone()
    inputs["segment_ids"][2] = 7
    with pytest.raises(ValueError, match=r"segment_ids .*num_segments=3\).*found 7"):
        head(logits, labels, **inputs)


def test_one_head_across_changing_calls_equals_a_fresh_head_each_time():
    """A head keeps what a call's signature decides: calls that change the row count, the reduction,
    the mask, the divisor or the teacher's dtype must each equal a fresh head's call exactly."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),))
    g = torch.Generator().manual_seed(1)
    calls = [(12, {}), (7, dict(reduction="sum")), (12, dict(reduction="none")), (5, dict(divisor=3.0)),
             (12, dict(loss_mask=True)), (7, dict(teacher_dtype=torch.bfloat16)), (12, {})]
    for rows, kw in calls:
        logits, labels = torch.randn(rows, 40, generator=g), torch.randint(0, 40, (rows,), generator=g)
        labels[1] = -100
        inputs = dict(teacher_logits=torch.randn(rows, 40, generator=g).to(kw.pop("teacher_dtype", torch.float32)))
        if kw.pop("loss_mask", False):
            inputs["loss_mask"] = torch.arange(rows) % 3 != 0
        inputs.update(kw)
        fresh = lcg.HeadLoss(*head.loss_terms, metrics=head.metric_terms)
        outs = []
        for h in (head, fresh):
            x = logits.clone().requires_grad_()
            out = h(x, labels, **inputs)
            out.loss.sum().backward()
            outs.append((out.loss, out.terms, out.metrics, x.grad))
        (loss, terms, metrics, grad), (loss_f, terms_f, metrics_f, grad_f) = outs
        assert torch.equal(loss, loss_f) and torch.equal(grad, grad_f), (rows, kw)
        assert all(torch.equal(terms[n], terms_f[n]) for n in terms)
        assert all(torch.equal(metrics[n], metrics_f[n]) for n in metrics)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_inplace_backward_under_reduction_none_makes_a_node_that_saved_the_logits_fail(backend):
    """reduction="none" writes the gradient over the logits in backward: their version counter is bumped
    there, so a node that saved them before the call fails loudly instead of reading gradient values."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), inplace_backward=True, backend=backend)
    logits, labels, _ = make_inputs(R=6, V=64)
    hidden = logits.clone().requires_grad_()
    x = hidden * 1.0
    other = x.pow(2).mean()              # PowBackward keeps x: these very logits
    out = head(x, labels, reduction="none")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss.sum() + other).backward()


@pytest.mark.parametrize("which", ["teacher_logits", "advantages"])
def test_inplace_backward_refuses_an_input_that_shares_the_logits_memory(which):
    """The kernel writes the gradient over the logits while it still reads the other inputs: a
    teacher that is the logits themselves (self-distillation, ``logits.detach()``), or a per-row
    input viewed from them, is refused by name; a copy is accepted."""
    head = lcg.HeadLoss(lcg.ForwardKL(), lcg.GRPO(), inplace_backward=True)
    logits, labels, g = make_inputs(R=6, V=64)
    x = (logits.clone().requires_grad_() * 1.0)
    inputs = dict(policy_inputs(logits, labels, g, spread=0.1), teacher_logits=torch.randn(6, 64, generator=g))
    # (a per-row input viewed contiguously from the logits: a strided one is copied when checked)
    shared = dict(inputs, **{which: x.detach() if which == "teacher_logits" else x.detach().view(-1)[:6]})
    with pytest.raises(ValueError, match=f"{which} shares the logits' memory"):
        head(x, labels, **shared)
    copied = dict(inputs, **{which: shared[which].clone()})
    head(x, labels, **copied).loss.backward()
    if which == "teacher_logits":       # the other half of one buffer: the same storage, no overlap
        both = torch.cat([logits, inputs["teacher_logits"]]).requires_grad_() * 1.0
        head(both[:6], labels, **dict(inputs, teacher_logits=both[6:].detach())).loss.backward()
