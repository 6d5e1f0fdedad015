"""A real training step on the GPU: a transformers causal LM (random init, bf16 weights, AdamW, gradient
checkpointing) trained for a few dozen steps, one process, four ways on the same batches:

- ``unpatched``: transformers' own forward and loss ([batch, seq, vocab] logits, upcast to fp32);
- ``liger``: Liger's ``apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True)``, only the loss
  patched (skipped, with the reason, when liger_kernel is not importable or has no patch for the model);
- ``losscodegen``: ``apply_losscodegen(model)`` (CE through ``head.linear``);
- ``losscodegen+``: ``apply_losscodegen`` with CE + z-loss and entropy and accuracy metrics.

``--model``: ``llama`` (16 x 2048, the default), or a small mixture of experts, ``mixtral`` or
``qwen3_moe`` (4 layers x 2048, 8 experts of width 4096, top 2, ``output_router_logits=True``: the
router's load-balancing loss is part of the objective).

Before timing, each patched variant's loss on the first batch is checked against the unpatched loss of
the same model (same weights, same batch; ``losscodegen+``: plus 1e-4 times the z-loss, in float64
from the unpatched logits), within ``--loss-rtol``; for a mixture of experts also with the model's
``router_aux_loss_coef`` set to 1, so that the router loss (about 2 then) is far above the tolerance
and a patch that dropped it would fail. A variant that fails is not timed, and the script exits 1.

Every variant runs ``--rounds`` times (default 2), each round in the reverse order of the one before:
the machine drifts between runs by as much as the differences sought. Recorded per variant: the median
step time (after each run's warm-up steps, over every round), tokens/s, the peak memory above the
model's weights (gradients, optimizer states and activations included), the check, and the loss curve
(for the z-loss variant its CE term). ``--model`` and ``--batch`` take comma-separated lists (default: llama,
batch sizes 1 and 4): one record per model and batch size, ``OUT/<device>-hf-training-step[-<model>]-b<B>.json``
(``--out``, default ``$OUT`` where set, else docs/perf; and a plot with matplotlib); a short table of every
run is printed last.

    python bench/training_step.py                          # llama, batch 1 and 4, 30 steps; to $OUT or docs/perf
    python bench/training_step.py --model qwen3_moe        # a mixture of experts (or --model llama,mixtral,...)
    python bench/training_step.py --cpu --tiny --out /tmp/ts      # end to end on the CPU (Triton's interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--cpu" in sys.argv:   # (Triton reads the switch when it is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

VARIANTS = ("unpatched", "liger", "losscodegen", "losscodegen+")
MODELS = ("llama", "mixtral", "qwen3_moe")
Z_WEIGHT = 1e-4
# per model: (layers, the MLP's width: each expert's for a mixture of experts)
SIZES = {"llama": (16, 8192), "mixtral": (4, 4096), "qwen3_moe": (4, 4096)}
TINY = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, experts=4, seq=64, steps=3, warmup=1,
            rounds=1)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def shifted_ce_z_float64(logits: torch.Tensor, labels: torch.Tensor, rows: int = 1024) -> dict[str, float]:
    """Per-token means over the positions whose next label is not -100, in float64 from the model's logits
    ``[B, T, V]``: cross-entropy, z (``logsumexp**2``), entropy and top-1 accuracy (a chunk of rows at a time)."""
    x, y = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    sums, n = dict(cross_entropy=0.0, z=0.0, entropy=0.0, accuracy=0.0), 0
    for i in range(0, x.shape[0], rows):
        yi = y[i:i + rows].to(x.device)
        keep = yi != -100
        xi, yi = x[i:i + rows][keep].double(), yi[keep]
        lse = xi.logsumexp(-1)
        logp = xi - lse[:, None]
        sums["cross_entropy"] += (lse - xi.gather(-1, yi[:, None])[:, 0]).sum().item()
        sums["z"] += lse.square().sum().item()
        sums["entropy"] += -(logp.exp() * logp).sum().item()
        sums["accuracy"] += (xi.argmax(-1) == yi).sum().item()
        n += int(keep.sum())
    return {k: v / max(n, 1) for k, v in sums.items()}


def build(args):
    import transformers
    extra = dict(intermediate_size=args.intermediate)
    if args.model == "mixtral":
        extra.update(num_local_experts=args.experts, num_experts_per_tok=args.top_k, output_router_logits=True)
    elif args.model == "qwen3_moe":
        extra.update(moe_intermediate_size=args.intermediate, num_experts=args.experts, num_experts_per_tok=args.top_k,
                     output_router_logits=True)
    config = transformers.AutoConfig.for_model(
        args.model, vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.seq, tie_word_embeddings=args.tie, use_cache=False, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def liger_patch(model_type: str):
    """Liger's patch for ``model_type``, or the reason there is none (a string)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        return f"liger_kernel not importable ({e})"
    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if patch is None:
        return f"liger_kernel {getattr(liger, '__version__', '')} has no apply_liger_kernel_to_{model_type}".replace("  ", " ")
    return patch


