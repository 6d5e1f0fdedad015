"""The derivation alone: sympy's lowered program (accumulators, row values, gradient) evaluated in
float64 torch equals the reference formula and its torch.autograd gradient. No Triton involved."""
import pytest
import sympy as sp
import torch

import losscodegen as lcg
import reference
from losscodegen.emit import TorchPrinter

P = TorchPrinter()


def _eval(expr, ns):
    return eval(P.doprint(sp.sympify(expr)), {"torch": torch}, ns)


def evaluate(lowered, z, y, teacher=None, ids=None, lps=None, tokens=()):
    """Row values [R] and dL/dz [R, V] (weights 1) of a lowered head, in float64 torch."""
    R, V = z.shape
    ns = dict(tokens)
    m = z.max(-1, keepdim=True).values
    ns.update(z=z, m=m, z_y=z.gather(1, y[:, None]), zm=z - m, zym=z.gather(1, y[:, None]) - m,
              label=y[:, None].double(), argmax=z.argmax(-1, keepdim=True).double(),
              vocab_size=float(V), is_y=torch.nn.functional.one_hot(y, V).double())
    if teacher is not None:
        m_t = teacher.max(-1, keepdim=True).values
        ns.update(t=teacher, m_t=m_t, tm=teacher - m_t)
    if ids is not None:
        ns.update(z_k=z.gather(1, ids), zkm=z.gather(1, ids) - m, l_k=lps)
    for w in lowered.weights:
        ns[w.name] = 1.0
    for acc in (a for a in lowered.accumulators if a.online):
        e = acc.alpha * (sp.Symbol("z_k" if acc.domain == "topk" else "z", real=True) - sp.Symbol("m", real=True))
        if acc.domain == "vocab" and acc.beta != 0:
            e += acc.beta * (sp.Symbol("t", real=True) - sp.Symbol("m_t", real=True))
        body = _eval(sp.exp(e) * acc.body, ns)
        ns[acc.name] = torch.as_tensor(body).expand(R, -1).sum(-1, keepdim=True)
    for n in lowered.normalizers:
        ns[n.symbol.name] = _eval(n.value, ns)
        ns[n.log_acc.name] = torch.log(ns[n.acc])
    for acc in (a for a in lowered.accumulators if not a.online):
        ns[acc.name] = _eval(acc.body, ns).sum(-1, keepdim=True)
    values = {name: torch.as_tensor(_eval(e, ns)).expand(R, 1)[:, 0] for name, e in lowered.row_values}
    for s, e in lowered.grad_coefs:
        ns[s.name] = _eval(e, ns)
    grad = torch.as_tensor(_eval(lowered.grad_vocab, ns)).expand(R, V).clone()
    if lowered.grad_topk != 0:
        grad.scatter_add_(1, ids, torch.as_tensor(_eval(lowered.grad_topk, ns)).expand_as(lps))
    return values, grad


CASES = [
    (lcg.CrossEntropy(), {}), (lcg.CrossEntropy(label_smoothing=0.2), {}), (lcg.ZLoss(), {}),
    (lcg.Entropy(), {}), (lcg.ForwardKL(temperature=2.0), {"teacher": True}),
    (lcg.ReverseKL(temperature=0.5), {"teacher": True}), (lcg.JSD(beta=0.3, temperature=2.0), {"teacher": True}),
    (lcg.TopKForwardKL(temperature=2.0), {"topk": True}),
    (lcg.GRPO(eps_low=0.1, eps_high=0.3, kl_beta=0.04), {"policy": True}),
]


@pytest.mark.parametrize("term,needs", CASES, ids=[c[0].name + str(i) for i, c in enumerate(CASES)])
def test_derived_gradient_equals_autograd(term, needs):
    g = torch.Generator().manual_seed(1)
    R, V, K = 8, 64, 5
    x = (torch.randn(R, V, generator=g, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, V, (R,), generator=g)
    kw, inputs, tokens = {}, {}, {}
    if needs.get("teacher"):
        inputs["teacher"] = kw["teacher"] = torch.randn(R, V, generator=g, dtype=torch.float64)
    if needs.get("topk"):
        kw["ids"] = inputs["topk_ids"] = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R)])
        kw["lps"] = inputs["topk_logprobs"] = torch.log_softmax(torch.randn(R, K, generator=g, dtype=torch.float64), -1)
    if needs.get("policy"):
        l = torch.log_softmax(x.detach(), -1).gather(1, y[:, None])[:, 0]
        inputs.update(advantages=torch.randn(R, generator=g, dtype=torch.float64),
                      old_logprobs=l + 0.3 * torch.randn(R, generator=g, dtype=torch.float64),
                      ref_logprobs=l + 0.1 * torch.randn(R, generator=g, dtype=torch.float64))
        tokens = {f"tok_{k}": v[:, None] for k, v in inputs.items()}
    head = lcg.HeadLoss(term)
    # (runtime parameters are symbols of the lowered program, given their values as the kernel is)
    runtime = {k: float(v) for k, v in head.scalars.items() if not k.startswith("weight_")}
    values, grad = evaluate(head.lowered(), x.detach(), y, tokens={**tokens, **runtime}, **kw)
    ref = reference.PER_ROW[term.name](x, y=y, **inputs, **dict(term.params))
    torch.testing.assert_close(values[term.name], ref.detach(), rtol=1e-10, atol=1e-10)
    ref.sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-9, atol=1e-12)
