"""Every benchmark head at a realistic size, 4096 x 128256 bf16 on the GPU, against the hand-written
float64 references (marked ``gpu``: skipped without one); and the heads whose plan states have a
register cap in a tile-table entry (the H200's, at 128256 and 262144) at 1024 x 262144."""
from __future__ import annotations

import pytest
import torch

import losscodegen as lcg
from helpers import check_head, policy_inputs, topk_inputs

pytestmark = pytest.mark.gpu
R, V = 4096, 128256

HEADS = {
    "CE": lambda: lcg.HeadLoss(lcg.CrossEntropy()),
    "CE+z+ent+acc": lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4),
                                         metrics=(lcg.Entropy(), lcg.TokenAccuracy())),
    "GRPO+ent+clip+ratio": lambda: lcg.HeadLoss(lcg.GRPO(), metrics=(lcg.Entropy(), lcg.ClipFraction(),
                                                                     lcg.RatioMean())),
    "CE+z+0.5FKL+ent": lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-4), lcg.ForwardKL(weight=0.5),
                                            metrics=(lcg.Entropy(),)),
    "JSD": lambda: lcg.HeadLoss(lcg.JSD()),
    "FKL": lambda: lcg.HeadLoss(lcg.ForwardKL()),
    "CE+topk": lambda: lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.5)),
    "GSPO": lambda: lcg.HeadLoss(lcg.GSPO()),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_parity_at_4096_x_128256_bf16(name, backend):
    # (``backend``: conftest's fixture, each backend in turn; --all-backends runs every head on both)
    _check(HEADS[name](), R, V)


@pytest.mark.parametrize("name", ["CE+z+ent+acc", "GRPO+ent+clip+ratio", "CE+z+0.5FKL+ent", "JSD", "FKL"])
def test_parity_at_1024_x_262144_bf16(name):
    _check(HEADS[name](), 1024, 262144)


def _check(head, R: int, V: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(R, V, generator=g) * 2).bfloat16().cuda()
    labels = torch.randint(0, V, (R,), generator=g)
    labels[::7] = -100
    k = head.kernel
    inputs = {}
    if k.USES_TEACHER:
        inputs["teacher_logits"] = (torch.randn(R, V, generator=g) * 2).bfloat16().cuda()
    if k.TOKENS:
        inputs.update(policy_inputs(logits.float().cpu(), labels, g))
        inputs = {n: inputs[n] for n in k.TOKENS}
    if k.USES_TOPK:
        inputs.update(topk_inputs(R, V, 32, g))
    if k.SEGMENTS:
        inputs.update(segment_ids=torch.arange(R) // 256, num_segments=R // 256)
    inputs = {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in inputs.items()}
    check_head(head, logits, labels.cuda(), **inputs)
