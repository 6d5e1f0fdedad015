"""A real training step on the GPU: a Llama-style model (random init, bf16 weights, AdamW, gradient
checkpointing) trained for a few dozen steps, one process, four ways on the same batches:

- ``unpatched``: transformers' own forward and loss ([batch, seq, vocab] logits, upcast to fp32);
- ``liger``: Liger's ``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)``, only the loss
  patched (skipped when liger_kernel is not importable);
- ``losscodegen``: ``apply_losscodegen(model)`` (CE through ``head.linear``);
- ``losscodegen+``: ``apply_losscodegen`` with CE + z-loss and entropy and accuracy metrics.

Recorded per variant: the median step time (after warm-up steps), tokens/s, the peak memory above the
model's weights (gradients, optimizer states and activations included), and the loss curve (for the
z-loss variant its CE term). Written to ``DIR/<device>-hf-training-step-b<B>.json`` (and a plot with
matplotlib); a short table is printed last.

    python bench/training_step.py --out docs/perf --steps 30 --batch 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

VARIANTS = ("unpatched", "liger", "losscodegen", "losscodegen+")


def build(args):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=args.tie, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def patch(model, variant):
    """The variant's patch; returns how to read the step's CE (None: the loss is the CE)."""
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
    elif variant.startswith("losscodegen"):
        import losscodegen as lcg
        from losscodegen.integrations.transformers import apply_losscodegen
        head = None
        if variant == "losscodegen+":
            head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
        apply_losscodegen(model, head)
        if head is not None:
            return lambda: model.losscodegen.terms["cross_entropy"]
    return None


def batches(args):
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        yield ids.cuda(non_blocking=True)


def run(variant, args):
    model = build(args)
    ce_of = patch(model, variant)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in batches(args):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append((ce_of() if ce_of is not None else out.loss).item())
        del out
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt
    torch.cuda.empty_cache()
    step = statistics.median(times[args.warmup:])
    return dict(median_step_ms=step * 1e3, tokens_per_s=args.batch * args.seq / step,
                peak_gb_above_model=peak / 1e9, losses=losses, step_ms=[t * 1e3 for t in times])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tie", action="store_true", help="tie the embeddings and the output layer")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must be more than --warmup")

    import transformers
    variants = [v for v in args.variants.split(",") if v]
    results, skipped = {}, {}
    for variant in variants:
        if variant == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError as e:
                skipped[variant] = f"liger_kernel not importable ({e})"
                continue
            # Liger patches LlamaForCausalLM.forward on the class: put it back for the variants after it.
            forward = transformers.LlamaForCausalLM.forward
            try:
                results[variant] = run(variant, args)
            finally:
                transformers.LlamaForCausalLM.forward = forward
        else:
            results[variant] = run(variant, args)
        r = results[variant]
        print(f"{variant}: {r['median_step_ms']:.1f} ms, {r['peak_gb_above_model']:.2f} GB, "
              f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)

    ref = results.get("unpatched")
    for r in results.values():
        if ref is not None:
            r["max_loss_diff_vs_unpatched"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    device = torch.cuda.get_device_name()
    import losscodegen
    record = dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
                  losscodegen=losscodegen.__version__, args=vars(args), skipped=skipped, results=results,
                  note="median step after the warm-up steps; peak memory above the bf16 weights (gradients, "
                       "AdamW states, activations); losses: the CE of each step (the z-loss variant's CE term)")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{device.replace(' ', '-')}-hf-training-step-b{args.batch}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for name, r in results.items():
            a.plot(r["losses"], label=name)
        a.set(xlabel="step", ylabel="cross-entropy", title=f"loss, batch {args.batch} x {args.seq}")
        a.legend()
        names = list(results)
        b.bar(names, [results[n]["median_step_ms"] for n in names])
        b.set(ylabel="median step (ms)", title=device)
        for i, n in enumerate(names):
            b.text(i, results[n]["median_step_ms"], f"{results[n]['peak_gb_above_model']:.1f} GB", ha="center",
                   va="bottom")
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    except ImportError:
        pass

    print(f"\n{device}, batch {args.batch} x {args.seq}, vocab {args.vocab}, {args.layers} x {args.hidden}; "
          f"{stem}.json")
    print(f"{'variant':<14} {'step ms':>9} {'tokens/s':>10} {'peak GB':>8} {'loss diff':>10}")
    for name, r in results.items():
        diff = r.get("max_loss_diff_vs_unpatched")
        print(f"{name:<14} {r['median_step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} {r['peak_gb_above_model']:>8.2f} "
              f"{'' if diff is None else f'{diff:.4f}':>10}")
    for name, why in skipped.items():
        print(f"{name:<14} skipped: {why}")


if __name__ == "__main__":
    main()
