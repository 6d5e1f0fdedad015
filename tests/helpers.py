"""Run a head and its float64 reference on the same random inputs and compare."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import losscodegen as lcg
from losscodegen.testing import compare
from reference import head_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(R=24, V=500, dtype=torch.float32, *, ignored=(1, 5), scale=2.0, seed=0, shape=None):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * scale).to(dtype)
    labels = torch.randint(0, V, (R,), generator=g)
    for i in ignored:
        if i < R:
            labels[i] = -100
    if shape is not None:
        logits, labels = logits.reshape(*shape, V), labels.reshape(shape)
    return logits, labels, g


def policy_inputs(logits, labels, g, spread=0.4):
    """old/ref log-probs near the current ones, so that ratios fall inside and on both clip sides;
    advantages of both signs."""
    with torch.no_grad():
        l = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp_min(0)[:, None])[:, 0]
    R = logits.shape[0]
    old = (l + torch.randn(R, generator=g, dtype=torch.float64) * spread).float()
    ref = (l + torch.randn(R, generator=g, dtype=torch.float64) * 0.1).float()
    return dict(advantages=torch.randn(R, generator=g), old_logprobs=old, ref_logprobs=ref)


def topk_inputs(R, V, K, g):
    """A teacher's top-K: K distinct ids a row, and log-probs."""
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R)])
    return dict(teacher_topk_ids=ids, teacher_topk_logprobs=torch.log_softmax(torch.randn(R, K, generator=g), -1))


def _on_backend(worker, env: dict, *args) -> None:
    # a rank: the parent test's environment when it started the rank (a rank forks from a server
    # started earlier), with its backend (conftest's ``backend`` fixture), if it chose one
    # (and the interpreter's patches once a launch: conftest's patch_triton_language_once_a_launch,
    # which its import applies where TRITON_INTERPRET=1)
    os.environ.clear()
    os.environ.update(env)
    from conftest import use_backend
    if env.get("LOSSCODEGEN_TEST_BACKEND"):
        use_backend(env["LOSSCODEGEN_TEST_BACKEND"])
    worker(*args)


# Ranks fork from one server process that imported torch and losscodegen once, not each a fresh
# interpreter importing them again (seconds a rank). It never imports triton: a rank does, after
# taking its environment.
_RANKS = mp.get_context("forkserver")
_RANKS.set_forkserver_preload(["torch", "torch.distributed", "losscodegen", "losscodegen.testing", "helpers"])


def rank_process(target, *args, env: dict | None = None) -> "multiprocessing.process.BaseProcess":
    """A process (not started) forked from the server of ranks, running ``target(*args)`` in ``env``
    (this process's environment by default); ``rank_queue()`` makes a queue it can put on."""
    return _RANKS.Process(target=_on_backend, args=(target, dict(os.environ) if env is None else env, *args))


def rank_queue() -> "multiprocessing.queues.Queue":
    """A queue that processes from ``rank_process`` can put on."""
    return _RANKS.Queue()


def run_ranks(worker, world: int, n_results: int) -> list:
    """``worker(rank, world, port, queue)`` in ``world`` processes (gloo over a free local port); the
    ``n_results`` items they put on the queue. The ranks hold CPU tensors, which the Triton backend
    takes only in Triton's interpreter: they run in it even where this process compiles for a GPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    queue = _RANKS.Queue()
    procs = [rank_process(worker, r, world, port, queue, env=env) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in range(n_results)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def spec(term, head):
    """(name, params, weight) for the reference; ClipFraction's eps come from the head's GRPO term,
    0.2 without one (docs/api.md)."""
    grpo = next((dict(t.params) for t in head.loss_terms if t.name == "grpo"), {})
    params = {k: float(grpo.get(k, 0.2) if isinstance(v, lcg.terms.FromTerm) else v) for k, v in term.params}
    return term.name, params, float(term.weight)   # (a tensor's value as it is now)


def check_head(head: lcg.HeadLoss, logits, labels=None, *, grad_tol=None, value_tol=None, **inputs):
    """Assert the head's loss, terms, metrics and gradient match the hand-written float64 reference
    (tests/reference.py), compared as ``lcg.testing.assert_parity`` compares (``testing.compare``)."""
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    dev_inputs = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    out = head(x, labels.to(DEVICE) if labels is not None else None, **dev_inputs)
    wants_grad = bool(head.loss_terms)
    if wants_grad:
        out.loss.sum().backward() if out.loss.dim() else out.loss.backward()
    ref_inputs = {k: v for k, v in inputs.items() if k not in ("num_segments",)}
    ref_loss, ref_values, ref_grad = head_reference(
        [spec(t, head) for t in head.loss_terms], [spec(t, head) for t in head.metric_terms],
        logits, labels, ignore_index=head.ignore_index, logit_scale=head.logit_scale,
        softcap=head.softcap, **ref_inputs)
    rtol, atol, default_grad_tol = lcg.testing.TOLERANCES[logits.dtype]
    rtol, atol = value_tol or (rtol, atol)
    tolerances = (rtol, atol, grad_tol or default_grad_tol)
    compare("loss", out.loss, ref_loss, logits.dtype, tolerances=tolerances)
    for name, value in {**out.terms, **out.metrics}.items():
        assert value.dtype == torch.float32 and not value.requires_grad
        compare(name, value, ref_values[name], logits.dtype, tolerances=tolerances)
    if wants_grad:
        assert x.grad.dtype == logits.dtype and x.grad.shape == logits.shape
        assert torch.isfinite(x.grad).all()
        compare("gradient", x.grad, ref_grad, logits.dtype, tolerances=tolerances)
    return out


def tiny_causal_lm(vocab: int, model_type: str = "llama", **overrides):
    """A one-layer transformers causal LM of ``model_type`` built from its config (no hub), fp32, with
    an output layer scaled up so that its distributions are peaked (ratios clip, labels are top-1)."""
    import transformers
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=2,
        bos_token_id=3, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer built locally (no hub): ids 0-3 are pad, unk, eos, bos, then t4, t5, ..."""
    import tokenizers
    import transformers
    words = {"<pad>": 0, "<unk>": 1, "<eos>": 2, "<bos>": 3, **{f"t{i}": i for i in range(4, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<bos>", unk_token="<unk>")


class TorchOps(TorchDispatchMode):
    """Every torch op run inside it, as ``(op, the shapes of the tensors it made)``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                                     if isinstance(t, torch.Tensor)]))
        return out


def both_backends(default: str) -> list:
    """For a test that names its backends (``parametrize("backend", both_backends(...), indirect=True)``):
    both, the one that is not ``default`` marked ``slow`` (run by the slow tier, which CI runs too)."""
    return [pytest.param(b, marks=() if b == default else pytest.mark.slow) for b in ("triton", "torch")]


def run_backward(head: lcg.HeadLoss, logits: torch.Tensor, labels, **kwargs) -> tuple:
    """The head's output on a copy of ``logits`` and the copy's gradient after ``out.loss.backward()``."""
    x = logits.detach().clone().requires_grad_(True)
    out = head(x, labels, **kwargs)
    out.loss.backward()
    return out, x.grad
