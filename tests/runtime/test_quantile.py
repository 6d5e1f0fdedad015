"""S.row_quantile, a quantile over the call's valid rows: GRPO's top_entropy_quantile (TRL's
high-entropy token mask) against TRL's own mask function (``GRPOTrainer.get_high_entropy_mask``) and
TRL's per-token GRPO loss in float64 torch, value and gradient; through head(...) and head.linear,
reductions sum and mean, ignored rows, fp32 and bf16 (the float64 reference), and on two gloo ranks
each holding half of the vocabulary."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from losscodegen import symbols as S
from helpers import run_ranks

trl = pytest.importorskip("trl")
pytestmark = [pytest.mark.usefixtures("backend"), pytest.mark.cpu]

R, V, H = 40, 48, 16
Q, EPS, KL_BETA = 0.3, 0.2, 0.05


def _case(seed=0):
    """Float64 logits [R, V] (rows of several entropies), labels with ignored rows, the policy's inputs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g, dtype=torch.float64) * torch.rand(R, 1, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, V, (R,), generator=g)
    labels[torch.rand(R, generator=g) < 0.2] = -100
    with torch.no_grad():
        logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[:, None])[:, 0]
    return logits, labels, dict(advantages=torch.randn(R, generator=g).float(),
                                old_logprobs=(logp + 0.2 * torch.randn(R, generator=g, dtype=torch.float64)).float(),
                                ref_logprobs=(logp + 0.3 * torch.randn(R, generator=g, dtype=torch.float64)).float())


def _trl_loss(logits, labels, inputs, reduction="mean"):
    """TRL's loss of ``_per_token``: summed over the valid tokens, divided by them under "mean"."""
    total = _per_token(logits, labels, inputs).sum()
    return total / (labels != -100).sum() if reduction == "mean" else total


def _head():
    return lcg.HeadLoss(lcg.GRPO(top_entropy_quantile=Q, eps_low=EPS, eps_high=EPS, kl_beta=KL_BETA))


def _check(got, want):
    assert abs(got.loss.item() - want.item()) <= 2e-5 * max(1.0, abs(want.item())), (got.loss.item(), want.item())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grpo_top_entropy_quantile_matches_trl(reduction):
    logits, labels, inputs = _case()
    x64 = logits.clone().requires_grad_()
    want = _trl_loss(x64, labels, inputs, reduction)
    want.backward()
    x = logits.float().requires_grad_()
    out = _head()(x, labels, reduction=reduction, **inputs)     # (no segment_ids: the batch is one)
    out.loss.backward()
    _check(out, want)
    err = (x.grad.double() - x64.grad).abs().max().item()
    assert err <= 1e-4 * x64.grad.abs().max().item(), err
    # the mask keeps about q of the valid tokens: some of the policy's gradient is gone
    plain = lcg.HeadLoss(lcg.GRPO(eps_low=EPS, eps_high=EPS, kl_beta=KL_BETA))(logits.float(), labels, **inputs)
    assert plain.loss.item() != pytest.approx(out.loss.item())


def test_grpo_top_entropy_quantile_matches_the_float64_reference_in_fp32_and_bf16():
    lcg.testing.assert_parity(_head(), rows=R, vocab=V)


