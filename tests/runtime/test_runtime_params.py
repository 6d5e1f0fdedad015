"""Runtime parameters and weights (kernel arguments, numbers or 0-dim tensors read at each call), and
per-term normalisation (normalize=; metrics always means over the valid rows)."""
import pytest
import torch

import losscodegen as lcg
from losscodegen import load
from helpers import DEVICE, check_head, make_inputs, policy_inputs


def _policy(R=16, V=64, seed=0):
    logits, labels, g = make_inputs(R=R, V=V, ignored=(1, 6), seed=seed)
    return logits, labels, policy_inputs(logits, labels, g, spread=0.3)


def test_heads_differing_only_in_values_share_one_kernel_file():
    logits, labels, inputs = _policy()
    a = lcg.HeadLoss(lcg.GRPO(eps_low=0.2, eps_high=0.28, kl_beta=0.04), lcg.CrossEntropy(weight=0.1),
                     metrics=(lcg.ClipFraction(),))
    b = lcg.HeadLoss(lcg.GRPO(eps_low=0.1, eps_high=0.4, kl_beta=0.5, weight=3.0), lcg.CrossEntropy(weight=2.0),
                     metrics=(lcg.ClipFraction(),))
    assert a.key == b.key and a.spec_text == b.spec_text
    assert "0.04" not in a.spec_text and "0.28" not in a.spec_text
    assert a.kernel is b.kernel                      # one file, one module, one compiled kernel
    out_a = check_head(a, logits, labels, **inputs)
    out_b = check_head(b, logits, labels, **inputs)  # each against the float64 reference of its own values
    assert not torch.allclose(out_a.loss, out_b.loss)


def test_tensor_weights_and_parameters_are_read_at_each_call():
    logits, labels, inputs = _policy()
    beta, weight = torch.tensor(0.04, device=DEVICE), torch.tensor(0.5, device=DEVICE)
    eps_low = torch.tensor(0.2, device=DEVICE)
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=beta, eps_low=eps_low), lcg.ZLoss(weight=weight),
                        metrics=(lcg.ClipFraction(),))
    first = check_head(head, logits, labels, **inputs)
    beta.fill_(0.3)
    weight.mul_(4.0)
    eps_low.fill_(0.05)                              # ClipFraction's eps follow GRPO's
    second = check_head(head, logits, labels, **inputs)
    assert not torch.allclose(first.loss, second.loss)
    assert not torch.equal(first.metrics["clip_fraction"], second.metrics["clip_fraction"])
    assert lcg.HeadLoss(lcg.GRPO(kl_beta=0.3, eps_low=0.05), lcg.ZLoss(weight=2.0),
                        metrics=(lcg.ClipFraction(),)).key == head.key


def test_parameters_that_decide_the_plan_stay_numbers():
    # a temperature given as a number decides the reads: a kernel a value; as a tensor, a kernel
    # argument (its sums read relative to the row maxima after the stats: tests/test_language.py)
    assert lcg.HeadLoss(lcg.ForwardKL(temperature=2.0)).key != lcg.HeadLoss(lcg.ForwardKL(temperature=3.0)).key
    assert lcg.HeadLoss(lcg.ForwardKL(temperature=torch.tensor(2.0))).key == \
        lcg.HeadLoss(lcg.ForwardKL(temperature=torch.tensor(3.0))).key
    # the number 0 is folded: GRPO's default kl_beta reads no ref_logprobs
    assert lcg.HeadLoss(lcg.GRPO()).key != lcg.HeadLoss(lcg.GRPO(kl_beta=0.1)).key
    logits, labels, inputs = _policy()
    del inputs["ref_logprobs"]
    check_head(lcg.HeadLoss(lcg.GRPO()), logits, labels, **inputs)
    with pytest.raises(TypeError, match="0-dim float tensor"):
        lcg.GRPO(kl_beta=torch.tensor([0.1]))
    with pytest.raises(TypeError, match="weight as a tensor must be a 0-dim float tensor"):
        lcg.CrossEntropy(weight=torch.tensor(1))


def test_a_tensor_parameter_on_another_device_is_refused():
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=torch.tensor(0.1)))
    with pytest.raises(ValueError, match="parameter kl_beta of grpo is a tensor on cpu, but the logits are on meta"):
        head.scalar_buffer(torch.device("meta"))


@pytest.mark.gpu
def test_a_tensor_weight_on_the_host_is_refused_for_gpu_logits():
    head = lcg.HeadLoss(lcg.CrossEntropy(weight=torch.tensor(0.5)))
    logits, labels, _ = make_inputs(R=8, V=64)
    with pytest.raises(ValueError, match="the weight of cross_entropy is a tensor on cpu"):
        head(logits.cuda(), labels.cuda())


