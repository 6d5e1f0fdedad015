"""What users pass in is taken as they meant it or refused naming it (issue 30, CONTRACT.md's
"Soundness"): term options by keyword, bools as 0/1 switches, non-finite values named, inputs changed
in place after a forward, per-call parameter values, learnable weights, shards of any width, segment
ids of any size, the kernel cache's writes, ``check``'s sizes, metric rows' grad."""
import math

import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg
import losscodegen.symbols as S
from helpers import DEVICE, check_head, make_inputs, policy_inputs

pytestmark = pytest.mark.cpu   # CPU tensors throughout (conftest's ``cpu``)


def _policy(R=16, V=64, seed=0):
    logits, labels, g = make_inputs(R=R, V=V, ignored=(1, 6), seed=seed)
    return logits, labels, policy_inputs(logits, labels, g, spread=0.3)


# ---- 1. term options are keyword-only -------------------------------------------------------------
@pytest.mark.parametrize("make, keywords", [
    (lambda: lcg.CrossEntropy(0.1), "weight=..., label_smoothing=..."),
    (lambda: lcg.JSD(0.3), "weight=..., beta=..., temperature=..."),
    (lambda: lcg.GRPO(0.2, 0.28), "weight=..., eps_low=..., eps_high=..., kl_beta=..."),
    (lambda: lcg.ZLoss(1e-4), "weight=..."),
])
def test_a_term_option_passed_positionally_is_refused_naming_the_keywords(make, keywords):
    with pytest.raises(TypeError, match=r"takes its options by keyword: " + keywords.replace(".", r"\.")):
        make()


def test_a_declared_term_called_positionally_is_refused_by_its_name():
    Scaled = lcg.declare_term("scaled", S.param("a") * (S.lse - S.target_logit))
    with pytest.raises(TypeError, match=r"scaled takes its options by keyword: weight=\.\.\., a=\.\.\."):
        Scaled(2.0)


def test_label_smoothing_by_keyword_is_torchs_label_smoothing():
    logits, labels, _ = make_inputs(R=12, V=40)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1))
    x = logits.clone().requires_grad_()
    out = head(x, labels)
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    ref = F.cross_entropy(x64, labels, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)