def patch(model, variant, args):
    """The variant's patch; returns how to read the step's loss without the z-loss term from its output
    (None: the output's loss)."""
    if variant == "liger":
        import inspect
        apply = liger_patch(args.model)
        # only the loss: every other kernel switch of this model's patch off
        off = {name: False for name, p in inspect.signature(apply).parameters.items() if isinstance(p.default, bool)}
        apply(**{**off, "fused_linear_cross_entropy": True}, model=model)
    elif variant.startswith("losscodegen"):
        import losscodegen as lcg
        from losscodegen.integrations.transformers import apply_losscodegen
        head = None
        if variant == "losscodegen+":
            head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=Z_WEIGHT),
                                metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
        apply_losscodegen(model, head)
        if head is not None:
            return lambda out: out.loss - Z_WEIGHT * model.losscodegen.terms["z_loss"]
    return None


def batches(args):
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        yield ids.to(args.device, non_blocking=True)


def losses_at(model, ids, coefs, *, z: bool = False) -> tuple[list[float], float | None]:
    """The model's training-mode loss on ``ids`` at each router loss coefficient (None: a dense model), and,
    with ``z``, the float64 z-loss of its logits at the first."""
    values, z_value = [], None
    with torch.no_grad():
        for coef in coefs:
            if coef is not None:
                model.router_aux_loss_coef = coef
            out = model(input_ids=ids, labels=ids)
            values.append(out.loss.double().item())
            if z and z_value is None:
                z_value = shifted_ce_z_float64(out.logits, ids)["z"]
            del out
    return values, z_value


def check(model, variant, args, ids):
    """Patch ``model`` and compare its loss on ``ids`` with the unpatched one's (module docstring)."""
    own = getattr(model, "router_aux_loss_coef", None)
    coefs = [own] if own is None else [own, 1.0]
    want, z = losses_at(model, ids, coefs, z=variant == "losscodegen+")
    ce_of = patch(model, variant, args)
    got, _ = losses_at(model, ids, coefs)
    if own is not None:
        model.router_aux_loss_coef = own
    rows = []
    for coef, w, g in zip(coefs, want, got):
        expected = w + (Z_WEIGHT * z if z is not None else 0.0)
        rows.append(dict(router_aux_loss_coef=coef, unpatched=w, expected=expected, patched=g, diff=g - expected,
                         ok=abs(g - expected) <= args.loss_rtol * max(1.0, abs(expected))))
    return ce_of, dict(ok=all(r["ok"] for r in rows), rtol=args.loss_rtol,
                       z_loss_float64=z, rows=rows)


def run(variant, args):
    model = build(args)
    cls_forward = type(model).forward   # (Liger's older patches replace the class's forward: put back after)
    try:
        ce_of, checked = (None, None) if variant == "unpatched" else check(model, variant, args, next(batches(args)))
        if checked is not None and not checked["ok"]:
            return dict(loss_check=checked)
        return dict(timed(model, ce_of, args), loss_check=checked)
    finally:
        type(model).forward = cls_forward