@pytest.mark.gpu
def test_a_tensor_parameter_updated_in_place_changes_a_cuda_graph_replay():
    """A beta schedule inside a captured training step: the graph reads the tensor at each replay."""
    logits, labels, inputs = _policy(R=256, V=4096)
    logits, labels = logits.cuda(), labels.cuda()
    inputs = {k: v.cuda() for k, v in inputs.items()}
    beta = torch.tensor(0.04, device="cuda")
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=beta))
    x = logits.clone().requires_grad_()

    def step():
        x.grad = None
        out = head(x, labels, **inputs)
        out.loss.backward()
        return out.loss
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    results = []
    for value in (0.04, 0.5):
        beta.fill_(value)
        graph.replay()
        results.append((loss.clone(), x.grad.clone()))
        fresh = logits.clone().requires_grad_()
        want = lcg.HeadLoss(lcg.GRPO(kl_beta=value))(fresh, labels, **inputs).loss
        want.backward()
        torch.testing.assert_close(results[-1][0], want)
        torch.testing.assert_close(results[-1][1], fresh.grad)
    assert not torch.equal(results[0][0], results[1][0])


# ---- normalize= ------------------------------------------------------------------------------------
def test_metrics_are_means_over_valid_rows_under_any_divisor():
    logits, labels, _ = make_inputs(R=20, V=80, ignored=(2, 3, 11))
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    valid = labels != -100
    logp = torch.log_softmax(logits.double(), -1)
    entropy = -(logp.exp() * logp).sum(-1)[valid].mean()
    accuracy = (logits.argmax(-1) == labels)[valid].double().mean()
    for kw in ({}, {"divisor": 7.0}, {"reduction": "sum"}, {"reduction": "none"}, {"divisor": torch.tensor(3.0)}):
        out = head(logits.to(DEVICE), labels.to(DEVICE), **kw)
        torch.testing.assert_close(out.metrics["entropy"].double().cpu(), entropy, rtol=1e-5, atol=1e-6, msg=str(kw))
        torch.testing.assert_close(out.metrics["token_accuracy"].double().cpu(), accuracy, msg=str(kw))


def test_normalize_sum_and_tokens_in_one_head():
    logits, labels, _ = make_inputs(R=12, V=64, ignored=(0, 5))
    head = lcg.HeadLoss(lcg.CrossEntropy(normalize="sum"), lcg.ZLoss(weight=0.1))
    x = logits.clone().to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), divisor=4.0)
    out.loss.backward()
    z = logits.double().requires_grad_()
    valid = labels != -100
    ce = torch.nn.functional.cross_entropy(z, labels, reduction="sum")
    zl = (torch.logsumexp(z, -1) ** 2)[valid].sum() / 4.0
    (ce + 0.1 * zl).backward()
    torch.testing.assert_close(out.terms["cross_entropy"].double().cpu(), ce.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.terms["z_loss"].double().cpu(), zl.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double().cpu(), z.grad, rtol=1e-4, atol=1e-6)


def _trl_grpo_mean(logits, labels, mask, advantages, old, ref, eps_low, eps_high, beta):
    """TRL 1.16's GRPOTrainer._compute_loss for loss_type="grpo" (token-level importance sampling),
    re-typed in float64: per-sequence means over the completion mask, then the mean over sequences."""
    per_token_logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    coef_1 = torch.exp(per_token_logps - old)
    per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss + beta * per_token_kl
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_sequence_matches_trl_grpo_with_an_empty_completion(dtype):
    B, T, V = 4, 6, 96
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2] = False                                   # an empty completion: counts in the mean
    with torch.no_grad():
        l = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    old = (l + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (l + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    advantages = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    head = lcg.HeadLoss(lcg.GRPO(normalize="sequence", eps_high=0.28, kl_beta=0.04), metrics=(lcg.Entropy(),))
    x = logits.clone().to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), loss_mask=mask.to(DEVICE), advantages=advantages.to(DEVICE),
               old_logprobs=old.to(DEVICE), ref_logprobs=ref.to(DEVICE),
               segment_ids=torch.arange(B).repeat_interleave(T).reshape(B, T).to(DEVICE), num_segments=B)
    out.loss.backward()
    z = logits.double().requires_grad_()
    want = _trl_grpo_mean(z, labels, mask.double(), advantages.double(), old.double(), ref.double(), 0.2, 0.28, 0.04)
    want.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.loss.double().cpu(), want.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.terms["grpo"].double().cpu(), want.detach(), rtol=tol, atol=tol)
    grad_tol = (2e-4 if dtype == torch.float32 else 1e-2) * float(z.grad.abs().max())
    assert float((x.grad.double().cpu() - z.grad).abs().max()) <= grad_tol
    logp = torch.log_softmax(logits.double(), -1)
    entropy = -(logp.exp() * logp).sum(-1)[mask].mean()   # a metric: over the valid rows
    torch.testing.assert_close(out.metrics["entropy"].double().cpu(), entropy, rtol=tol, atol=tol)


def test_normalize_is_checked():
    with pytest.raises(ValueError, match="normalize must be one of"):
        lcg.CrossEntropy(normalize="batch")
    # a term of segment statistics: by sequence (test_policy.py), not "sum"; nor where no segment is read
    assert lcg.HeadLoss(lcg.GSPO(normalize="sequence")).key != lcg.HeadLoss(lcg.GSPO()).key
    with pytest.raises(ValueError, match="gspo: a term of segment statistics .* not 'sum'"):
        lcg.GSPO(normalize="sum")
    with pytest.raises(ValueError, match="grpo: normalize='sequence' .* batch quantiles"):
        lcg.GRPO(top_entropy_quantile=0.8, normalize="sequence")
    assert lcg.HeadLoss(lcg.CrossEntropy(normalize="sum")).key != lcg.HeadLoss(lcg.CrossEntropy()).key