# ---- 2. bools as 0/1 switches, non-finite values refused ---------------------------------------------
def test_kl_bias_correction_true_is_trls_bias_corrected_kl():
    logits, labels, inputs = _policy()
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=0.1, kl_bias_correction=True))
    assert dict(head.loss_terms[0].params)["kl_bias_correction"] == 1.0
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), **inputs)
    out.loss.backward()
    # TRL's GRPO loss (use_bias_correction_kl=True), float64
    z = logits.double().requires_grad_()
    valid = labels != -100
    logp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    r = torch.exp(logp - inputs["old_logprobs"].double().cpu())
    A = inputs["advantages"].double().cpu()
    d = inputs["ref_logprobs"].double().cpu() - logp
    per_row = -torch.min(r * A, r.clamp(0.8, 1.2) * A) + 0.1 * (torch.exp(d) - d - 1) * r
    ref = per_row[valid].mean()
    ref.backward()
    torch.testing.assert_close(out.loss.double().cpu(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double().cpu(), z.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("make, message", [
    (lambda: lcg.CrossEntropy(label_smoothing=math.nan), "cross_entropy: parameter label_smoothing must be finite"),
    (lambda: lcg.GRPO(eps_high=math.inf), "grpo: parameter eps_high must be finite"),
    (lambda: lcg.GRPO(kl_beta=-math.inf), "grpo: parameter kl_beta must be finite"),
    (lambda: lcg.ForwardKL(temperature=math.inf), "forward_kl: parameter temperature must be finite"),
    (lambda: lcg.CrossEntropy(weight=math.inf), "cross_entropy: weight must be finite"),
    (lambda: lcg.ZLoss(weight=torch.tensor(math.nan)), "z_loss: weight must be finite"),
    (lambda: lcg.GRPO(kl_beta=torch.tensor(math.inf)), "grpo: parameter kl_beta must be finite"),
])
def test_a_non_finite_parameter_or_weight_is_refused_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_an_infinite_clamp_bound_is_no_bound():
    logits, labels, inputs = _policy()
    check_head(lcg.HeadLoss(lcg.GRPO(delta=math.inf, eps_high=0.28)), logits, labels, **inputs)


# ---- 3. an input changed in place after the forward ----------------------------------------------
_INPLACE = "modified by an inplace operation"


@pytest.mark.parametrize("changed", ["logits", "labels", "loss_mask", "advantages", "old_logprobs", "teacher_logits"])
def test_an_input_changed_in_place_before_a_per_row_backward_raises_as_torch_does(changed):
    logits, labels, inputs = _policy()
    g = torch.Generator().manual_seed(3)
    inputs = dict(inputs, loss_mask=torch.rand(16, generator=g) > 0.2,
                  teacher_logits=torch.randn(16, 64, generator=g))
    head = lcg.HeadLoss(lcg.GRPO(), lcg.ForwardKL(weight=0.3))
    x = logits.clone().requires_grad_()
    out = head(x, labels, reduction="none", **inputs)
    tensor = {"logits": x, "labels": labels, **inputs}[changed]
    with torch.no_grad():
        tensor.bitwise_not_() if tensor.dtype == torch.bool else tensor.fill_(0) if changed == "labels" \
            else tensor.mul_(2)
    with pytest.raises(RuntimeError, match=_INPLACE):
        out.loss.sum().backward()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_class_prior_changed_in_place_before_a_per_row_backward_raises_as_torch_does(compiled):
    # (an S.vector input is read again by the deferred gradient launch like the per-row inputs; it was
    # not among what backward saved, nor an argument of the compiled op: found by the H100 fuzz run)
    prior_term = lcg.declare_term("prior_ce", S.lse - S.target_logit - S.vsum(S.vector("prior") * S.logsoftmax))
    head = lcg.HeadLoss(prior_term())
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 40, generator=g).requires_grad_()
    labels, prior = torch.randint(0, 40, (12,), generator=g), torch.rand(40, generator=g)
    call = torch.compile(lambda x, labels, prior: head(x, labels, reduction="none", prior=prior).loss) \
        if compiled else (lambda x, labels, prior: head(x, labels, reduction="none", prior=prior).loss)
    loss = call(x, labels, prior)
    with torch.no_grad():
        prior.mul_(2)
    with pytest.raises(RuntimeError, match=_INPLACE):
        loss.sum().backward()


@pytest.mark.parametrize("changed", ["hidden", "weight", "teacher_hidden", "teacher_weight", "labels", "advantages"])
def test_an_input_changed_in_place_before_a_per_row_linear_backward_raises_as_torch_does(changed):
    g = torch.Generator().manual_seed(4)
    R, H, V = 12, 8, 40
    t = dict(hidden=torch.randn(R, H, generator=g).requires_grad_(), weight=torch.randn(V, H, generator=g),
             teacher_hidden=torch.randn(R, H, generator=g), teacher_weight=torch.randn(V, H, generator=g),
             labels=torch.randint(0, V, (R,), generator=g), advantages=torch.randn(R, generator=g),
             old_logprobs=torch.randn(R, generator=g) - 3)
    head = lcg.HeadLoss(lcg.GRPO(), lcg.ReverseKL(weight=0.5))
    out = head.linear(t["hidden"], t["weight"], t["labels"], teacher_hidden=t["teacher_hidden"],
                      teacher_weight=t["teacher_weight"], advantages=t["advantages"],
                      old_logprobs=t["old_logprobs"], reduction="none", chunk_rows=5)
    with torch.no_grad():
        t[changed].fill_(0) if changed == "labels" else t[changed].mul_(2)
    with pytest.raises(RuntimeError, match=_INPLACE):
        out.loss.sum().backward()


def test_a_linear_input_changed_after_a_mean_forward_leaves_the_forwards_gradient():
    # reduction="mean": the gradient is computed in the forward, of the values it read
    g = torch.Generator().manual_seed(5)
    R, H, V = 12, 8, 40
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (R,), generator=g)
    h = hidden.clone().requires_grad_()
    out = lcg.HeadLoss(lcg.CrossEntropy()).linear(h, weight, labels, chunk_rows=5)
    with torch.no_grad():
        weight.mul_(3)
    out.loss.backward()
    h64 = hidden.double().requires_grad_()
    F.cross_entropy(h64 @ (weight / 3).double().T, labels).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


