"""Fused linear heads: head.linear(hidden, weight, ...) against a float64 autograd reference of the
unfused formula (logits = hidden @ weight.T + bias, then the head's reference), for the gradients of
hidden, weight and bias; chunkings, bias, 3-D hidden, reduction="none", segments, vocab-parallel."""
import os

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from helpers import both_backends, policy_inputs, run_backward, run_ranks, spec, topk_inputs
from reference import head_reference
import reference as R

# the tests on one process run on both backends (conftest's ``backend``: the heads built with backend="auto")
BOTH = pytest.mark.usefixtures("backend")

H, V = 16, 72


def _case(name, R=13, dtype=torch.float32, shape=None):
    """(head, hidden, weight, bias, labels, inputs) with ignored rows and every input the head reads."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(R, H, generator=g)).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (R,), generator=g)
    labels[[1, 7]] = -100
    inputs = {}
    if name == "ce":
        head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                            metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    elif name == "fkl":
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5, temperature=2.0),
                            metrics=(lcg.Entropy(),))
        inputs = dict(teacher_hidden=torch.randn(R, 8, generator=g).to(dtype),
                      teacher_weight=torch.randn(V, 8, generator=g).to(dtype),
                      teacher_bias=torch.randn(V, generator=g).to(dtype))
    elif name == "grpo":
        head = lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.ClipFraction(), lcg.Entropy()))
        inputs = policy_inputs(hidden.double() @ weight.double().t() + bias.double(), labels, g, spread=0.2)
    elif name == "topk":
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.TopKForwardKL(weight=0.3))
        inputs = topk_inputs(R, V, 5, g)
    else:  # segments
        head = lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1))
        inputs = policy_inputs(hidden.double() @ weight.double().t() + bias.double(), labels, g, spread=1e-3)
        inputs.update(segment_ids=torch.arange(R) // 4, num_segments=(R + 3) // 4)
    if shape is not None:
        hidden, labels = hidden.reshape(*shape, H), labels.reshape(shape)
        inputs = {k: (v.reshape(*shape, *v.shape[1:]) if isinstance(v, torch.Tensor) and v.shape[0] == R
                      and k not in ("teacher_weight", "teacher_bias") else v) for k, v in inputs.items()}
    return head, hidden, weight, bias, labels, inputs


def _reference(head, hidden, weight, bias, labels, inputs):
    """The unfused head in float64: its loss, values and the gradients of hidden, weight and bias."""
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    b = bias.double().requires_grad_() if bias is not None else None
    logits = h @ w.t() + (b if b is not None else 0)
    kw = {k: v for k, v in inputs.items()
          if k not in ("teacher_hidden", "teacher_weight", "teacher_bias", "num_segments")}
    if "teacher_hidden" in inputs:
        kw["teacher_logits"] = (inputs["teacher_hidden"].double() @ inputs["teacher_weight"].double().t()
                                + inputs["teacher_bias"].double())
    loss, values, _ = head_reference([spec(t, head) for t in head.loss_terms],
                                     [spec(t, head) for t in head.metric_terms], logits, labels,
                                     ignore_index=head.ignore_index, **kw)
    return loss, values, h.grad, w.grad, None if b is None else b.grad


def _check(head, hidden, weight, bias, labels, inputs, *, chunk_rows=None, reduction="mean"):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    out = head.linear(h, w, labels, bias=b, chunk_rows=chunk_rows, reduction=reduction, **inputs)
    out.loss.sum().backward()
    ref_loss, ref_values, ref_h, ref_w, ref_b = _reference(head, hidden, weight, bias, labels,
                                                           dict(inputs, reduction=reduction))
    fp32 = hidden.dtype == torch.float32
    value_tol, grad_tol = (1e-5, 2e-4) if fp32 else (1e-2, 3e-2)   # bf16: the logits are rounded
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=value_tol, atol=value_tol)
    for name, value in {**out.terms, **out.metrics}.items():
        torch.testing.assert_close(value.double(), ref_values[name], rtol=value_tol, atol=value_tol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    grads = (("hidden", h.grad, ref_h), ("weight", w.grad, ref_w), ("bias", None if b is None else b.grad, ref_b))
    for name, got, want in grads:
        if want is None:
            continue
        assert got.dtype == hidden.dtype and got.shape == want.shape, name
        err = (got.double() - want).abs().max().item()
        assert err <= grad_tol * want.abs().max().item() + 1e-9, f"grad of {name}: error {err:.3g}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["ce", "fkl", "grpo", "topk"])
@BOTH
def test_linear_matches_the_unfused_formula(name, dtype):
    head, hidden, weight, bias, labels, inputs = _case(name, dtype=dtype)
    _check(head, hidden, weight, bias, labels, inputs, chunk_rows=5)      # 13 rows: 5 + 5 + 3


@pytest.mark.parametrize("chunk_rows", [1, 4, 13, 100])
@BOTH
def test_any_chunking_gives_the_same_result(chunk_rows):
    head, hidden, weight, bias, labels, inputs = _case("ce")
    _check(head, hidden, weight, None, labels, inputs, chunk_rows=chunk_rows)


@pytest.mark.parametrize("name", ["ce", "fkl"])
@BOTH
def test_3d_hidden_and_reduction_none(name):
    head, hidden, weight, bias, labels, inputs = _case(name, R=14, shape=(2, 7))
    out = _check(head, hidden, weight, bias, labels, inputs, chunk_rows=4, reduction="none")
    assert out.loss.shape == (2, 7)


@BOTH
def test_segment_terms_take_two_passes():
    head, hidden, weight, bias, labels, inputs = _case("segments")
    _check(head, hidden, weight, bias, labels, inputs, chunk_rows=5)


@pytest.mark.cpu
@BOTH
def test_upstream_gradient_and_frozen_weight():
    head, hidden, weight, bias, labels, inputs = _case("ce")
    h = hidden.clone().requires_grad_()
    (2.5 * head.linear(h, weight, labels, bias=bias, chunk_rows=6).loss).backward()
    h2 = hidden.clone().requires_grad_()
    head(h2 @ weight.t() + bias, labels).loss.backward()
    torch.testing.assert_close(h.grad, 2.5 * h2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        out = head.linear(hidden, weight, labels, bias=bias)
    torch.testing.assert_close(out.loss, head(hidden @ weight.t() + bias, labels).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.cpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@BOTH
def test_no_rows_give_zero_gradients(reduction):
    """A micro-batch whose rows were all selected away (hidden[mask] with no valid label): every
    gradient is 0, as autograd's on the unfused formula, not the contents of an unwritten buffer."""
    head, hidden, weight, bias, labels, inputs = _case("ce")
    h, w, b = hidden[:0].clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
    out = head.linear(h, w, labels[:0], bias=b, reduction=reduction)
    out.loss.sum().backward()
    assert out.loss.shape == ((0,) if reduction == "none" else ())
    assert h.grad.shape == (0, hidden.shape[1])
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.cpu
@BOTH
def test_bad_inputs_name_the_argument():
    head, hidden, weight, bias, labels, inputs = _case("ce")
    with pytest.raises(ValueError, match="H = 15"):
        head.linear(hidden, weight[:, :15], labels)
    with pytest.raises(ValueError, match=r"bias must be \[V\] = \[72\]"):
        head.linear(hidden, weight, labels, bias=bias[:10])
    with pytest.raises(TypeError, match="weight must have"):
        head.linear(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="chunk_rows"):
        head.linear(hidden, weight, labels, chunk_rows=0)
    fkl, hidden, weight, bias, labels, inputs = _case("fkl")
    with pytest.raises(ValueError, match="teacher_hidden and teacher_weight are required by forward_kl"):
        fkl.linear(hidden, weight, labels)
    with pytest.raises(TypeError, match="teacher_hidden="):
        fkl.linear(hidden, weight, labels, teacher_logits=hidden @ weight.t())
    with pytest.raises(ValueError, match="teacher_weight must have weight's 72"):
        fkl.linear(hidden, weight, labels, teacher_hidden=inputs["teacher_hidden"],
                   teacher_weight=inputs["teacher_weight"][:50])


