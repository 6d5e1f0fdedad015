"""The fused linear head on a GPU (marked ``gpu``: skipped without one), in chunks of rows (the last
one short), with a bias, ignored rows and a teacher: its loss, metric and the gradients of hidden,
weight and bias within bf16's rounding of the float64 reference, and a CUDA graph of its forward +
backward replays the same values. (Timings live in bench/, never in a test.)"""
from __future__ import annotations

import pytest
import torch

import losscodegen as lcg
from losscodegen.testing import compare, reference

pytestmark = pytest.mark.gpu
R, H, V, CHUNK = 1000, 256, 32000, 256     # 4 chunks, the last one short


def _case(name: str):
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()
    hidden, weight, bias = randn(R, H), randn(V, H, scale=H ** -0.5), randn(V, scale=0.5)
    labels = torch.randint(0, V, (R,), device="cuda", generator=g)
    labels[::7] = -100
    if name == "ce":
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2), metrics=(lcg.Entropy(),))
        inputs = {}
    else:
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),))
        inputs = dict(teacher_hidden=randn(R, 64), teacher_weight=randn(V, 64, scale=0.125))
    return head, hidden, weight, bias, labels, inputs


def _run(head, hidden, weight, bias, labels, inputs):
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    out = head.linear(h, w, labels, bias=b, chunk_rows=CHUNK, **inputs)
    out.loss.backward()
    return out.loss.detach(), out.metrics["entropy"], h.grad, w.grad, b.grad


@pytest.mark.parametrize("name", ["ce", "fkl"])
def test_chunks_against_the_float64_reference(name):
    head, hidden, weight, bias, labels, inputs = case = _case(name)
    got = _run(*case)
    h, w, b = hidden.double(), weight.double(), bias.double()
    ref_inputs = {}
    if "teacher_hidden" in inputs:
        ref_inputs["teacher_logits"] = inputs["teacher_hidden"].double() @ inputs["teacher_weight"].double().t()
    loss, values, dlogits = reference(head)(h @ w.t() + b, labels, **ref_inputs)
    compare("loss", got[0], loss, torch.bfloat16)
    compare("entropy", got[1], values["entropy"], torch.bfloat16)
    for mine, want in zip(got[2:], (dlogits @ w, dlogits.t() @ h, dlogits.sum(0))):
        compare("gradient", mine, want, torch.bfloat16)


def test_chunks_replay_in_a_cuda_graph():
    head, hidden, weight, bias, labels, inputs = _case("fkl")
    h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))

    def step():
        h.grad = w.grad = b.grad = None
        out = head.linear(h, w, labels, bias=b, chunk_rows=CHUNK, **inputs)
        out.loss.backward()
        return out.loss
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step().detach().clone()
        grads = [t.grad.clone() for t in (h, w, b)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, eager)
    for t, want in zip((h, w, b), grads):
        assert torch.equal(t.grad, want)
