"""A head in a training step, on a GPU (marked ``gpu``: skipped without one).

- the default call (validate=True) makes no host sync: fwd+bwd under set_sync_debug_mode("error");
- a bad label makes that call's loss NaN and raises at the head's next call, naming the value, and
  in a tight loop at the latest two calls later;
- a default call, forward and backward, captured in a CUDA graph and replayed equals eager;
- inputs off a 16-byte boundary, between aligned calls, give what their aligned copies give;
- inplace_backward=True lowers the peak memory of a head's forward + backward by the logits' size;
- torch.compile(fullgraph=True) with Inductor: gradients equal eager.
(Timings live in bench/, never in a test.)
"""
from __future__ import annotations

import pytest
import torch

import losscodegen as lcg

pytestmark = pytest.mark.gpu
R, V, H = 4096, 128256, 4096


def heads():
    """name -> (head, inputs) for every kind of input a head reads."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lp = torch.randn(R, device="cuda", generator=g) - 11.0
    policy = dict(advantages=torch.randn(R, device="cuda", generator=g), old_logprobs=lp)
    ids = torch.stack([torch.randperm(V, device="cuda", generator=g)[:32] for _ in range(R)])
    return {
        "CE+z+ent+acc": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                      metrics=(lcg.Entropy(), lcg.TokenAccuracy())), {}),
        "CE+z+0.5FKL+ent": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4), lcg.ForwardKL(weight=0.5),
                                         metrics=(lcg.Entropy(),)),
                            dict(teacher_logits=torch.randn(R, V, device="cuda", generator=g).bfloat16())),
        "GRPO+ent+clip": (lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())), policy),
        "CE+topk": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.5)),
                    dict(teacher_topk_ids=ids, teacher_topk_logprobs=torch.log_softmax(
                        torch.randn(R, 32, device="cuda", generator=g), -1))),
        "GSPO": (lcg.HeadLoss(lcg.GSPO()), dict(policy, segment_ids=torch.arange(R, device="cuda") // 256,
                                                num_segments=R // 256)),
    }


HEADS = list(heads()) if torch.cuda.is_available() else ["none"]


@pytest.fixture(scope="module")
def all_heads():
    return heads()


def inputs(seed: int = 1, ignore_every: int = 9):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(R, V, device="cuda", generator=g).bfloat16()
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    y[::ignore_every] = -100
    return x, y


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Equal, or for heads with segment terms (summed per segment by float atomics, in no fixed
    order) equal up to fp32 rounding."""
    return torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", HEADS)
def test_no_host_sync(all_heads, name):
    head, kw = all_heads[name]
    x, y = inputs()
    x.requires_grad_()
    head(x, y, **kw).loss.backward()         # first use: generate, compile
    torch.cuda.synchronize()
    try:
        for _ in range(3):                   # later calls read the earlier ones' flags
            torch.cuda.set_sync_debug_mode("error")
            x.grad = None
            head(x, y, **kw).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bad_label_raises_at_the_next_call():
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    x, y = inputs()
    x.requires_grad_()
    bad = y.clone()
    bad[5] = V + 3
    out = head(x, bad)
    out.loss.backward()
    assert torch.isnan(out.loss)
    with pytest.raises(ValueError, match=str(V + 3)):
        head(x, y)
    assert torch.isfinite(head(x, y).loss)
    # a tight loop, no sync: the GPU is held back, so the bad call is still queued when the next two
    # are made; the second of them waits for it and raises
    torch.cuda._sleep(50_000_000)
    head(x, bad)
    head(x, y)
    with pytest.raises(ValueError, match=str(V + 3)):
        head(x, y)


@pytest.mark.parametrize("name", HEADS)
def test_cuda_graph_replay_equals_eager(all_heads, name):
    head, kw = all_heads[name]
    x, y = inputs()
    x.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.grad = None
            head(x, y, **kw).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        out = head(x, y, **kw)
        out.loss.backward()
    fresh, _ = inputs(seed=2)
    x.data.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    ex = fresh.clone().requires_grad_()
    ref = head(ex, y, **kw)
    ref.loss.backward()
    exact = not head.kernel.SEGMENTS
    assert same(out.loss, ref.loss, exact) and same(x.grad, ex.grad, exact)


@pytest.mark.parametrize("name", HEADS)
def test_misaligned_inputs_between_aligned_calls(all_heads, name):
    """Each launch's compiled kernel is launched directly once known (dispatch.py), keyed by its
    inputs' alignment: the same inputs one element off a 16-byte boundary, between aligned calls,
    give the same loss and gradient."""
    def off(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:].copy_(t.reshape(-1))
        return buf[1:].view(t.shape)
    head, kw = all_heads[name]
    x, y = inputs(ignore_every=5)
    shifted = {k: off(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = []
    for logits, labels, kwargs in ((x, y, kw), (off(x), off(y), shifted), (x, y, kw)):
        logits = logits.detach().requires_grad_()
        out = head(logits, labels, **kwargs)
        out.loss.backward()
        got.append((out.loss.detach(), logits.grad))
    exact = not head.kernel.SEGMENTS
    assert all(same(loss, got[0][0], exact) and same(grad, got[0][1], exact) for loss, grad in got[1:])


def _peak_gb(fn) -> float:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def test_inplace_backward_saves_the_logits_size():
    x, y = inputs()
    logits_gb = R * V * 2 / 1e9
    peaks, grads = {}, {}
    for inplace in (False, True):
        head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),), inplace_backward=inplace)

        def alone():  # the head on logits it may overwrite; the gradient stays in xc.grad
            xc = x.clone().requires_grad_()
            head(xc, y).loss.backward()
            grads[inplace] = xc.grad
        peaks[inplace] = _peak_gb(alone) - logits_gb   # (alone's clone is an input)
    assert peaks[False] - peaks[True] > 0.95 * logits_gb, peaks
    assert torch.equal(grads[False], grads[True])


@pytest.mark.parametrize("name", HEADS)
def test_compiled_equals_eager(all_heads, name):
    head, kw = all_heads[name]
    x, y = inputs()
    x.requires_grad_()

    def step(x, y, kw):
        o = head(x, y, **kw)
        return o.loss, o.terms, o.metrics
    loss, _, _ = torch.compile(step, fullgraph=True)(x, y, kw)
    loss.backward()
    g_c, x.grad = x.grad.clone(), None
    ref = head(x, y, **kw)
    ref.loss.backward()
    exact = not head.kernel.SEGMENTS
    assert same(g_c, x.grad, exact) and same(loss, ref.loss, exact)
