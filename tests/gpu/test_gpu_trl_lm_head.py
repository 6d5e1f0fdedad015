"""The drop-in for TRL's fused LM head on a GPU (marked ``gpu``: skipped without one), where TRL's head
takes its Triton path: a Llama layer at a real vocabulary (128256) in bf16, a GRPO-shaped batch (the
prompt half of every row unscored), TRL's head and ours against the model's own unfused logits
(log_softmax of its bf16 logits in fp32): per-token log-probs and entropy, the gradients through them,
and the peak memory of a forward and backward. (Timings live in bench/trl_lm_head.py.)
"""
from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head  # noqa: E402

from losscodegen.integrations import trl as lcg_trl  # noqa: E402

pytestmark = pytest.mark.gpu
B, T, V = 4, 1024, 128256


def _model():
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=2048, intermediate_size=4096, num_hidden_layers=1,
                                      num_attention_heads=16, num_key_value_heads=8, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(5)     # logits of a few units: peaked distributions, as a trained model's
    return model


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
    labels = ids.clone()
    labels[:, : T // 2] = -100
    labels[1, 3 * T // 4:] = -100
    return ids, labels


def _step(model, ids, labels, fused):
    """(log_probs, entropy, {name: grad}) of one forward and backward of log_probs + 0.1 * entropy."""
    model.zero_grad(set_to_none=True)
    if fused:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        logp, ent = out.log_probs, out.entropy
    else:
        logits = model(input_ids=ids).logits[:, :-1].float()
        lsm = torch.log_softmax(logits, -1)
        mask = labels[:, 1:] != -100
        logp = lsm.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
        ent = -(lsm.exp() * lsm).sum(-1) * mask
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def _errors(got, ref):
    """Mean absolute errors of the log-probs and entropies, relative errors of every gradient."""
    return [(got[0] - ref[0]).abs().mean().item(), (got[1] - ref[1]).abs().mean().item(),
            *(((g - ref[2][n]).norm() / ref[2][n].norm()).item() for n, g in got[2].items())]


def test_values_and_gradients_against_trls_and_the_unfused_logits(batch):
    ids, labels = batch
    model = _model()
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    trl_add_fused_lm_head(theirs, outputs=("log_probs", "entropy"))
    lcg_trl.add_fused_lm_head(ours, outputs=("log_probs", "entropy"))
    ref = _step(model, ids, labels, fused=False)
    got = {"TRL": _step(theirs, ids, labels, True), "losscodegen": _step(ours, ids, labels, True)}
    for name, (logp, ent, grads) in got.items():
        # the same bf16 logits up to the products' rounding (a logit's bf16 ulp is 1/32 here)
        torch.testing.assert_close(logp, ref[0], rtol=0, atol=0.1, msg=lambda m: f"{name} log_probs: {m}")
        torch.testing.assert_close(ent, ref[1], rtol=0, atol=0.1, msg=lambda m: f"{name} entropy: {m}")
        for n, g in grads.items():
            err = (g - ref[2][n]).norm() / ref[2][n].norm()
            assert err < 2e-2, f"{name} {n}: relative error {err:.2e}"
    # no further from the unfused logits than TRL's head, up to bf16's noise
    for ours_err, trl_err in zip(_errors(got["losscodegen"], ref), _errors(got["TRL"], ref)):
        assert ours_err <= 1.5 * trl_err + 1e-3, (ours_err, trl_err)


def test_peak_memory_at_most_trls(batch):
    """A forward and backward of ours peaks no higher than TRL's, and adds less than a twentieth of
    the [B, T, V] bf16 logits to it. (Both peak at the fp32 dL/dweight accumulator, the size of two
    bf16 weights: measured on an H100 with TRL 1.16, 3.379 GB for TRL and 3.387 for ours, above twice
    the logits' 1.05 GB, which the claim "far below the logits" had said and which does not hold at
    this shape.)"""
    ids, labels = batch
    peaks = {}
    for name, add in (("TRL", trl_add_fused_lm_head), ("losscodegen", lcg_trl.add_fused_lm_head)):
        model = _model()
        add(model, outputs=("log_probs", "entropy"))
        _step(model, ids, labels, True)          # (warm: kernels compiled, caches made)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, ids, labels, True)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    logits_bytes = B * T * V * 2
    assert peaks["losscodegen"] <= peaks["TRL"] * 1.05, peaks
    assert peaks["losscodegen"] - peaks["TRL"] < logits_bytes / 20, peaks
