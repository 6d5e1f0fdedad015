"""TRL's SFT on the GPU: ``trl.SFTTrainer`` against ``losscodegen.integrations.trl.SFTTrainer``, a few
optimizer steps each, on the same small Llama (random init from a config, bf16) and the same data (an
in-memory ``datasets.Dataset`` of random token ids, pre-tokenized: no tokenizer download; a word-level
tokenizer built here gives TRL its pad and eos tokens). Variants:

- ``trl``: ``trl.SFTTrainer`` on the plain model (TRL's fused LM head, cross-entropy);
- ``losscodegen``: our ``SFTTrainer`` on the plain model (TRL's SFT loss on losscodegen's fused head);
- ``losscodegen+``: our ``SFTTrainer`` on ``apply_losscodegen(model, HeadLoss(CrossEntropy(), ZLoss(1e-4),
  metrics=(Entropy(), TokenAccuracy())))``, whose objective is CE + 1e-4 z (``trl.SFTTrainer`` refuses it).

Checked: each trainer's first logged loss (step 1, batches in the dataset's order) against its objective
(CE, or CE + 1e-4 * logsumexp**2) in float64 from the same model's logits on that batch, before training,
within ``--loss-rtol`` (bf16 logits); the step's logged terms and metrics (``cross_entropy`` and ``z_loss``
of ``losscodegen+``'s head, ``entropy`` and ``token_accuracy``: TRL's ``mean_token_accuracy`` for the others)
against their float64 values within ``--terms-rtol``, and that each is in ``trainer.state.log_history``.
Recorded: the median optimizer step (after ``--warmup`` steps, the device synchronized around it), tokens/s,
the peak memory during training (and above the weights), the first and last log entries. Written to
``OUT/<device>-trl-sft-b<B>.json`` (``--out``, default ``$OUT`` where set, else docs/perf); a short table of
the timings and the logged terms is printed last. Exits 1 if a check fails or an expected log key is missing
(after writing the record).

    python bench/trl_sft.py                                 # 12 steps, batch 2 x 2048; to $OUT or docs/perf
    python bench/trl_sft.py --cpu --tiny --out /tmp/sft     # end to end on the CPU (Triton's interpreter)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

if "--cpu" in sys.argv:   # (Triton reads the switch when it is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from training_step import Z_WEIGHT, default_out, device_name, shifted_ce_z_float64, sync  # noqa: E402

VARIANTS = ("trl", "losscodegen", "losscodegen+")
# the log keys each variant must have in log_history (a key matches a name it ends with: mean_token_accuracy)
LOGGED = {"trl": ("entropy", "token_accuracy"), "losscodegen": ("entropy", "token_accuracy"),
          "losscodegen+": ("cross_entropy", "z_loss", "entropy", "token_accuracy")}
# the logged values compared with float64 on step 1's batch: (log key, shifted_ce_z_float64's name)
TERMS = (("cross_entropy", "cross_entropy"), ("z_loss", "z"), ("entropy", "entropy"), ("token_accuracy", "accuracy"))
TINY = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, seq=64, steps=3, warmup=1)


def build(args):
    import transformers
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.seq, use_cache=False,
        pad_token_id=0, eos_token_id=2, bos_token_id=3)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def tokenizer():
    """A word-level tokenizer built here (no hub): TRL reads its pad and eos tokens; the data is token ids."""
    import tokenizers
    import transformers
    words = {"<pad>": 0, "<unk>": 1, "<eos>": 2, "<bos>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<bos>", unk_token="<unk>")


def dataset(args):
    import datasets
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, args.vocab, (args.steps * args.batch, args.seq), generator=g)   # (0-3: special tokens)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def step_clock(device: str):
    import transformers

    class StepClock(transformers.TrainerCallback):
        """Each optimizer step's wall time (the device synchronized around it) and the peak memory."""

        def __init__(self):
            self.times, self.base, self.peak = [], 0, None

        def on_train_begin(self, args, state, control, **kwargs):
            sync(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                self.base = torch.cuda.memory_allocated()

        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            self.times.append(time.perf_counter() - self.t0)

        def on_train_end(self, args, state, control, **kwargs):
            if device == "cuda":
                self.peak = torch.cuda.max_memory_allocated()

    return StepClock()


def trainer_for(variant, args, out_dir):
    import trl
    model = build(args)
    cls = trl.SFTTrainer
    if variant != "trl":
        import losscodegen.integrations.trl as lcg_trl
        cls = lcg_trl.SFTTrainer
    if variant == "losscodegen+":
        import losscodegen as lcg
        from losscodegen.integrations.transformers import apply_losscodegen
        apply_losscodegen(model, lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=Z_WEIGHT),
                                              metrics=(lcg.Entropy(), lcg.TokenAccuracy())))
    config = trl.SFTConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to="none",
        bf16=True, use_cpu=args.device == "cpu", max_length=args.seq, gradient_checkpointing=True, disable_tqdm=True,
        seed=0)
    clock = step_clock(args.device)
    trainer = cls(model=model, args=config, processing_class=tokenizer(), train_dataset=dataset(args),
                  callbacks=[clock])
    # the dataset's order, so that the batch checked below is step 1's
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    return trainer, clock


def reference(trainer, args) -> dict[str, float]:
    """Step 1's batch through the trainer's own model, in float64 from its logits (before training)."""
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"].to(args.device),
                       attention_mask=batch["attention_mask"].to(args.device)).logits
    labels = batch.get("labels", batch["input_ids"])
    values = shifted_ce_z_float64(logits, labels)
    del logits
    return values


