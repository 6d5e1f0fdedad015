"""Preference losses (lcg.preference) against TRL's own loss code: DPO's loss types through
DPOTrainer._compute_loss, CPO/SimPO through CPOTrainer.cpo_loss, ORPO through odds_ratio_loss, KTO
through KTOTrainer._compute_loss, each on log-probs that TRL computes from the same float64 logits
(value and gradient w.r.t. the logits by torch autograd)."""
from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from losscodegen import preference as P
from helpers import run_ranks

trl = pytest.importorskip("trl")
# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto";
# spawned ranks take the parent's)
pytestmark = [pytest.mark.usefixtures("backend"), pytest.mark.cpu]   # (CPU tensors: conftest's ``cpu``)

B, T, V = 3, 7, 48


def _batch(seed=0, n=2 * B):
    """Float64 model logits [n, T, V] and TRL's inputs: a prompt, a completion, padding per row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, T, V, generator=g, dtype=torch.float64) * 1.5
    input_ids = torch.randint(0, V, (n, T), generator=g)
    completion_mask = torch.zeros(n, T, dtype=torch.long)
    for i in range(n):
        start = 1 + i % 2
        completion_mask[i, start:start + 2 + (3 * i) % 4] = 1
    return logits, input_ids, completion_mask


def _shifted(input_ids, completion_mask):
    """The head's labels: row t predicts token t + 1 (TRL's shift), prompt and padding ignored."""
    return input_ids.masked_fill(completion_mask == 0, -100)[:, 1:]


def _token_logps(logits, labels):
    """log p of each row's label, 0 where ignored (TRL's fused head's log_probs)."""
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return torch.where(labels == -100, 0.0, lp)


class _FusedModel:
    """A model whose fused LM head returns what TRL's does, computed from given float64 logits."""

    def __init__(self, logits):
        self.logits = logits
        self.training = True

    def __call__(self, *, labels, **_):
        z, y = self.logits[:, :-1], labels[:, 1:]
        p = torch.softmax(z, -1)
        return SimpleNamespace(log_probs=_token_logps(z, y), entropy=-(p * torch.log(p)).sum(-1),
                               log_sum_sq_probs=torch.log((p ** 2).sum(-1)),
                               mean_logits=z.mean(-1), is_top1=z.argmax(-1) == y.clamp_min(0), aux_loss=None)


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)


def _ours(head, logits, labels, **inputs):
    """Our head's loss and its gradient w.r.t. the float64 logits (fp32 rows [n, T-1, V])."""
    x = logits[:, :-1].detach().float().requires_grad_()
    out = head(x, labels, **inputs)
    out.loss.backward()
    grad = torch.zeros_like(logits)
    grad[:, :-1] = x.grad.double()
    return out, grad


def _compare(ours, grad, ref, ref_grad):
    assert abs(ours.loss.item() - ref.item()) <= 2e-5 * max(1.0, abs(ref.item())), (ours.loss.item(), ref.item())
    err = (grad - ref_grad).abs().max().item()
    assert err <= 1e-4 * max(ref_grad.abs().max().item(), 1e-6), (err, ref_grad.abs().max().item())


def _trl_dpo(logits, input_ids, completion_mask, ref_c, ref_r, *, loss_type, beta, **options):
    # (TRL's alpha-divergence clamp knows no float64: that case runs in float32)
    dtype = torch.float32 if options.get("f_divergence_type") == "alpha_divergence" else torch.float64
    x = logits.detach().to(dtype).requires_grad_()
    ref_c, ref_r = ref_c.to(dtype), ref_r.to(dtype)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type=options.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=options.get("f_alpha_divergence_coef", 1.0), loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=options.get("label_smoothing", 0.0),
        args=SimpleNamespace(discopop_tau=options.get("discopop_tau", 0.05)),
        use_weighting=options.get("use_weighting", False),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=completion_mask,
                  ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    loss = trl.DPOTrainer._compute_loss(fake, _FusedModel(x), inputs, return_outputs=False)
    loss.backward()
    return loss.detach().double(), x.grad.double()


