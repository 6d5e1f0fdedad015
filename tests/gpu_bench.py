"""GPU check and benchmark (not collected by pytest): parity at a realistic size, then timings.

    python tests/gpu_bench.py [--rows 4096] [--vocab 128256] [--bench-rows 8192] [--out DIR]
                              [--no-compile] [--sweep-tiles]

Parity: bf16 logits, every head's loss/terms/metrics and gradient vs the float64 reference of
tests/reference.py (on the GPU). Timing: forward + backward (gradient written), median of
triton.testing.do_bench, against torch.compile of the same formulas in fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
import losscodegen as lcg  # noqa: E402
from reference import head_reference  # noqa: E402
from helpers import spec  # noqa: E402


def heads():
    return {
        "CE": (lcg.HeadLoss(lcg.CrossEntropy()), set()),
        "CE+z+entropy+acc": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                          metrics=(lcg.Entropy(), lcg.TokenAccuracy())), set()),
        "CE+z+0.5FKL+entropy": (lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                             lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),)),
                                {"teacher"}),
        "GRPO+entropy+clip": (lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction())),
                              {"policy"}),
        "GSPO (segments of 256)": (lcg.HeadLoss(lcg.GSPO()), {"policy", "segments"}),
    }


def inputs(R, V, needs, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (R,), device="cuda", generator=g)
    y[::7] = -100
    kw = {}
    if "teacher" in needs:
        kw["teacher_logits"] = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    if "policy" in needs:
        with torch.no_grad():
            l = torch.log_softmax(x.float(), -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
        kw["old_logprobs"] = l + 0.3 * torch.randn(R, device="cuda", generator=g)
        kw["advantages"] = torch.randn(R, device="cuda", generator=g)
    if "segments" in needs:
        kw["old_logprobs"] = l + 0.001 * torch.randn(R, device="cuda", generator=g)  # inside the clip
        kw["segment_ids"] = torch.arange(R, device="cuda") // 256
        kw["num_segments"] = (R + 255) // 256
    return x, y, kw


def parity(R, V):
    rows = []
    for name, (head, needs) in heads().items():
        x, y, kw = inputs(R, V, needs)
        xg = x.clone().requires_grad_()
        out = head(xg, y, **kw)
        out.loss.backward()
        torch.cuda.synchronize()
        ref_loss, ref_vals, ref_grad = head_reference(
            [spec(t, head) for t in head.loss_terms], [spec(t, head) for t in head.metric_terms], x, y,
            **{k: v for k, v in kw.items() if k != "num_segments"})
        errs = {"loss": abs(out.loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)}
        for k, v in {**out.terms, **out.metrics}.items():
            errs[k] = abs(v.item() - ref_vals[k].item()) / max(abs(ref_vals[k].item()), 1e-6)
        g = xg.grad.double()
        errs["grad_rel_fro"] = ((g - ref_grad).norm() / ref_grad.norm()).item()
        ok = all(e < 2e-3 for k, e in errs.items() if k != "grad_rel_fro") and errs["grad_rel_fro"] < 1e-2
        rows.append(dict(head=name, ok=ok, **errs))
        del ref_grad, g, xg, out
        torch.cuda.empty_cache()
    return rows


def _compiled(name):
    def ce_z_ent(x, y, **_):
        z = x.float()
        lse = torch.logsumexp(z, -1)
        v = y != -100
        n = v.sum().clamp_min(1)
        ce = F.cross_entropy(z, y, ignore_index=-100, reduction="sum") / n
        zl = torch.where(v, lse ** 2, 0).sum() / n
        p = torch.softmax(z, -1)
        ent = torch.where(v, lse - (p * z).sum(-1), 0).sum() / n
        acc = torch.where(v, z.argmax(-1) == y, False).sum() / n
        return ce + 1e-4 * zl, ent.detach(), acc.detach()

    def ce(x, y, **_):
        return F.cross_entropy(x.float(), y, ignore_index=-100)

    def fkl(x, y, teacher_logits, **_):
        loss, ent, _ = ce_z_ent(x, y)
        v = y != -100
        q = torch.log_softmax(teacher_logits.float(), -1)
        kl = (q.exp() * (q - torch.log_softmax(x.float(), -1))).sum(-1)
        return loss + 0.5 * torch.where(v, kl, 0).sum() / v.sum().clamp_min(1), ent

    def grpo(x, y, old_logprobs, advantages, **_):
        z = x.float()
        v = y != -100
        n = v.sum().clamp_min(1)
        logp = torch.log_softmax(z, -1)
        l = logp.gather(1, y.clamp_min(0)[:, None])[:, 0]
        r = torch.exp(l - old_logprobs)
        per = -torch.min(r * advantages, r.clamp(0.8, 1.2) * advantages)
        ent = torch.where(v, -(logp.exp() * logp).sum(-1), 0).sum() / n
        clip = torch.where(v, (r < 0.8) | (r > 1.2), False).sum() / n
        return torch.where(v, per, 0).sum() / n, ent.detach(), clip.detach()

    def gspo(x, y, old_logprobs, advantages, segment_ids, num_segments, **_):
        v = (y != -100).float()
        l = torch.log_softmax(x.float(), -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
        count = torch.zeros(num_segments, device=x.device).index_add_(0, segment_ids, v)
        def mean(u):
            sums = torch.zeros(num_segments, device=x.device).index_add_(0, segment_ids, u * v)
            return sums / count.clamp_min(1)
        r, a = torch.exp(mean(l - old_logprobs)), mean(advantages)
        per = -torch.min(r * a, r.clamp(1 - 3e-4, 1 + 4e-4) * a)
        return torch.where(count > 0, per, 0).sum() / (count > 0).sum().clamp_min(1)

    return torch.compile({"CE": ce, "CE+z+entropy+acc": ce_z_ent, "CE+z+0.5FKL+entropy": fkl,
                          "GRPO+entropy+clip": grpo, "GSPO (segments of 256)": gspo}[name])


def bench(R, V, compiled_baseline=True):
    rows = []
    for name, (head, needs) in heads().items():
        x, y, kw = inputs(R, V, needs, seed=1)
        x.requires_grad_()

        def ours():
            x.grad = None
            head(x, y, **kw).loss.backward()

        fn = _compiled(name)

        def compiled():
            x.grad = None
            out = fn(x, y, **kw)
            (out[0] if isinstance(out, tuple) else out).backward()

        ours()  # compile first: the check below is about the steady state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # raises on any host sync in forward or backward
        try:
            ours()
            sync_free = True
        except RuntimeError as e:
            sync_free = False
            print(f"{name}: host sync: {str(e)[:300]}", flush=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        t_ours = triton.testing.do_bench(ours, warmup=50, rep=300, return_mode="median")
        head.validate = False
        t_noval = triton.testing.do_bench(ours, warmup=50, rep=300, return_mode="median")
        head.validate = True
        t_comp = compile_s = float("nan")
        if compiled_baseline:
            t0 = time.time()
            compiled()
            compile_s = time.time() - t0
            t_comp = triton.testing.do_bench(compiled, warmup=50, rep=300, return_mode="median")
        t_ours2 = triton.testing.do_bench(ours, warmup=50, rep=300, return_mode="median")
        plan = head.plan()
        floor = plan.bytes_per_element(grad=True) * R * V / 3.0e12 * 1e3
        rows.append(dict(head=name, sync_free=sync_free, ours_ms=t_ours, noval_ms=t_noval, ours_ms_again=t_ours2,
                         torch_compile_ms=t_comp,
                         compile_s=compile_s, bytes_per_elem=plan.bytes_per_element(), floor_ms=floor))
        del x, kw
        torch.cuda.empty_cache()
    return rows


def sweep_tiles(R, V):
    """Each head at every (BLOCK_V, num_warps) of TILES, to check the plan's pick (Plan.tile)."""
    from losscodegen import launch as run
    chosen, rows = run.launch_config, []
    try:
        for name, (head, needs) in heads().items():
            head.validate = False
            x, y, kw = inputs(R, V, needs, seed=1)
            x.requires_grad_()

            def step():
                x.grad = None
                head(x, y, **kw).loss.backward()
            for block_v, warps in TILES:
                run.launch_config = lambda V_, tile, w=2, _b=block_v, _w=warps: dict(BLOCK_V=_b, num_warps=_w)
                ms = triton.testing.do_bench(step, warmup=20, rep=150, return_mode="median")
                rows.append(dict(head=name, block_v=block_v, num_warps=warps, ms=ms,
                                 planned=head.kernel.TILE == (block_v, warps)))
            del x, kw
            torch.cuda.empty_cache()
    finally:
        run.launch_config = chosen
    return rows