def logged(history: list[dict], name: str) -> tuple[str, float] | None:
    """The first log entry's key ``name`` (else one ending in it: TRL's ``mean_token_accuracy``), and its value."""
    if not history:
        return None
    first = history[0]
    return (name, first[name]) if name in first else next(((k, v) for k, v in first.items() if k.endswith(name)), None)


def run(variant, args):
    with tempfile.TemporaryDirectory(prefix="lcg-trl-sft-") as out_dir:
        trainer, clock = trainer_for(variant, args, out_dir)
        ref = reference(trainer, args)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    weight = Z_WEIGHT if variant == "losscodegen+" else 0.0
    expected = ref["cross_entropy"] + weight * ref["z"]
    first = history[0]["loss"]
    missing = [name for name in LOGGED[variant] if logged(history, name) is None]
    step = statistics.median(clock.times[args.warmup:])
    result = dict(
        median_step_ms=step * 1e3, tokens_per_s=args.batch * args.seq / step, step_ms=[t * 1e3 for t in clock.times],
        peak_gb=None if clock.peak is None else clock.peak / 1e9,
        peak_gb_above_model=None if clock.peak is None else (clock.peak - clock.base) / 1e9,
        first_loss=first, expected_first_loss=expected, z_weight=weight, reference_float64=ref,
        loss_check=dict(ok=abs(first - expected) <= args.loss_rtol * max(1.0, abs(expected)), diff=first - expected,
                        rtol=args.loss_rtol),
        logged_vs_float64=(compared := {
            name: dict(key=found[0], logged=found[1], float64=ref[ref_name],
                       ok=abs(found[1] - ref[ref_name]) <= args.terms_rtol * max(1.0, abs(ref[ref_name])))
            for name, ref_name in TERMS if (found := logged(history, name)) is not None}),
        terms_check=dict(ok=all(c["ok"] for name, c in compared.items() if name in LOGGED[variant]),
                         rtol=args.terms_rtol),
        missing_logs=missing, first_log=history[0], last_log=history[-1],
        losses=[h["loss"] for h in history])
    del trainer
    gc.collect()   # (a patched model refers to itself through its bound forward)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default_out(), help="where the record goes (default: $OUT if set, else docs/perf)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--loss-rtol", type=float, default=1e-4,
                    help="the first-step loss check's tolerance, relative to the loss (at least 1)")
    ap.add_argument("--terms-rtol", type=float, default=1e-3,
                    help="the logged terms' and metrics' tolerance against float64, relative (at least 1): bf16 logits")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, among {', '.join(VARIANTS)}")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (losscodegen's kernels in Triton's interpreter)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and 3 steps, where not given (with --cpu: a check that it runs)")
    args = ap.parse_args()
    if args.tiny:   # (the options given keep their values)
        vars(args).update({k: v for k, v in TINY.items() if getattr(args, k) == ap.get_default(k)})
    args.device = "cpu" if args.cpu else "cuda"
    if args.steps <= args.warmup:
        ap.error("--steps must be more than --warmup")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")

    import transformers
    import trl

    import losscodegen
    results = {}
    for variant in variants:
        results[variant] = r = run(variant, args)
        print(f"{variant}: {r['median_step_ms']:.1f} ms, first loss {r['first_loss']:.5f} (float64 "
              f"{r['expected_first_loss']:.5f}), log keys {sorted(r['first_log'])}", flush=True)

    device = device_name(args.device)
    record = dict(device=device, torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
                  losscodegen=losscodegen.__version__, args=vars(args), results=results,
                  note="median optimizer step after the warm-up steps (device synchronized); peak memory allocated "
                       "during training (above the bf16 weights: gradients, AdamW states, activations); first_loss: "
                       "the first log entry's loss, against its objective in float64 from the model's logits on "
                       "the same batch before training")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{device.replace(' ', '-')}-trl-sft-b{args.batch}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)

    print(f"\n{device}, llama {args.layers} x {args.hidden}, batch {args.batch} x {args.seq}, vocab {args.vocab}, "
          f"{args.steps} steps; {path}")
    print("step 1's logged terms and metrics (float64 on its batch in brackets); '-': not logged")
    print(f"{'variant':<13} {'step ms':>8} {'tokens/s':>9} {'peak GB':>8} {'1st loss':>9} {'diff f64':>9} {'check':>6} "
          + " ".join(f"{name:>22}" for name, _ in TERMS))
    failed = []
    for name, r in results.items():
        ok = r["loss_check"]["ok"] and r["terms_check"]["ok"] and not r["missing_logs"]
        failed += [] if ok else [name]
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
        cells = []
        for term, _ in TERMS:
            c = r["logged_vs_float64"].get(term)
            cell = ("missing" if term in r["missing_logs"] else "-") if c is None else \
                f"{c['logged']:.4f} ({c['float64']:.4f}){'' if c['ok'] else '!'}"
            cells.append(f"{cell:>22}")
        print(f"{name:<13} {r['median_step_ms']:>8.1f} {r['tokens_per_s']:>9.0f} {peak:>8} {r['first_loss']:>9.4f} "
              f"{r['loss_check']['diff']:>9.1e} {'ok' if ok else 'FAIL':>6} " + " ".join(cells))
    if failed:
        sys.exit("failed: " + "; ".join(
            f"{n} (loss check {'ok' if results[n]['loss_check']['ok'] else 'FAILED'}"
            + ("" if results[n]["terms_check"]["ok"] else ", a logged term off float64 (marked !)")
            + (f", missing from log_history: {', '.join(results[n]['missing_logs'])}" if results[n]['missing_logs'] else "")
            + ")" for n in failed))


if __name__ == "__main__":
    main()