_DPO_CASES = [
    ("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("exo_pair", {"label_smoothing": 0.1}), ("nca_pair", {}),
    ("robust", {"label_smoothing": 0.2}), ("bco_pair", {}), ("sppo_hard", {}), ("apo_zero", {}),
    ("apo_down", {}), ("discopop", {}), ("sigmoid_norm", {}), ("sft", {}),
    ("sigmoid", {"f_divergence_type": "forward_kl"}), ("sigmoid", {"f_divergence_type": "js_divergence"}),
    ("hinge", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5}),
    ("sigmoid", {"use_weighting": True}), ("ipo", {"use_weighting": True}),
    # the batch's sorted log-ratios (S.segment_sorted); an f-divergence with them is refused, as TRL refuses it
    ("aot", {"label_smoothing": 0.1}), ("aot_unpaired", {}),
]


@pytest.mark.parametrize("loss_type,options", _DPO_CASES, ids=[f"{t}-{'-'.join(map(str, o.values()))}"
                                                               for t, o in _DPO_CASES])
def test_dpo_loss_type_matches_trl(loss_type, options):
    logits, input_ids, mask = _batch()
    labels = _shifted(input_ids, mask)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # a reference near the policy, so that margins fall on both sides
        seq = _token_logps(logits[:, :-1], labels).sum(-1)
        ref = seq + torch.randn(2 * B, generator=g, dtype=torch.float64) * 2
    ref_c, ref_r = ref[:B], ref[B:]
    beta = 0.5
    ref_loss, ref_grad = _trl_dpo(logits, input_ids, mask, ref_c, ref_r, loss_type=loss_type, beta=beta, **options)
    head = lcg.HeadLoss(P.DPO(loss_type=loss_type, beta=beta, **options))
    out, grad = _ours(head, logits, labels, **P.pair_inputs(head, labels, ref_chosen_logps=ref_c.float(),
                                                             ref_rejected_logps=ref_r.float()))
    _compare(out, grad, ref_loss, ref_grad)


def test_dpo_with_per_token_reference_logprobs_and_several_loss_types():
    """TRL's loss_type=[sigmoid, sft] with loss_weights, the reference given per token (TRL's
    reference forward): one head, two terms, and pair_inputs' per-token ref_logprobs."""
    logits, input_ids, mask = _batch(seed=2)
    labels = _shifted(input_ids, mask)
    ref_rows = _token_logps(logits[:, :-1].detach() + 0.3 * torch.randn(logits[:, :-1].shape, dtype=torch.float64),
                            labels)
    x = logits.detach().clone().requires_grad_()
    fake_inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=mask,
                       ref_chosen_logps=ref_rows.sum(-1)[:B], ref_rejected_logps=ref_rows.sum(-1)[B:])
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid", "sft"],
        loss_weights=[1.0, 0.3], beta=0.2, label_smoothing=0.0, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    ref_loss = trl.DPOTrainer._compute_loss(fake, _FusedModel(x), fake_inputs, return_outputs=False)
    ref_loss.backward()
    head = lcg.HeadLoss(P.DPO(loss_type="sigmoid", beta=0.2), P.DPO(loss_type="sft", weight=0.3))
    out, grad = _ours(head, logits, labels, **P.pair_inputs(head, labels, ref_logprobs=ref_rows.float()))
    _compare(out, grad, ref_loss.detach(), x.grad)


_CPO_CASES = [("sigmoid", {"label_smoothing": 0.1}), ("hinge", {}), ("ipo", {}), ("simpo", {"simpo_gamma": 0.7}),
              ("sigmoid", {"alpha": 0.3})]


def _cpo_fake(loss_type, beta, options):
    return SimpleNamespace(alpha=options.get("alpha", 0.0), beta=beta, loss_type=loss_type,
                           simpo_gamma=options.get("simpo_gamma", 0.5),
                           label_smoothing=options.get("label_smoothing", 0.0), accelerator=_accelerator())


def _nll(x, labels):
    """TRL's CPO/ORPO nll_loss: cross-entropy over the chosen responses' tokens."""
    return torch.nn.functional.cross_entropy(x[:B, :-1].reshape(-1, V), labels[:B].reshape(-1))