def timed(model, ce_of, args):
    cuda = args.device == "cuda"
    sync(args.device)
    base = torch.cuda.memory_allocated() if cuda else 0
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in batches(args):
        sync(args.device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        times.append(time.perf_counter() - t0)
        losses.append((ce_of(out) if ce_of is not None else out.loss).item())
        del out
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if cuda else None
    return dict(peak_gb_above_model=peak, losses=losses, step_ms=[t * 1e3 for t in times])


def pooled(rounds: list[dict], args) -> dict:
    """A variant's record from its rounds: the median of every round's steps after its warm-up, the
    largest peak, the first round's losses and loss check, each round's step times."""
    steps = [t for r in rounds for t in r["step_ms"][args.warmup:]]
    step = statistics.median(steps) / 1e3
    peaks = [r["peak_gb_above_model"] for r in rounds if r["peak_gb_above_model"] is not None]
    return dict(rounds[0], median_step_ms=step * 1e3, tokens_per_s=args.batch * args.seq / step,
                peak_gb_above_model=max(peaks) if peaks else None, step_ms=[r["step_ms"] for r in rounds])


def default_out() -> str:
    """``$OUT`` where it is set (the GPU machine's folder that comes back), else docs/perf."""
    return os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf")


def listed(kind, choices=None):
    """An argparse type: a comma-separated list of ``kind`` (among ``choices``)."""
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v]
        bad = [v for v in values if choices is not None and v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list" +
                                             (f" among {', '.join(map(str, choices))}" if choices else ""))
        return values
    return parse


def bench(args, variants) -> tuple[dict, str]:
    """Every variant on one model and batch size; the record, written to ``args.out``, and its path's stem."""
    import gc

    import transformers

    import losscodegen
    rounds, failed, skipped = {}, {}, {}
    for n in range(args.rounds):
        # (the machine drifts between runs by as much as the differences sought: each round runs the
        # variants in the reverse order of the one before, and a variant's median pools its rounds)
        for variant in variants if n % 2 == 0 else variants[::-1]:
            if variant in skipped or variant in failed:
                continue
            if variant == "liger" and isinstance(liger_patch(args.model), str):
                skipped[variant] = liger_patch(args.model)
                continue
            try:
                r = run(variant, args)
            except Exception as e:   # (Liger's patch against this transformers: recorded, the others still run)
                if variant != "liger":
                    raise
                skipped[variant] = f"failed: {type(e).__name__}: {e}"
                continue
            gc.collect()   # (a patched model refers to itself through its bound forward)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if "step_ms" not in r:
                print(f"{args.model} b{args.batch} {variant}: loss check FAILED, not timed: {r['loss_check']['rows']}",
                      flush=True)
                failed[variant] = r
                continue
            rounds.setdefault(variant, []).append(r)
    results = {v: pooled(rounds[v], args) if v in rounds else failed[v] for v in variants if v in rounds or v in failed}
    for variant, r in results.items():
        if "median_step_ms" in r:
            peak = "-" if r["peak_gb_above_model"] is None else f"{r['peak_gb_above_model']:.2f} GB"
            print(f"{args.model} b{args.batch} {variant}: {r['median_step_ms']:.1f} ms, {peak}, loss "
                  f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)

    ref = results.get("unpatched")
    for r in results.values():
        if ref is not None and "losses" in r:
            r["max_loss_diff_vs_unpatched"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    device = device_name(args.device)
    record = dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
                  losscodegen=losscodegen.__version__, args=vars(args), skipped=skipped, results=results,
                  note="median step after the warm-up steps, over every round; peak memory above the bf16 weights (gradients, "
                       "AdamW states, activations); losses: each step's loss (the z-loss variant's less its z-loss "
                       "term: CE, plus the router loss for a mixture of experts); loss_check: the first batch's loss "
                       "against the unpatched model's, before training")
    os.makedirs(args.out, exist_ok=True)
    model_part = "" if args.model == "llama" else f"-{args.model}"
    stem = os.path.join(args.out, f"{device.replace(' ', '-')}-hf-training-step{model_part}-b{args.batch}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    plot(record, stem, args)
    return record, stem


def plot(record, stem, args) -> None:
    timed_results = {n: r for n, r in record["results"].items() if "median_step_ms" in r}
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in timed_results.items():
        a.plot(r["losses"], label=name)
    a.set(xlabel="step", ylabel="loss", title=f"{args.model}, batch {args.batch} x {args.seq}")
    a.legend()
    names = list(timed_results)
    b.bar(names, [timed_results[n]["median_step_ms"] for n in names])
    b.set(ylabel="median step (ms)", title=record["device"])
    for i, n in enumerate(names):
        peak = timed_results[n]["peak_gb_above_model"]
        b.text(i, timed_results[n]["median_step_ms"], "" if peak is None else f"{peak:.1f} GB", ha="center",
               va="bottom")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)