TILES = [(4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--bench-rows", type=int, default=8192)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--sweep-tiles", action="store_true", help="also time every tile of TILES")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    result["parity"] = parity(args.rows, args.vocab)
    for r in result["parity"]:
        print("parity", json.dumps(r), flush=True)
    if not args.skip_bench:
        result["bench"] = bench(args.bench_rows, args.vocab, not args.no_compile)
    if args.sweep_tiles:
        result["tiles"] = sweep_tiles(args.bench_rows, args.vocab)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nparity at {args.rows} x {args.vocab} bf16 (relative errors vs float64):")
    for r in result["parity"]:
        print(f"  {r['head']:22s} ok={r['ok']}  loss {r['loss']:.1e}  grad(fro) {r['grad_rel_fro']:.1e}")
    if "bench" in result:
        print(f"\nforward+backward at {args.bench_rows} x {args.vocab} bf16, median ms:")
        print(f"  {'head':22s} {'ours':>8s} {'noval':>8s} {'again':>8s} {'compile':>8s} {'floor':>8s} B/elem  no host sync")
        for r in result["bench"]:
            print(f"  {r['head']:22s} {r['ours_ms']:8.3f} {r['noval_ms']:8.3f} {r['ours_ms_again']:8.3f} "
                  f"{r['torch_compile_ms']:8.3f} {r['floor_ms']:8.3f} {r['bytes_per_elem']:6g}  "
                  f"{r['sync_free']}")
    if "tiles" in result:
        print("\nforward+backward ms by BLOCK_V/num_warps (* the plan's tile):")
        for name in dict.fromkeys(r["head"] for r in result["tiles"]):
            print(f"  {name:22s} " + "  ".join(
                f"{r['block_v']}/{r['num_warps']}{'*' if r['planned'] else ' '} {r['ms']:.3f}"
                for r in result["tiles"] if r["head"] == name))


if __name__ == "__main__":
    main()