@pytest.mark.parametrize("loss_type,options", _CPO_CASES, ids=[f"{t}-{'-'.join(map(str, o.values()))}"
                                                               for t, o in _CPO_CASES])
def test_cpo_and_simpo_match_trl(loss_type, options):
    from trl.experimental.cpo import CPOTrainer
    logits, input_ids, mask = _batch(seed=3)
    labels = _shifted(input_ids, mask)
    full_labels = input_ids.masked_fill(mask == 0, -100)
    beta, cpo_alpha = 0.3, 0.5
    x = logits.detach().clone().requires_grad_()
    logps = CPOTrainer.get_batch_logps(x, full_labels, average_log_prob=loss_type in ("ipo", "simpo"))
    losses, _, _ = CPOTrainer.cpo_loss(_cpo_fake(loss_type, beta, options), logps[:B], logps[B:])
    ref_loss = losses.mean() + cpo_alpha * _nll(x, labels)
    ref_loss.backward()
    head = lcg.HeadLoss(P.CPO(loss_type=loss_type, beta=beta, **options), P.ChosenNLL(weight=cpo_alpha))
    out, grad = _ours(head, logits, labels, **P.pair_inputs(head, labels))
    _compare(out, grad, ref_loss.detach(), x.grad)
    if loss_type == "simpo":
        simpo = lcg.HeadLoss(P.SimPO(beta=beta, gamma=options["simpo_gamma"]), P.ChosenNLL(weight=cpo_alpha))
        out2, grad2 = _ours(simpo, logits, labels, **P.pair_inputs(simpo, labels))
        _compare(out2, grad2, ref_loss.detach(), x.grad)


def test_orpo_matches_trl():
    from trl.experimental.orpo import ORPOTrainer
    logits, input_ids, mask = _batch(seed=4)
    labels = _shifted(input_ids, mask)
    x = logits.detach().clone().requires_grad_()
    logps = ORPOTrainer.get_batch_logps(x, input_ids.masked_fill(mask == 0, -100), average_log_prob=True)
    fake = SimpleNamespace(beta=0.25, accelerator=_accelerator())
    losses = ORPOTrainer.odds_ratio_loss(fake, logps[:B], logps[B:])[0]
    ref_loss = _nll(x, labels) - losses.mean()
    ref_loss.backward()
    head = lcg.HeadLoss(P.ORPO(beta=0.25), P.ChosenNLL())
    out, grad = _ours(head, logits, labels, **P.pair_inputs(head, labels))
    _compare(out, grad, ref_loss.detach(), x.grad)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_matches_trl(loss_type):
    n = 5
    logits, input_ids, mask = _batch(seed=5, n=n)
    labels = _shifted(input_ids, mask)
    desirable = torch.tensor([True, False, True, True, False])
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        ref = _token_logps(logits[:, :-1], labels).sum(-1) + torch.randn(n, generator=g, dtype=torch.float64) * 2
    KL_logps, ref_KL_logps = torch.tensor([-3.0, -2.0]), torch.tensor([-3.5, -2.9])
    x = logits.detach().clone().requires_grad_()
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=True, loss_type=loss_type, beta=0.4, desirable_weight=1.3,
        undesirable_weight=0.7, _compute_kl_logps=lambda model, batch: KL_logps,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    batch = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=mask,
                 label=desirable, ref_logps=ref, ref_KL_logps=ref_KL_logps)
    ref_loss = trl.KTOTrainer._compute_loss(fake, _FusedModel(x), batch, return_outputs=False)
    ref_loss.backward()
    kl = (KL_logps - ref_KL_logps).mean().clamp(min=0)   # the batch's KL estimate, as TRL takes it
    head = lcg.HeadLoss(P.KTO(loss_type=loss_type, beta=0.4, kl=kl, desirable_weight=1.3, undesirable_weight=0.7))
    out, grad = _ours(head, logits, labels, **P.sequence_inputs(head, labels, desirable=desirable, ref_logps=ref.float()))
    _compare(out, grad, ref_loss.detach(), x.grad)


