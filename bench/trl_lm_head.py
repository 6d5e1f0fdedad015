"""TRL's fused LM head against losscodegen's drop-in (``losscodegen.integrations.trl.add_fused_lm_head``) on
a GPU: one Llama layer (bf16, hidden 2048) at vocabulary 128256, GRPO-shaped batches (the first half of
every row a prompt, unscored), ``outputs=("log_probs", "entropy")`` as GRPO asks; a forward and a
backward of ``log_probs.sum() + 0.1 * entropy.sum()``. Printed per batch: the median time of the
whole step (backbone included: the same for both), and the peak memory above the model's weights.

    python bench/trl_lm_head.py [--batch 4 8] [--seq 2048]
"""
from __future__ import annotations

import argparse

import torch
import triton


def build(vocab: int, hidden: int):
    import transformers
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                                      use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    from trl.trainer.utils import add_fused_lm_head as trl_add

    from losscodegen.integrations.trl import add_fused_lm_head as lcg_add
    print(f"{torch.cuda.get_device_name()}: 1 Llama layer, hidden {args.hidden}, vocab {args.vocab}, bf16, "
          f"seq {args.seq} (half prompt), log_probs + entropy, forward + backward")
    for batch in args.batch:
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, args.vocab, (batch, args.seq), device="cuda", generator=g)
        labels = ids.clone()
        labels[:, : args.seq // 2] = -100
        for name, add in (("TRL", trl_add), ("losscodegen", lcg_add)):
            model = build(args.vocab, args.hidden)
            add(model, outputs=("log_probs", "entropy"))

            def step():
                out = model(input_ids=ids, labels=labels, fused_lm_head=True)
                (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
                model.zero_grad(set_to_none=True)
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            ms = triton.testing.do_bench(step, warmup=5, rep=2000, return_mode="median")
            print(f"  batch {batch:2d} x {args.seq}  {name:12s} {ms:8.2f} ms  peak {peak:6.2f} GiB above the weights")
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