def table(runs) -> list[str]:
    """The short table printed last: one row per model, batch size and variant; the variants that failed."""
    failed = []
    for args, record, stem in runs:
        moe = "" if args.model == "llama" else f", {args.experts} experts top {args.top_k}"
        print(f"\n{record['device']}, {args.model}, batch {args.batch} x {args.seq}, vocab {args.vocab}, "
              f"{args.layers} x {args.hidden}{moe}; {stem}.json")
        print(f"{'variant':<14} {'step ms':>9} {'tokens/s':>10} {'peak GB':>8} {'loss diff':>10} {'check (max diff)':>18}")
        for name, r in record["results"].items():
            c = r.get("loss_check")
            verdict = "" if c is None else f"{'ok' if c['ok'] else 'FAILED'} ({max(abs(x['diff']) for x in c['rows']):.1e})"
            if c is not None and not c["ok"]:
                failed.append(f"{args.model} b{args.batch} {name}")
                print(f"{name:<14} {'not timed':>9} {'':>10} {'':>8} {'':>10} {verdict:>18}")
                continue
            diff, peak = r.get("max_loss_diff_vs_unpatched"), r["peak_gb_above_model"]
            print(f"{name:<14} {r['median_step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} "
                  f"{'-' if peak is None else f'{peak:.2f}':>8} {'' if diff is None else f'{diff:.4f}':>10} {verdict:>18}")
        for name, why in record["skipped"].items():
            print(f"{name:<14} skipped: {why}")
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default_out(), help="where the records go (default: $OUT if set, else docs/perf)")
    ap.add_argument("--model", type=listed(str, MODELS), default=["llama"],
                    help=f"comma-separated, among {', '.join(MODELS)} (default: llama)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the median")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of every variant, each round in the reverse order of the one before (default: 2)")
    ap.add_argument("--batch", type=listed(int), default=[1, 4], help="batch sizes, comma-separated (default: 1,4)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary size")
    ap.add_argument("--layers", type=int, default=None, help="default: 16 for llama, 4 for a mixture of experts")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size")
    ap.add_argument("--intermediate", type=int, default=None,
                    help="the MLP's width, each expert's for a mixture of experts (default: 8192 for llama, 4096)")
    ap.add_argument("--heads", type=int, default=32, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="key-value heads")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (mixtral, qwen3_moe)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (mixtral, qwen3_moe)")
    ap.add_argument("--tie", action="store_true", help="tie the embeddings and the output layer")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    ap.add_argument("--loss-rtol", type=float, default=1e-4,
                    help="the loss check's tolerance, relative to the loss (at least 1): bf16 rounding of the logits")
    ap.add_argument("--variants", type=listed(str, VARIANTS), default=list(VARIANTS),
                    help=f"comma-separated, among {', '.join(VARIANTS)} (liger is skipped where not importable)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (losscodegen's kernels in Triton's interpreter)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and 3 steps, where not given (with --cpu: a check that it runs)")
    args = ap.parse_args()
    if args.tiny:   # (the options given keep their values)
        vars(args).update({k: v for k, v in TINY.items() if getattr(args, k) == ap.get_default(k)})
    args.device = "cpu" if args.cpu else "cuda"
    if args.steps <= args.warmup:
        ap.error("--steps must be more than --warmup")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    runs = []
    for model in args.model:
        for batch in args.batch:
            one = argparse.Namespace(**{**vars(args), "model": model, "batch": batch})
            layers, intermediate = SIZES[model]
            one.layers = layers if args.layers is None else args.layers
            one.intermediate = intermediate if args.intermediate is None else args.intermediate
            record, stem = bench(one, args.variants)
            runs.append((one, record, stem))
    failed = table(runs)
    if failed:
        sys.exit(f"loss check failed: {', '.join(failed)} (see the records)")


if __name__ == "__main__":
    main()