def test_preference_head_through_linear_matches_logits():
    """head.linear: the same DPO loss and gradients as the head on hidden @ weight.T."""
    g = torch.Generator().manual_seed(7)
    H = 16
    hidden = torch.randn(2 * B, T - 1, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    _, input_ids, mask = _batch(seed=7)
    labels = _shifted(input_ids, mask)
    head = lcg.HeadLoss(P.DPO(loss_type="ipo", beta=0.3), P.ORPO(beta=0.2), P.ChosenNLL(weight=0.5))
    inputs = P.pair_inputs(head, labels, ref_chosen_logps=torch.randn(B, generator=g) - 8,
                           ref_rejected_logps=torch.randn(B, generator=g) - 8)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = head.linear(h1, w1, labels, chunk_rows=5, **inputs)
    fused.loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    plain = head(h2 @ w2.T, labels, **inputs)
    plain.loss.backward()
    assert torch.allclose(fused.loss, plain.loss, rtol=1e-5, atol=1e-6)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)


def test_preference_terms_pass_the_float64_parity_check():
    """Every built-in against the formula evaluated directly in float64 (fp32 and bf16 logits)."""
    logits, input_ids, mask = _batch(seed=8)
    labels = _shifted(input_ids, mask)
    head = lcg.HeadLoss(P.DPO(loss_type="discopop", beta=0.2), P.CPO(loss_type="ipo"), P.ORPO(), P.ChosenNLL())
    inputs = P.pair_inputs(head, labels, ref_chosen_logps=torch.full((B,), -9.0), ref_rejected_logps=torch.full((B,), -11.0))
    lcg.testing.assert_parity(head, rows=2 * B * (T - 1), vocab=V, labels=labels.reshape(-1),
                              **{k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})


# TRL 1.16's per-pair loss types in one list (TRL's loss_type=[...] with loss_weights), one option set
_ALL = [t for t in P.DPO_LOSS_TYPES]
_ALL_WEIGHTS = [1.0 / (k + 1) for k in range(len(_ALL))]
_ALL_OPTIONS = dict(beta=0.4, label_smoothing=0.15, discopop_tau=0.3)


def _trl_all(x, input_ids, mask, ref_c, ref_r):
    """TRL's DPOTrainer._compute_loss with every per-pair loss type, on logits ``x`` (a graph)."""
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0, loss_types=_ALL,
        loss_weights=_ALL_WEIGHTS, beta=_ALL_OPTIONS["beta"], label_smoothing=_ALL_OPTIONS["label_smoothing"],
        args=SimpleNamespace(discopop_tau=_ALL_OPTIONS["discopop_tau"]), use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=mask,
                  ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    return trl.DPOTrainer._compute_loss(fake, _FusedModel(x), inputs, return_outputs=False)


def _all_head():
    return lcg.HeadLoss(*[P.DPO(loss_type=t, weight=w, **_ALL_OPTIONS) for t, w in zip(_ALL, _ALL_WEIGHTS)])


def _all_case(seed):
    """(hidden [2B, T, H], weight [V, H], input_ids, completion mask, ref_c, ref_r), float64: a
    reference near the policy, so that margins fall on both sides."""
    g = torch.Generator().manual_seed(seed)
    _, input_ids, mask = _batch(seed=seed)
    hidden = torch.randn(2 * B, T, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 16, generator=g, dtype=torch.float64) * 0.4
    with torch.no_grad():
        seq = _token_logps((hidden @ weight.T)[:, :-1], _shifted(input_ids, mask)).sum(-1)
        ref = seq + torch.randn(2 * B, generator=g, dtype=torch.float64)
    return hidden, weight, input_ids, mask, ref[:B], ref[B:]