def test_an_input_changed_in_place_before_a_compiled_per_row_backward_raises_as_torch_does():
    logits, labels, inputs = _policy(R=8)
    head = lcg.HeadLoss(lcg.GRPO())
    step = torch.compile(lambda x, A: head(x, labels, advantages=A, old_logprobs=inputs["old_logprobs"],
                                           reduction="none").loss, fullgraph=True, backend="aot_eager")
    x, A = logits.clone().requires_grad_(), inputs["advantages"].clone()
    step(x, A).sum().backward()                  # unchanged: torch's float64 gradient
    z = logits.double().requires_grad_()
    logp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    r = torch.exp(logp - inputs["old_logprobs"].double())
    per_row = -torch.min(r * A.double(), r.clamp(0.8, 1.2) * A.double())
    torch.where(labels != -100, per_row, 0).sum().backward()
    torch.testing.assert_close(x.grad.double(), z.grad, rtol=1e-4, atol=1e-6)
    loss = step(x, A)
    A.mul_(-3)
    with pytest.raises(RuntimeError, match=_INPLACE):
        loss.sum().backward()


# ---- 4. each call's backward uses its own forward's parameter values --------------------------------
def _grpo_reference_grad(logits, labels, inputs, kl_beta, z_weight):
    """float64 d/dlogits of sum over valid rows of GRPO(kl_beta) + z_weight * lse**2."""
    z = logits.double().requires_grad_()
    lse = torch.logsumexp(z, -1)
    logp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    r = torch.exp(logp - inputs["old_logprobs"].double())
    A, d = inputs["advantages"].double(), inputs["ref_logprobs"].double() - logp
    per_row = -torch.min(r * A, r.clamp(0.8, 1.2) * A) + kl_beta * (torch.exp(d) - d - 1) + z_weight * lse ** 2
    torch.where(labels != -100, per_row, 0).sum().backward()
    return z.grad


@pytest.mark.parametrize("compiled", [False, True])
def test_a_schedule_step_between_a_per_row_forward_and_its_backward_keeps_the_forwards_values(compiled):
    logits, labels, inputs = _policy()
    beta, weight = torch.tensor(0.1), torch.tensor(0.5)
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=beta), lcg.ZLoss(weight=weight))

    def step(x):
        return head(x, labels, reduction="none", **inputs).loss
    if compiled:
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    first = step(x1)
    beta.fill_(0.7)                      # the schedule's next step, and a call with it
    weight.fill_(2.0)
    second = step(x2)
    first.sum().backward()
    second.sum().backward()
    torch.testing.assert_close(x1.grad.double(), _grpo_reference_grad(logits, labels, inputs, 0.1, 0.5),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x2.grad.double(), _grpo_reference_grad(logits, labels, inputs, 0.7, 2.0),
                               rtol=1e-4, atol=1e-6)