def test_grpo_top_entropy_quantile_through_linear_matches_trl():
    logits, labels, inputs = _case(1)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = _trl_loss(h64 @ w64.T, labels, inputs)
    want.backward()
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    out = _head().linear(h, w, labels, chunk_rows=16, **inputs)
    out.loss.backward()
    _check(out, want)
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (got.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def _vp_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    logits, labels, inputs = _case(3)
    x64 = logits.clone().requires_grad_()
    want = _trl_loss(x64, labels, inputs)
    want.backward()
    Vl = V // world
    shard = logits[:, rank * Vl:(rank + 1) * Vl].float().requires_grad_()
    out = _head()(shard, labels, process_group=dist.group.WORLD, **inputs)
    out.loss.backward()
    ref = x64.grad[:, rank * Vl:(rank + 1) * Vl]
    queue.put((out.loss.item(), want.item(), (shard.grad.double() - ref).abs().max().item(), ref.abs().max().item()))
    dist.destroy_process_group()


def test_grpo_top_entropy_quantile_vocab_parallel_matches_trl():
    """Two gloo ranks, half of the vocabulary each: every rank's entropies are the merged rows', so
    the quantile (and the mask) is the same on both."""
    for loss, want, err, scale in run_ranks(_vp_worker, 2, 2):
        assert abs(loss - want) <= 2e-5 * max(1.0, abs(want)), (loss, want)
        assert err <= 1e-4 * scale, (err, scale)


def test_row_quantile_checks_its_arguments():
    with pytest.raises(ValueError, match=r"q must be a number in \[0, 1\]"):
        S.row_quantile(S.lse, 1.5)
    with pytest.raises(ValueError, match="top_entropy_quantile must be a number in"):
        lcg.GRPO(top_entropy_quantile=2)
    alone = lcg.declare_term("t", S.row_quantile(S.lse, 0.5) ** 2)
    with pytest.raises(ValueError, match="t: row_quantile.*a row-level constant of the batch"):
        lcg.HeadLoss(alone()).explain()


def test_grpo_top_entropy_quantile_per_row_matches_trl():
    """reduction="none": each token's loss (TRL's per_token_loss, 0 on ignored rows) and the gradient
    of a weighted sum of them, through the deferred gradient launch."""
    logits, labels, inputs = _case(4)
    up = torch.rand(R, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x64 = logits.clone().requires_grad_()
    want_rows = _per_token(x64, labels, inputs)
    (want_rows * up).sum().backward()
    x = logits.float().requires_grad_()
    out = _head()(x, labels, reduction="none", **inputs)
    scale = max(1.0, want_rows.abs().max().item())
    assert (out.loss.double() - want_rows.detach()).abs().max().item() <= 2e-5 * scale
    assert (out.loss[labels == -100] == 0).all()
    (out.loss * up.float()).sum().backward()
    assert (x.grad.double() - x64.grad).abs().max().item() <= 1e-4 * x64.grad.abs().max().item()
    # through head.linear: logits = hidden @ weight.T, in chunks
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(R, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    h64 = hidden.clone().requires_grad_()
    want_rows = _per_token(h64 @ weight.T, labels, inputs)
    (want_rows * up).sum().backward()
    h = hidden.float().requires_grad_()
    out = _head().linear(h, weight.float(), labels, reduction="none", chunk_rows=16, **inputs)
    assert (out.loss.double() - want_rows.detach()).abs().max().item() <= 2e-5 * max(1.0, want_rows.abs().max().item())
    (out.loss * up.float()).sum().backward()
    assert (h.grad.double() - h64.grad).abs().max().item() <= 1e-4 * h64.grad.abs().max().item()


def _per_token(logits, labels, inputs):
    """TRL 1.16's GRPO per-token loss with top_entropy_quantile, [R], 0 on ignored rows: the lines of
    GRPOTrainer._compute_loss, with TRL's own get_high_entropy_mask, float64. (The entropies in fp32,
    as TRL has them: in float64 a token whose entropy is the quantile itself, rounded to fp32 for
    torch.quantile, can fall below its own rounded value and out of the mask.)"""
    valid = labels != -100
    p = torch.softmax(logits, -1)
    entropies = -(p * torch.log_softmax(logits, -1)).sum(-1)
    fake = SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=lambda x, **_: x, gather=lambda x: x))
    entropy_mask = trl.GRPOTrainer.get_high_entropy_mask(fake, entropies.detach().float()[None], valid[None], 1 - Q)[0]
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[:, None])[:, 0]
    coef_1 = torch.exp(logps - inputs["old_logprobs"].double())
    A = inputs["advantages"].double()
    loss = -torch.min(coef_1 * A, torch.clamp(coef_1, 1 - EPS, 1 + EPS) * A) * entropy_mask
    ref = inputs["ref_logprobs"].double()
    return (loss + KL_BETA * (torch.exp(ref - logps) - (ref - logps) - 1)) * valid


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_row_quantile_on_an_empty_batch_is_zero(reduction):
    """0 rows (an empty micro-batch): a head with a row quantile gives 0 and a zero gradient, through
    head(...) and head.linear, like every other head (there is no row to take the quantile of)."""
    empty = torch.zeros(0)
    labels = torch.zeros(0, dtype=torch.long)
    inputs = dict(advantages=empty, old_logprobs=empty, ref_logprobs=empty)
    head = _head()
    x = torch.randn(0, V, requires_grad=True)
    out = head(x, labels, reduction=reduction, **inputs)
    assert out.loss.shape == ((0,) if reduction == "none" else ())
    assert (out.loss == 0).all() and all(v == 0 for v in out.terms.values())
    out.loss.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, V)
    h, w = torch.randn(0, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    out = head.linear(h, w, labels, reduction=reduction, **inputs)
    assert (out.loss == 0).all()
    out.loss.sum().backward()
    assert h.grad.shape == (0, H) and w.grad is not None and (w.grad == 0).all()