def test_every_trl_loss_type_through_linear_matches_trl():
    """Every per-pair loss type TRL has, in one head, through head.linear: TRL's loss and its
    gradients w.r.t. the hidden states and the weight (float64 autograd through hidden @ weight.T)."""
    hidden, weight, input_ids, mask, ref_c, ref_r = _all_case(11)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_loss = _trl_all(h64 @ w64.T, input_ids, mask, ref_c, ref_r)
    ref_loss.backward()
    head = _all_head()
    labels = _shifted(input_ids, mask)
    inputs = P.pair_inputs(head, labels, ref_chosen_logps=ref_c.float(), ref_rejected_logps=ref_r.float())
    h, w = hidden[:, :-1].float().requires_grad_(), weight.float().requires_grad_()
    out = head.linear(h, w, labels, chunk_rows=7, **inputs)
    out.loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) <= 2e-5 * max(1.0, abs(ref_loss.item())), (out.loss, ref_loss)
    for got, want in ((h.grad, h64.grad[:, :-1]), (w.grad, w64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), (err, want.abs().max().item())
    assert h64.grad[:, -1].abs().max() == 0   # (the last position predicts nothing)


def _vp_others(rank, world, queue):
    """ORPO and ChosenNLL beside DPO: the sharded head against the unsharded one."""
    logits, input_ids, mask = _batch(seed=9)
    labels = _shifted(input_ids, mask)
    z = logits[:, :-1].float()
    head = lcg.HeadLoss(P.DPO(loss_type="sigmoid", beta=0.3), P.ORPO(beta=0.2), P.ChosenNLL())
    inputs = P.pair_inputs(head, labels, ref_chosen_logps=torch.full((B,), -9.0), ref_rejected_logps=torch.full((B,), -10.0))
    full = z.clone().requires_grad_()
    ref = head(full, labels, **inputs)
    ref.loss.backward()
    Vl = V // world
    shard = z[..., rank * Vl:(rank + 1) * Vl].clone().requires_grad_()
    out = head(shard, labels, process_group=dist.group.WORLD, **inputs)
    out.loss.backward()
    err = (shard.grad - full.grad[..., rank * Vl:(rank + 1) * Vl]).abs().max().item()
    queue.put(("others", out.loss.item(), ref.loss.item(), err, full.grad.abs().max().item()))


def _vp_all_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hidden, weight, input_ids, mask, ref_c, ref_r = _all_case(12)
    logits = (hidden @ weight.T).detach().requires_grad_()
    ref_loss = _trl_all(logits, input_ids, mask, ref_c, ref_r)
    ref_loss.backward()
    head = _all_head()
    labels = _shifted(input_ids, mask)
    inputs = P.pair_inputs(head, labels, ref_chosen_logps=ref_c.float(), ref_rejected_logps=ref_r.float())
    Vl = V // world
    shard = logits[:, :-1, rank * Vl:(rank + 1) * Vl].detach().float().requires_grad_()
    out = head(shard, labels, process_group=dist.group.WORLD, **inputs)
    out.loss.backward()
    want = logits.grad[:, :-1, rank * Vl:(rank + 1) * Vl]
    queue.put(("trl", out.loss.item(), ref_loss.item(), (shard.grad.double() - want).abs().max().item(),
               logits.grad.abs().max().item()))
    _vp_others(rank, world, queue)
    dist.destroy_process_group()


def test_every_trl_loss_type_vocab_parallel_matches_trl():
    """The same head on two gloo ranks, each with half of the vocabulary: TRL's loss and gradient;
    and DPO with ORPO and ChosenNLL sharded against unsharded."""
    for name, loss, ref, err, scale in run_ranks(_vp_all_worker, 2, 4):
        assert abs(loss - ref) <= 2e-5 * max(1.0, abs(ref)), (name, loss, ref)
        assert err <= (1e-4 if name == "trl" else 1e-5) * scale, (name, err, scale)


def test_dpo_refuses_what_trl_refuses():
    with pytest.raises(ValueError, match="loss_type='aot' sorts the pairs' log-ratios.*use_weighting=True"):
        P.DPO(loss_type="aot", use_weighting=True)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        P.DPO(loss_type="exo_pair")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        P.DPO(loss_type="nope")


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_batch_sorted_loss_types_match_the_float64_reference(loss_type):
    """aot's sorted log-ratios against the float64 reference (testing.py sorts with torch.sort, the
    gradient by autograd through it), fp32 and bf16, ignored rows, several pairs with ties broken
    alike; and a segment with no valid row, which is not sorted with the others."""
    head = lcg.HeadLoss(P.DPO(loss_type=loss_type, beta=0.7, label_smoothing=0.1))
    # (not on spread rows: the aot losses' sorted log-ratios of ~1e4 there are up to 16 times further from
    # float64 than plain torch's, on the torch backend: a gap recorded in docs/decisions.md, "Numerics")
    lcg.testing.assert_parity(head, rows=40, vocab=64,
                              regimes=tuple(r for r in lcg.testing.DEFAULT_REGIMES if r != "spread"))
    logits, input_ids, mask = _batch(seed=15)
    labels = _shifted(input_ids, mask)
    labels[1] = labels[B + 1] = -100    # pair 1: no valid row
    inputs = P.pair_inputs(head, labels, ref_chosen_logps=torch.randn(B), ref_rejected_logps=torch.randn(B))
    lcg.testing.assert_parity(head, rows=labels.numel(), vocab=V, labels=labels.reshape(-1),
                              **{k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})


def test_the_trl_trainer_fuses_aot(tmp_path):
    from losscodegen.integrations import trl as lcg_trl
    assert lcg_trl.unfused_dpo_options(trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                                                     loss_type=["sigmoid", "aot_unpaired"])) == []


