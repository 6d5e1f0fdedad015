"""The heads of ``losscodegen.integrations.trl.GRPOTrainer`` through ``head.linear`` (forward +
backward, bf16, on the GPU), one JSON line each: what the token level's ``reduction="none"`` (the rows
TRL's per-sequence clip ratios come from) costs against the same head reduced, and what GSPO's and
VESPO's segment terms cost. Both ``reduction="none"`` and segment terms make each chunk's logits twice.

    python bench/trl_heads.py --rows 8192 --hidden 2048 --vocab 151936
"""
from __future__ import annotations

import argparse
import math
import json

import torch
import triton

from losscodegen.integrations.trl import _head


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--device", default="cuda", help="cpu: one step each under Triton's interpreter, untimed")
    args = p.parse_args()
    R, H, V, B = args.rows, args.hidden, args.vocab, args.sequences
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(R, H, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device=dev, generator=g, dtype=torch.bfloat16) / H ** 0.5).requires_grad_()
    labels = torch.randint(0, V, (R,), device=dev, generator=g)
    seq = torch.arange(R, device=dev) * B // R
    adv = torch.randn(B, device=dev, generator=g)[seq]
    tokens = dict(advantages=adv, old_logprobs=-torch.rand(R, device=dev, generator=g) * 5,
                  w_pol=torch.full((R,), 1.0 / R, device=dev), seq_len=torch.full((R,), float(R // B), device=dev),
                  w_ent=torch.full((R,), -1e-3 / R, device=dev), log_is=torch.zeros(R, device=dev))
    segments = dict(segment_ids=seq, num_segments=B)
    params = dict(eps_low=0.2, eps_high=0.28, delta=math.inf, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    cases = [("dapo token level, reduction='none' (the trainer's call)", "dapo", False, dict(reduction="none")),
             ("dapo token level, reduction='sum' (no per-sequence clip ratios)", "dapo", False, dict(reduction="sum")),
             ("GSPO grpo (segment terms, reduction='sum')", "grpo", True, dict(reduction="sum", **segments)),
             ("vespo (segment terms, reduction='sum')", "vespo", False, dict(reduction="sum", **segments))]
    for label, loss_type, sequence, call in cases:
        head = _head(loss_type=loss_type, sequence=sequence, old_given=True, off_policy=False, sampling_given=False,
                     beta=False, bias_corrected=False, entropy=True, params=params, softcap=None,
                     logit_scale=1.0)
        inputs = {k: v for k, v in tokens.items() if k in ("advantages", "old_logprobs", *head.kernel.TOKENS)}

        def step():
            hidden.grad = weight.grad = None
            out = head.linear(hidden, weight, labels, **inputs, **call)
            (out.loss.sum() if call["reduction"] == "none" else out.loss).backward()
        if dev.type == "cuda":
            ms = round(triton.testing.do_bench(step, warmup=10, rep=200, return_mode="median"), 3)
            name = torch.cuda.get_device_name()
        else:
            step()
            ms, name = None, "cpu"
        print(json.dumps(dict(case=label, shape=f"{R}x{H}x{V}", ms=ms, device=name)), flush=True)


if __name__ == "__main__":
    main()
