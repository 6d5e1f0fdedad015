"""Vocab-parallel on GPUs (not collected by pytest): `torchrun --nproc_per_node 2 tests/gpu_tp.py`.
Each rank's loss, terms, metrics and gradient shard vs the unsharded call; then fwd+bwd timings."""
import os

import torch
import torch.distributed as dist
import triton

import losscodegen as lcg

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
R, V = 4096, 128256
g = torch.Generator(device="cuda").manual_seed(0)
x = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
t = (torch.randn(R, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
y = torch.randint(0, V, (R,), device="cuda", generator=g)
y[::7] = -100
cols = slice(rank * V // world, (rank + 1) * V // world)
heads = {"CE+z+entropy+acc": lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                          metrics=(lcg.Entropy(), lcg.TokenAccuracy())),
         "CE+0.5FKL": lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5)),
         "JSD": lcg.HeadLoss(lcg.JSD())}
for name, head in heads.items():
    xs = x[:, cols].contiguous().requires_grad_()
    ts = t[:, cols].contiguous()
    out = head(xs, y, teacher_logits=ts, process_group=dist.group.WORLD)
    out.loss.backward()
    xf = x.clone().requires_grad_()
    ref = head(xf, y, teacher_logits=t)
    ref.loss.backward()
    vals = {k: (v.item(), {**ref.terms, **ref.metrics}[k].item()) for k, v in {**out.terms, **out.metrics}.items()}
    gerr = ((xs.grad.float() - xf.grad[:, cols].float()).norm() / xf.grad[:, cols].float().norm()).item()

    def sharded():
        xs.grad = None
        head(xs, y, teacher_logits=ts, process_group=dist.group.WORLD).loss.backward()

    def single():
        xf.grad = None
        head(xf, y, teacher_logits=t).loss.backward()
    ms_sharded = triton.testing.do_bench(sharded, warmup=25, rep=200, return_mode="median")
    ms_single = triton.testing.do_bench(single, warmup=25, rep=200, return_mode="median")
    if rank == 0:
        print(f"{name:18s} loss {out.loss.item():.6f} vs {ref.loss.item():.6f}  grad rel err {gerr:.1e}  "
              f"{world} ranks {ms_sharded:.3f} ms  1 rank {ms_single:.3f} ms  values {vals}", flush=True)
dist.destroy_process_group()