def test_pair_inputs_checks_its_arguments():
    head = lcg.HeadLoss(P.DPO())
    labels = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="even number"):
        P.pair_inputs(head, labels)
    with pytest.raises(ValueError, match="ref_chosen_logps and ref_rejected_logps"):
        P.pair_inputs(head, torch.zeros(2, 4, dtype=torch.long), ref_chosen_logps=torch.zeros(1))
    with pytest.raises(ValueError, match="dpo_sigmoid read"):
        P.pair_inputs(head, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chosen and rejected must have the same shape"):
        P.concatenated(torch.zeros(2, 3), torch.zeros(2, 4))


def test_no_valid_row_gives_zero_and_a_zero_gradient():
    logits, input_ids, mask = _batch(seed=10)
    labels = torch.full_like(_shifted(input_ids, mask), -100)
    head = lcg.HeadLoss(P.DPO(beta=0.3), P.ORPO(), P.ChosenNLL())
    x = logits[:, :-1].float().requires_grad_()
    out = head(x, labels, **P.pair_inputs(head, labels, ref_chosen_logps=torch.zeros(B), ref_rejected_logps=torch.zeros(B)))
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))


def test_the_aot_term_written_as_docs_say_is_trls_aot():
    """docs/adding-a-loss.md's AOT, declared with S.segment_sorted, against TRL's aot (and so
    P.DPO(loss_type='aot')): value and gradient."""
    from losscodegen import symbols as S
    logits, input_ids, mask = _batch(seed=16)
    labels = _shifted(input_ids, mask)
    ref = torch.randn(2 * B, generator=torch.Generator().manual_seed(17), dtype=torch.float64) - 9
    ref_loss, ref_grad = _trl_dpo(logits, input_ids, mask, ref[:B], ref[B:], loss_type="aot", beta=0.3)
    chosen, ref_rows = S.token("chosen"), S.token("ref_logprobs")
    sign = 2 * chosen - 1
    delta = S.segment_sorted(sign * (S.target_logit - S.lse)) - S.segment_sorted(sign * ref_rows)
    AOT = lcg.declare_term("aot", -P.logsigmoid(S.param("beta") * delta), defaults={"beta": 0.1})
    head = lcg.HeadLoss(AOT(beta=0.3))
    out, grad = _ours(head, logits, labels, **P.pair_inputs(head, labels, ref_chosen_logps=ref[:B].float(),
                                                             ref_rejected_logps=ref[B:].float()))
    _compare(out, grad, ref_loss, ref_grad)