def test_a_schedule_step_between_a_per_row_linear_forward_and_its_backward_keeps_the_forwards_values():
    g = torch.Generator().manual_seed(6)
    R, H, V = 12, 8, 40
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (R,), generator=g)
    z_weight = torch.tensor(0.5)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=z_weight))
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    first = head.linear(h1, weight, labels, reduction="none", chunk_rows=5)
    z_weight.fill_(3.0)
    head.linear(h2, weight, labels, reduction="none", chunk_rows=5)
    first.loss.sum().backward()
    h64 = hidden.double().requires_grad_()
    z = h64 @ weight.double().T
    (F.cross_entropy(z, labels, reduction="sum") + 0.5 * (torch.logsumexp(z, -1) ** 2).sum()).backward()
    torch.testing.assert_close(h1.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


# ---- 5. learnable weights train; a learnable parameter is refused ----------------------------------
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_learnable_term_weight_gets_the_terms_value_as_its_gradient(reduction):
    logits, labels, _ = make_inputs(R=12, V=40)
    w_ce, w_z = torch.tensor(0.7, requires_grad=True), torch.tensor(0.2, requires_grad=True)
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=w_ce), lcg.ZLoss(weight=w_z), lcg.Entropy(weight=0.1))
    x = logits.clone().requires_grad_()
    out = head(x, labels, reduction=reduction)
    upstream = torch.linspace(0.5, 1.5, 12) if reduction == "none" else torch.tensor(1.0)
    (out.loss * upstream).sum().backward()
    # float64 torch: the same loss with the weights as leaves
    z, w64 = logits.double().requires_grad_(), torch.tensor([0.7, 0.2], dtype=torch.float64, requires_grad=True)
    valid = labels != -100
    rows = torch.stack([F.cross_entropy(z, labels, reduction="none"),
                        torch.where(valid, torch.logsumexp(z, -1) ** 2, 0)])
    p = torch.softmax(z, -1)
    entropy = torch.where(valid, -(p * torch.log_softmax(z, -1)).sum(-1), 0)
    per_row = w64 @ rows + 0.1 * entropy
    loss = per_row if reduction == "none" else per_row.sum() / valid.sum()
    (loss * upstream.double()).sum().backward()
    torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack([w_ce.grad, w_z.grad]).double(), w64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), z.grad, rtol=1e-4, atol=1e-6)


def test_a_learnable_weight_trains_through_head_linear_and_torch_compile():
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (10,), generator=g)
    w_z = torch.tensor(0.3, requires_grad=True)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=w_z))
    out = head.linear(hidden.clone().requires_grad_(), weight, labels, chunk_rows=4)
    out.loss.backward()
    z = hidden.double() @ weight.double().T
    want = (torch.logsumexp(z, -1) ** 2).mean()
    torch.testing.assert_close(w_z.grad.double(), want, rtol=1e-5, atol=1e-6)
    w_z.grad = None
    step = torch.compile(lambda x: head(x, labels).loss, backend="aot_eager")
    step((hidden @ weight.T).requires_grad_()).backward()
    torch.testing.assert_close(w_z.grad.double(), want, rtol=1e-5, atol=1e-6)


def test_a_learnable_parameter_inside_a_formula_is_refused_naming_it():
    with pytest.raises(ValueError, match="grpo: parameter kl_beta is a tensor that requires grad"):
        lcg.GRPO(kl_beta=torch.tensor(0.1, requires_grad=True))
    beta = torch.tensor(0.1)
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=beta))
    beta.requires_grad_()
    logits, labels, inputs = _policy()
    with pytest.raises(ValueError, match="parameter kl_beta of grpo is a tensor that requires grad"):
        head(logits, labels, **inputs)


# ---- 7. segment ids of any size ---------------------------------------------------------------------
def test_gspo_with_global_sample_ids_equals_gspo_with_small_ids():
    from reference import gspo_total
    logits, labels, g = make_inputs(R=14, V=48, ignored=(2, 9))
    inputs = policy_inputs(logits, labels, g, spread=0.002)
    inputs.pop("ref_logprobs")
    small = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 4, 4, 5, 5, 5])
    ids = small * 2**40 + 7 * 2**33                # a sampler's global indices
    ids[9] = -1                                    # an ignored row's padding id
    head = lcg.HeadLoss(lcg.GSPO())
    x = logits.clone().requires_grad_()
    out = head(x, labels, segment_ids=ids, **inputs)
    out.loss.backward()
    z = logits.double().requires_grad_()
    total, count = gspo_total(z, labels, labels != -100, inputs["advantages"], inputs["old_logprobs"], small)
    (total / count).backward()
    torch.testing.assert_close(out.loss.double(), (total / count).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), z.grad, rtol=1e-4, atol=1e-6)


