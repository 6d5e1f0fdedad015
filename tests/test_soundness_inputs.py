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