@pytest.mark.parametrize("loss_type", ["nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "aot", "aot_unpaired"])
def test_dpo_refuses_an_f_divergence_where_trl_does(loss_type):
    """TRL 1.16's DPOTrainer accepts an f_divergence_type other than reverse_kl only with the loss types
    that read the chosen-rejected score difference; the others read the log-ratios themselves, where
    the f-divergence would be silently ignored: refused, naming both arguments."""
    for f_divergence_type in ("forward_kl", "js_divergence", "alpha_divergence"):
        with pytest.raises(ValueError, match=f"f_divergence_type='{f_divergence_type}' with loss_type='{loss_type}'"):
            P.DPO(loss_type=loss_type, f_divergence_type=f_divergence_type)
    P.DPO(loss_type=loss_type, f_divergence_type="reverse_kl")
    for allowed in ("sigmoid", "sigmoid_norm", "hinge", "ipo", "discopop", "sft"):
        P.DPO(loss_type=allowed, f_divergence_type="js_divergence")


def test_pair_and_sequence_inputs_read_the_heads_ignore_index():
    """A head built with ignore_index=-1: pair_inputs / sequence_inputs spread the per-sequence
    reference sums over (and count chosen_share on) the rows the head reads as valid, against a
    float64 reference, value and gradient; a different explicit ignore_index is refused."""
    g = torch.Generator().manual_seed(5)
    n, t, v = 4, 6, 17
    z = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n, t), generator=g)
    y[:, :2] = -1
    y[3, 2:4] = -1
    refs = torch.randn(n, generator=g, dtype=torch.float64) - 3
    valid = y != -1

    def logps(x):
        return torch.log_softmax(x, -1).gather(-1, y.clamp_min(0)[..., None])[..., 0] * valid

    head = lcg.HeadLoss(P.DPO(beta=0.5), P.ChosenNLL(), ignore_index=-1)
    x64 = z.clone().requires_grad_()
    lp = logps(x64)
    s = lp.sum(-1) - refs
    want = -torch.nn.functional.logsigmoid(0.5 * (s[:2] - s[2:])).mean() - lp[:2].sum() / valid[:2].sum()
    want.backward()
    x = z.float().requires_grad_()
    out = head(x, y, **P.pair_inputs(head, y, ref_chosen_logps=refs[:2].float(), ref_rejected_logps=refs[2:].float()))
    out.loss.backward()
    _compare(out, x.grad.double(), want.detach(), x64.grad)
    assert P.pair_inputs(head, y, ignore_index=-1, ref_chosen_logps=refs[:2], ref_rejected_logps=refs[2:])
    with pytest.raises(ValueError, match=r"ignore_index=-100 is not the head's ignore_index=-1"):
        P.pair_inputs(head, y, ignore_index=-100, ref_chosen_logps=refs[:2], ref_rejected_logps=refs[2:])

    kto = lcg.HeadLoss(P.KTO(beta=0.5), ignore_index=-1)
    desirable = torch.tensor([True, False, True, False])
    x64 = z.clone().requires_grad_()
    r = 0.5 * (logps(x64).sum(-1) - refs)
    want = torch.where(desirable, torch.sigmoid(-r), torch.sigmoid(r)).mean()
    want.backward()
    x = z.float().requires_grad_()
    out = kto(x, y, **P.sequence_inputs(kto, y, desirable=desirable, ref_logps=refs.float()))
    out.loss.backward()
    _compare(out, x.grad.double(), want.detach(), x64.grad)
    with pytest.raises(ValueError, match=r"ignore_index=-100 is not the head's ignore_index=-1"):
        P.sequence_inputs(kto, y, desirable=desirable, ref_logps=refs, ignore_index=-100)


def test_sequence_inputs_need_no_reference_for_a_head_that_reads_none():
    """As pair_inputs for the reference-free losses: a head of GSPO on KTO's layout takes the sequences
    as segments without reference log-probs (found by the fuzzer, which shrank a KTO case to it); a
    head whose terms read them still names them."""
    labels = torch.randint(0, 40, (4, 3))
    desirable = torch.tensor([True, False, True, False])
    given = P.sequence_inputs(lcg.HeadLoss(lcg.GSPO()), labels, desirable=desirable)
    assert set(given) == {"segment_ids", "num_segments"} and given["num_segments"] == 4
    with pytest.raises(ValueError, match="ref_logprobs"):
        P.sequence_inputs(lcg.HeadLoss(P.KTO(loss_type="kto", beta=0.5, kl=0.0)), labels, desirable=desirable)