# ---- vocab-parallel over gloo ----------------------------------------------------------------
def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name in ("ce", "fkl", "grpo", "topk"):
        head, hidden, weight, bias, labels, inputs = _case(name)
        rows = slice(rank * V // world, (rank + 1) * V // world)
        shard = {k: (v[rows] if k in ("teacher_weight", "teacher_bias") else v) for k, v in inputs.items()}
        h, w, b = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_(), \
            bias[rows].clone().requires_grad_()
        out = head.linear(h, w, labels, bias=b, chunk_rows=5, process_group=dist.group.WORLD, **shard)
        out.loss.backward()
        ref_loss, ref_values, ref_h, ref_w, ref_b = _reference(head, hidden, weight, bias, labels, inputs)
        queue.put((name, rank, float(out.loss), float(ref_loss),
                   max(abs(float(v) - float(ref_values[k])) for k, v in {**out.terms, **out.metrics}.items()),
                   float((h.grad - ref_h).abs().max() / ref_h.abs().max()),
                   float((w.grad - ref_w[rows]).abs().max() / ref_w.abs().max()),
                   float((b.grad - ref_b[rows]).abs().max() / ref_b.abs().max())))
    dist.destroy_process_group()


# (3 ranks: 72 columns as 24 a rank, a middle rank among them; two ranks' linear heads run in
# tests/runtime/test_vocab_parallel.py and test_class_weight.py)
@pytest.mark.cpu
@pytest.mark.parametrize("world", [3])
def test_vocab_parallel_linear(world):
    results = run_ranks(_worker, world, world * 4)
    for name, rank, loss, ref_loss, value_err, h_err, w_err, b_err in results:
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (name, rank, loss, ref_loss)
        assert value_err <= 1e-5, (name, rank, value_err)
        assert max(h_err, w_err, b_err) <= 2e-4, (name, rank, h_err, w_err, b_err)


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_linear_head_matches_logits_head_with_any_chunk(backend):
    gen = torch.Generator().manual_seed(18)
    h = torch.randn(13, 16, generator=gen)
    w = torch.randn(50, 16, generator=gen) * 0.5
    b = torch.randn(50, generator=gen) * 0.1
    th, tw = torch.randn(13, 8, generator=gen), torch.randn(50, 8, generator=gen)
    y = torch.randint(0, 50, (13,), generator=gen)
    y[[0, 7]] = R.IGNORE
    v = R.valid_rows(y)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5, temperature=2.0), backend=backend)

    def loss(hh, ww, bb):
        z = hh @ ww.T + bb
        t = th.double() @ tw.double().T
        return R.mean_over(R.ce_rows(z, y), v) + 0.5 * R.mean_over(R.forward_kl_rows(z, t, 2.0), v)
    hd, wd, bd = (a.double().requires_grad_(True) for a in (h, w, b))
    want = loss(hd, wd, bd)
    want.backward()
    for chunk in (None, 1, 5, 13):
        hh, ww, bb = (a.clone().requires_grad_(True) for a in (h, w, b))
        out = head.linear(hh, ww, y, bias=bb, teacher_hidden=th, teacher_weight=tw, chunk_rows=chunk)
        out.loss.backward()
        R.close(out.loss, want, R.FP32, f"loss chunk={chunk}")
        for got, ref, n in ((hh.grad, hd.grad, "hidden"), (ww.grad, wd.grad, "weight"), (bb.grad, bd.grad, "bias")):
            R.close(got, ref, 1e-4, f"{n} grad chunk={chunk}")
