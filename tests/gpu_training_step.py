"""A head in a training step, on a GPU (not collected by pytest): `python tests/gpu_training_step.py`.

Checks, each printed as a line of the table at the end (the script exits 1 if one fails):
- the default call (validate=True) makes no host sync: fwd+bwd under set_sync_debug_mode("error");
- a bad label makes that call's loss NaN and raises at the head's next call, naming the value;
- a default call, forward and backward, captured in a CUDA graph and replayed equals eager;
- inputs off a 16-byte boundary, between aligned calls, give what their aligned copies give;
- inplace_backward=True lowers the peak memory of a head's forward + backward by the logits' size
  (torch.cuda.max_memory_allocated), also reported for logits = hidden @ W.T -> head -> backward;
- torch.compile(fullgraph=True) with Inductor: gradients equal eager, and the compiled step's time
  beside eager's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

import losscodegen as lcg
from gpu_bench import peak_gb

results: list[tuple[str, bool, str]] = []


def same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Equal, or for heads with segment terms (summed per segment by float atomics, in no fixed
    order) equal up to fp32 rounding."""
    return torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)


def check(name: str, ok: bool, detail: str = "") -> None:
    results.append((name, bool(ok), detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def heads(R, V, g):
    """name -> (head, inputs) for every kind of input a head reads."""
    lp = torch.randn(R, device="cuda", generator=g) - 11.0
    policy = dict(advantages=torch.randn(R, device="cuda", generator=g), old_logprobs=lp)
    ids = torch.randint(0, V, (R, 32), device="cuda", generator=g)
    ids = torch.where(ids == ids.roll(1, 1), (ids + 1) % V, ids)
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


def no_host_sync(R, V, g):
    x = torch.randn(R, V, device="cuda", generator=g).bfloat16().requires_grad_()
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    for name, (head, kw) in heads(R, V, g).items():
        head(x, y, **kw).loss.backward()         # first use: generate, compile
        torch.cuda.synchronize()
        try:
            for _ in range(2):                   # the second call reads the first one's flag
                torch.cuda.set_sync_debug_mode("error")
                x.grad = None
                head(x, y, **kw).loss.backward()
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            check(f"no host sync: {name}", True)
        except RuntimeError as e:
            torch.cuda.set_sync_debug_mode("default")
            check(f"no host sync: {name}", False, str(e)[:200])


def bad_label_next_call(R, V, g):
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    x = torch.randn(R, V, device="cuda", generator=g).bfloat16().requires_grad_()
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    bad = y.clone()
    bad[5] = V + 3
    out = head(x, bad)
    out.loss.backward()
    nan = bool(torch.isnan(out.loss))
    try:
        head(x, y)
        check("bad label: NaN now, ValueError at the next call", False, f"no error (loss NaN: {nan})")
    except ValueError as e:
        check("bad label: NaN now, ValueError at the next call", nan and str(V + 3) in str(e), str(e)[:120])
    ok = torch.isfinite(head(x, y).loss).item()
    check("bad label: the call after the error is clean", ok)
    # a tight loop, no sync: the GPU is held back, so the bad call is still queued when the next two
    # are made; the second of them waits for it and raises
    torch.cuda._sleep(50_000_000)
    head(x, bad)
    raised_at = None
    for i in (1, 2):
        try:
            head(x, y)
        except ValueError as e:
            raised_at = (i, str(V + 3) in str(e))
            break
    check("bad label in a tight loop: ValueError at the latest two calls later", raised_at == (2, True),
          f"raised at call {raised_at}")


def cuda_graph(R, V, g):
    for name, (head, kw) in heads(R, V, g).items():
        x = torch.randn(R, V, device="cuda", generator=g).bfloat16().requires_grad_()
        y = torch.randint(0, V, (R,), device="cuda", generator=g)
        y[::9] = -100
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
        fresh = torch.randn(R, V, device="cuda", generator=g).bfloat16()
        x.data.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        replay_loss, replay_grad = out.loss.clone(), x.grad.clone()
        ex = fresh.clone().requires_grad_()
        ref = head(ex, y, **kw)
        ref.loss.backward()
        exact = not head.kernel.SEGMENTS
        ok = same(replay_loss, ref.loss, exact) and same(replay_grad, ex.grad, exact)
        check(f"CUDA graph replay equals eager: {name}", ok,
              f"loss {replay_loss.item():.6f} vs {ref.loss.item():.6f}")
        del graph, out, x, ex


def inplace_memory(R, V, H, g):
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    logits = torch.randn(R, V, device="cuda", generator=g).bfloat16()
    hidden = (torch.randn(R, H, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    logits_gb = R * V * 2 / 1e9
    peaks, grads = {}, {}
    for inplace in (False, True):
        head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),), inplace_backward=inplace)

        def alone():  # the head on logits it may overwrite; the gradient stays in x.grad
            x = logits.clone().requires_grad_()
            head(x, y).loss.backward()
            grads[inplace] = x.grad

        def linear():
            hidden.grad = weight.grad = None
            head(hidden @ weight.t(), y).loss.backward()
        peaks[inplace] = (peak_gb(alone) - logits_gb, peak_gb(linear))  # (alone's clone is an input)
    drop = peaks[False][0] - peaks[True][0]
    equal = torch.equal(grads[False], grads[True])
    check("inplace_backward: peak memory drops by the logits' size", drop > 0.95 * logits_gb and equal,
          f"{R}x{V} bf16 head fwd+bwd above its logits: {peaks[False][0]:.2f} -> {peaks[True][0]:.2f} GB "
          f"(logits {logits_gb:.2f} GB); through hidden @ W.T (H={H}): {peaks[False][1]:.2f} -> "
          f"{peaks[True][1]:.2f} GB; same grads {equal}")
    return dict(head_peak_gb=peaks[False][0], head_peak_inplace_gb=peaks[True][0],
                linear_peak_gb=peaks[False][1], linear_peak_inplace_gb=peaks[True][1], logits_gb=logits_gb)


def misaligned_inputs(R, V, g):
    """Each launch's compiled kernel is launched directly once known (dispatch.py), keyed by its
    inputs' alignment: the same inputs one element off a 16-byte boundary, between aligned calls,
    give the same loss and gradient (a kernel compiled for aligned pointers would fault or misread)."""
    def off(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:].copy_(t.reshape(-1))
        return buf[1:].view(t.shape)
    for name, (head, kw) in heads(R, V, g).items():
        x = torch.randn(R, V, device="cuda", generator=g).bfloat16()
        y = torch.randint(0, V, (R,), device="cuda", generator=g)
        y[::5] = -100
        shifted = {k: off(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        got = []
        for logits, labels, inputs in ((x, y, kw), (off(x), off(y), shifted), (x, y, kw)):
            logits = logits.detach().requires_grad_()
            out = head(logits, labels, **inputs)
            out.loss.backward()
            got.append((out.loss.detach(), logits.grad))
        exact = not head.kernel.SEGMENTS
        ok = all(same(loss, got[0][0], exact) and same(grad, got[0][1], exact) for loss, grad in got[1:])
        check(f"misaligned inputs between aligned calls: {name}", ok)


def compiled_vs_eager(R, V, g):
    out = {}
    for name, (head, kw) in heads(R, V, g).items():
        x = torch.randn(R, V, device="cuda", generator=g).bfloat16().requires_grad_()
        y = torch.randint(0, V, (R,), device="cuda", generator=g)

        def step(x, y, kw):
            o = head(x, y, **kw)
            return o.loss, o.terms, o.metrics
        compiled = torch.compile(step, fullgraph=True)
        loss, _, _ = compiled(x, y, kw)
        loss.backward()
        g_c, x.grad = x.grad.clone(), None
        ref = head(x, y, **kw)
        ref.loss.backward()
        exact = not head.kernel.SEGMENTS
        equal = same(g_c, x.grad, exact) and same(loss, ref.loss, exact)

        def run(fn):
            def once():
                x.grad = None
                fn(x, y, kw)[0].backward()
            return triton.testing.do_bench(once, warmup=25, rep=200, return_mode="median")
        t_eager, t_comp = run(step), run(compiled)
        check(f"torch.compile(fullgraph) = eager: {name}", equal and t_comp <= 1.05 * t_eager,
              f"grads equal {equal}; eager {t_eager:.3f} ms, compiled {t_comp:.3f} ms")
        out[name] = dict(eager_ms=t_eager, compiled_ms=t_comp, grads_equal=equal)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    R, V = args.rows, args.vocab
    no_host_sync(R, V, g)
    bad_label_next_call(R, V, g)
    cuda_graph(R, V, g)
    misaligned_inputs(R, V, g)
    memory = inplace_memory(2 * R, V, args.hidden, g)
    timings = compiled_vs_eager(2 * R, V, g)
    with open(os.path.join(args.out, "gpu_training_step.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), memory=memory, compile=timings,
                       checks=results), f, indent=1)
    print(f"\n{sum(ok for _, ok, _ in results)}/{len(results)} checks passed")
    for name, ok, detail in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {name:52s} {detail}")
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