def test_segment_ids_too_many_to_size_are_refused_naming_num_segments():
    logits, labels, g = make_inputs(R=6, V=32)
    inputs = policy_inputs(logits, labels, g)
    inputs.pop("ref_logprobs")
    ids = torch.arange(6) * 2**40
    with pytest.raises(ValueError, match="num_segments=5497558138881 .*at most 16777216 segments"):
        lcg.HeadLoss(lcg.GSPO())(logits, labels, segment_ids=ids, num_segments=5 * 2**40 + 1, **inputs)
    # a normalize="sequence" term divides by the number of ids: they are used as they are
    per_sequence = lcg.HeadLoss(lcg.LogProb(normalize="sequence"))
    with pytest.raises(ValueError, match="at most 16777216 segments"):
        per_sequence(logits, labels, segment_ids=ids)


# ---- 10. metric rows are detached, eager or compiled --------------------------------------------------
def test_metric_rows_are_detached_and_term_rows_differentiable_eager_and_compiled():
    logits, labels, _ = make_inputs(R=8, V=32)
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))

    def step(x):
        out = head(x, labels, reduction="none")
        return out.rows["cross_entropy"], out.rows["entropy"], out.rows["token_accuracy"]
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        ce, entropy, accuracy = fn(logits.clone().requires_grad_())
        assert ce.requires_grad and not entropy.requires_grad and not accuracy.requires_grad
        want = F.cross_entropy(logits.double(), labels, reduction="none")
        torch.testing.assert_close(ce.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_an_integer_class_prior_is_refused_naming_its_dtype():
    prior_term = lcg.declare_term("prior_ce", S.lse - S.target_logit - S.vsum(S.vector("prior") * S.logsoftmax))
    with pytest.raises(ValueError, match=r"prior must be a float tensor of shape \(40,\).*got torch.int64 of shape \(40,\)"):
        lcg.HeadLoss(prior_term())(torch.randn(3, 40), torch.tensor([1, 2, 3]), prior=torch.arange(40))


# ---- 11. inputs that get no gradient are refused when they require one --------------------------------
_WEIGHTED_CE = lcg.declare_term("rows_weighted_ce", S.token("w") * (S.lse - S.target_logit))


def _grad_inputs(name):
    """(head, inputs) of a head reading ``name``, with ``name`` requiring grad."""
    logits, labels, inputs = _policy(R=8, V=32)
    g = torch.Generator().manual_seed(3)
    if name == "w":
        head, inputs = lcg.HeadLoss(_WEIGHTED_CE()), dict(w=torch.rand(8, generator=g))
    elif name == "advantages":
        head = lcg.HeadLoss(lcg.GRPO())
    elif name == "teacher_topk_logprobs":
        from helpers import topk_inputs
        head, inputs = lcg.HeadLoss(lcg.TopKForwardKL()), topk_inputs(8, 32, 3, g)
    else:   # divisor
        head, inputs = lcg.HeadLoss(lcg.CrossEntropy()), dict(divisor=torch.tensor(5.0))
    inputs[name] = inputs[name].clone().requires_grad_()
    return head, logits.requires_grad_(), labels, inputs


# (teacher_logits that require grad get their gradient: tests/runtime/test_teacher_grad.py)
@pytest.mark.parametrize("name", ["w", "advantages", "teacher_topk_logprobs", "divisor"])
def test_an_input_that_requires_grad_is_refused_naming_it_as_it_gets_no_gradient(name):
    head, logits, labels, inputs = _grad_inputs(name)
    message = f"{name} requires grad, but losscodegen gives it no gradient .*pass {name}.detach\\(\\)"
    with pytest.raises(ValueError, match=message):
        head(logits, labels, **inputs)
    with torch.no_grad():     # nothing gets a gradient there: taken as it is
        head(logits, labels, **inputs)
    inputs[name] = inputs[name].detach()
    head(logits, labels, **inputs).loss.backward()
    assert logits.grad is not None


def test_a_token_that_requires_grad_is_refused_in_head_linear_and_under_torch_compile():
    head, logits, labels, inputs = _grad_inputs("w")
    hidden, weight = torch.randn(8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    with pytest.raises(ValueError, match="w requires grad"):
        head.linear(hidden, weight, labels, **inputs)
    step = torch.compile(lambda x, w: head(x, labels, w=w).loss, backend="aot_eager")
    step(logits, inputs["w"].detach()).backward()
    with pytest.raises(ValueError, match="w requires grad"):   # (a recompile: the guard on requires_grad)
        step(logits, inputs["w"])


# ---- 12. every bad value is reported, -2**63 too ------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_bad_value_of_int64_min_raises_as_any_other(backend):
    INT64_MIN = -2**63
    logits, labels, inputs = _policy(R=8, V=32)
    bad = labels.clone()
    bad[2] = INT64_MIN
    ce = lcg.HeadLoss(lcg.CrossEntropy(), backend=backend)
    with pytest.raises(ValueError, match=f"labels: .*found {INT64_MIN}"):
        ce(logits, bad)
    assert torch.isfinite(ce(logits, labels).loss)         # (reported once: the next call is clean)
    inputs.pop("ref_logprobs")
    gspo = lcg.HeadLoss(lcg.GSPO(), backend=backend)
    ids = torch.tensor([0, 0, INT64_MIN, 1, 1, 1, 2, 2])
    for count in ({}, {"num_segments": 3}):
        with pytest.raises(ValueError, match=f"segment_ids of valid rows must be non-negative; found {INT64_MIN}"):
            gspo(logits, labels, segment_ids=ids, **count, **inputs)
    with pytest.raises(ValueError, match="must be in \\[0, num_segments=3\\); found 5"):   # (given: not compacted)
        gspo(logits, labels, segment_ids=torch.tensor([0, 0, 5, 1, 1, 1, 2, 2]), num_segments=3, **inputs)
    # num_segments=0: every valid row is out of range, an id of 0 too; a call without one is fine
    with pytest.raises(ValueError, match="num_segments was 0 .*a valid row has no segment"):
        gspo(logits, labels, segment_ids=torch.zeros(8, dtype=torch.long), num_segments=0, **inputs)
    ignored = torch.full_like(labels, -100)
    assert gspo(logits, ignored, segment_ids=torch.zeros(8, dtype=torch.long), num_segments=0, **inputs).loss == 0
    from helpers import topk_inputs
    topk = topk_inputs(8, 32, 3, torch.Generator().manual_seed(1))
    topk["teacher_topk_ids"][1, 1] = INT64_MIN
    with pytest.raises(ValueError, match=f"teacher_topk_ids of valid rows must be in \\[0, 32\\); found {INT64_MIN}"):
        lcg.HeadLoss(lcg.TopKForwardKL(), backend=backend)(logits, **topk)
    topk["teacher_topk_ids"][1, 0] = INT64_MIN              # repeated and out of range: named as out of range
    with pytest.raises(ValueError, match=f"teacher_topk_ids of valid rows must be in \\[0, 32\\); found {INT64_MIN}"):
        lcg.HeadLoss(lcg.TopKForwardKL(), backend=backend)(logits, **topk)


# ---- 13. odd shapes and types of inputs, refused naming them -------------------------------------------
def test_an_empty_top_k_is_refused_naming_both_arguments():
    logits, _, _ = _policy(R=4, V=16)
    with pytest.raises(ValueError, match="teacher_topk_ids and teacher_topk_logprobs must hold K >= 1"):
        lcg.HeadLoss(lcg.TopKForwardKL())(logits, teacher_topk_ids=torch.zeros(4, 0, dtype=torch.long),
                                          teacher_topk_logprobs=torch.zeros(4, 0))


def test_a_bool_tensor_divisor_is_refused_as_a_bool_is():
    logits, labels, _ = _policy(R=4, V=16)
    head = lcg.HeadLoss(lcg.CrossEntropy())
    for divisor in (True, torch.tensor(True)):
        with pytest.raises(TypeError, match="divisor must be a number or a"):
            head(logits, labels, divisor=divisor)
