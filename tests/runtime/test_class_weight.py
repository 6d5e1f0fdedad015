"""Per-class weights: ``Term(class_weight=w)`` against ``F.cross_entropy(weight=w)`` (float64, then
fp32 and bf16 logits), against a float64 reference written here from the formula, through
``head(...)``, ``head.linear(...)``, vocab-parallel heads and torch.compile, combined with other
terms; and every bad input refused by name."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import losscodegen as lcg
from helpers import TorchOps, run_ranks
from losscodegen import inputs as lcg_inputs
from losscodegen import symbols as S
from losscodegen.testing import compare

# the tests on one device run on both backends (conftest's ``backend``: the heads built with backend="auto")
BOTH = pytest.mark.usefixtures("backend")

R, V, H = 11, 203, 16


def _data(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(R, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, V, (R,), generator=g)
    y[[1, 6]] = -100
    w = torch.rand(V, generator=g, dtype=torch.float64) * 2
    w[y[0]] = 0.0        # a valid row whose class weighs 0
    return z, y, w.float(), g


def _ours(head, z, y, **kw):
    x = z.clone().requires_grad_()
    out = head(x, y, **kw)
    out.loss.sum().backward() if kw.get("reduction") == "none" else out.loss.backward()
    return out, x.grad


def _torch(z, y, w, **kw):
    x = z.detach().double().requires_grad_()
    loss = F.cross_entropy(x, y, weight=w.double(), **kw)
    loss.sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@BOTH
def test_matches_torch_cross_entropy_weight(dtype, reduction):
    z, y, w, _ = _data(dtype=dtype)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w))
    out, grad = _ours(head, z, y, reduction=reduction)
    want, want_grad = _torch(z, y, w, reduction=reduction)
    compare("loss", out.loss, want, dtype)
    compare("gradient", grad, want_grad, dtype)
    # the term's value: the weighted mean whatever the reduction (out.terms are means under "none")
    mean = F.cross_entropy(z.double(), y, weight=w.double())
    compare("cross_entropy", out.terms["cross_entropy"], want if reduction == "sum" else mean, dtype)
    if reduction == "none":
        compare("rows", out.rows["cross_entropy"], want, dtype)   # torch's per-row w[y] * CE, 0 ignored


def _reference(z, y, w, mask=None, divisor=None, z_weight=0.0):
    """Written from the formula: CE weighted by w[y], divided by the valid rows' sum of w[y] (or the
    divisor); z-loss (lse**2) divided by the number of valid rows (or the divisor)."""
    x = z.detach().double().requires_grad_()
    valid = y != -100
    if mask is not None:
        valid = valid & mask
    lse = torch.logsumexp(x, -1)
    zy = x.gather(1, y.clamp(0, V - 1)[:, None])[:, 0]
    wy = torch.where(valid, w.double()[y.clamp(0, V - 1)], 0.0)
    ce = (wy * (lse - zy)).sum() / (divisor if divisor is not None else wy.sum())
    zl = torch.where(valid, lse ** 2, 0.0).sum() / (divisor if divisor is not None else valid.sum())
    loss = ce + z_weight * zl
    loss.backward()
    return loss.detach(), {"cross_entropy": ce.detach(), "z_loss": zl.detach()}, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divisor", [None, 7.0])
@BOTH
def test_with_z_loss_only_cross_entropy_is_weighted(dtype, divisor):
    z, y, w, g = _data(1, dtype)
    mask = torch.rand(R, generator=g) > 0.2
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss(weight=1e-2))
    kw = {} if divisor is None else {"divisor": divisor}
    out, grad = _ours(head, z, y, loss_mask=mask, **kw)
    want, terms, want_grad = _reference(z, y, w, mask, divisor, z_weight=1e-2)
    compare("loss", out.loss, want, dtype)
    for name in terms:
        compare(name, out.terms[name], terms[name], dtype)
    compare("gradient", grad, want_grad, dtype)


@BOTH
def test_parity_tool_and_declared_terms():
    w = _data()[2]
    lcg.testing.assert_parity(lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss(weight=1e-3),
                                           metrics=(lcg.TokenAccuracy(),)), rows=R, vocab=V)
    # any term that reads the labels takes class weights: a focal-style declared term (row x w[y])
    Poly1 = lcg.declare_term("poly1", S.lse - S.target_logit + S.param("eps") * (1 - S.exp(S.target_logit - S.lse)))
    lcg.testing.assert_parity(lcg.HeadLoss(Poly1(eps=2.0, class_weight=w)), rows=R, vocab=V)
    lcg.testing.assert_parity(lcg.HeadLoss(lcg.LogProb(class_weight=w, normalize="sum")), rows=R, vocab=V)


@BOTH
def test_normalize_sum_and_ignored_rows_only():
    z, y, w, _ = _data(2)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w, normalize="sum"))
    out, grad = _ours(head, z, y)
    want, want_grad = _torch(z, y, w, reduction="sum")
    compare("loss", out.loss, want, torch.float32)
    compare("gradient", grad, want_grad, torch.float32)
    # no valid row: 0 and a zero gradient (torch: NaN), as without class weights
    out, grad = _ours(head, z, torch.full_like(y, -100))
    assert out.loss.item() == 0.0 and not grad.any()


@BOTH
def test_zero_total_weight_is_zero_not_nan():
    z, y, w, _ = _data(3)
    w = w.clone()
    w[y[y != -100]] = 0.0       # every valid row's class weighs 0: torch's mean is 0/0 = NaN
    assert F.cross_entropy(z.double(), y, weight=w.double()).isnan()
    out, grad = _ours(lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss()), z, y)
    assert out.terms["cross_entropy"].item() == 0.0
    compare("z_loss", out.terms["z_loss"], _reference(z, y, w, z_weight=1.0)[1]["z_loss"], torch.float32)
    want_grad = _reference(z, y, torch.ones(V), z_weight=1.0)[2] - _reference(z, y, torch.ones(V))[2]
    compare("gradient", grad, want_grad, torch.float32)   # the z-loss's alone


@pytest.mark.cpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@BOTH
def test_linear(reduction):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(R, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (R,), generator=g)
    y[[0, 5]] = -100
    w = (torch.rand(V, generator=g) * 2).float()
    up = torch.linspace(0.5, 1.5, R, dtype=torch.float64)   # per-row upstream gradients under "none"
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss(weight=1e-2))
    ours = [t.float().requires_grad_() for t in (h, W, b)]
    out = head.linear(*ours[:2], y, bias=ours[2], chunk_rows=4, reduction=reduction)
    (out.loss * up.float()).sum().backward() if reduction == "none" else out.loss.backward()
    theirs = [t.clone().requires_grad_() for t in (h, W, b)]
    z = theirs[0] @ theirs[1].T + theirs[2]
    ce = F.cross_entropy(z, y, weight=w.double(), reduction=reduction)
    zl = torch.where(y != -100, torch.logsumexp(z, -1) ** 2, 0.0)
    want = ce + 1e-2 * (zl if reduction == "none" else zl.sum() / (y != -100).sum())
    (want * up).sum().backward() if reduction == "none" else want.backward()
    compare("loss", out.loss, want.detach(), torch.float32)
    compare("cross_entropy", out.terms["cross_entropy"], F.cross_entropy(z, y, weight=w.double()).detach(),
            torch.float32)
    for name, a, t in zip(("hidden", "weight", "bias"), ours, theirs):
        compare("gradient", a.grad, t.grad, torch.float32, where=name)


def _sharded_worker(rank, world, port, queue):
    import os
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    z, y, w, g = _data(5)
    cols = slice(rank * (V // world), (rank + 1) * (V // world))
    z, w = z[:, :V // world * world], w[:V // world * world]     # (V divisible by the ranks)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss(weight=1e-2), metrics=(lcg.Entropy(),))
    results = {}
    for reduction in ("mean", "none"):
        shard = z[:, cols].clone().requires_grad_()
        out = head(shard, y, process_group=dist.group.WORLD, reduction=reduction)
        out.loss.sum().backward()
        full = z.clone().requires_grad_()
        ref = head(full, y, reduction=reduction)
        ref.loss.sum().backward()
        x = z.double().requires_grad_()
        zl = torch.where(y != -100, torch.logsumexp(x, -1) ** 2, 0.0)
        want = F.cross_entropy(x, y, weight=w.double(), reduction=reduction) \
            + 1e-2 * (zl if reduction == "none" else zl.sum() / (y != -100).sum())
        want.sum().backward()
        results[reduction] = (out.loss.detach(), ref.loss.detach(), out.terms["cross_entropy"],
                              ref.terms["cross_entropy"], shard.grad, full.grad[:, cols], x.grad[:, cols])
    # head.linear with this rank's rows of the vocabulary
    hid = torch.randn(R, H, generator=g)
    Wt = torch.randn(z.shape[1], H, generator=g) * 0.5
    hs, Ws = hid.clone().requires_grad_(), Wt[cols].clone().requires_grad_()
    out = head.linear(hs, Ws, y, process_group=dist.group.WORLD)
    out.loss.backward()
    hf, Wf = hid.clone().requires_grad_(), Wt.clone().requires_grad_()
    ref = head.linear(hf, Wf, y)
    ref.loss.backward()
    results["linear"] = (out.loss.detach(), ref.loss.detach(), out.terms["cross_entropy"], ref.terms["cross_entropy"],
                         torch.cat([hs.grad, Ws.grad]), torch.cat([hf.grad, Wf.grad[cols]]), None)
    # (plain lists: tensors sent through the queue would need this process alive to be read)
    queue.put((rank, {name: [None if t is None else t.double().tolist() for t in ts] for name, ts in results.items()}))
    dist.destroy_process_group()


@pytest.mark.cpu
def test_vocab_parallel():
    for rank, results in run_ranks(_sharded_worker, 2, 2):
        for name, values in results.items():
            loss, ref_loss, ce, ref_ce, grad, ref_grad, want_grad = [
                None if v is None else torch.tensor(v, dtype=torch.float64) for v in values]
            where = f"rank {rank}, {name}"
            compare("loss", loss, ref_loss, torch.float32, where=where)
            compare("cross_entropy", ce, ref_ce, torch.float32, where=where)
            compare("gradient", grad, ref_grad, torch.float32, where=where)
            if want_grad is not None:   # and F.cross_entropy(weight=)'s, in float64, for the shard
                compare("gradient", grad, want_grad, torch.float32, where=where)


@pytest.mark.cpu
@BOTH
@pytest.mark.slow   # (torch.compile of a class-weighted head: half a minute on 2 cores; compiled heads stay in the default tier)
def test_compiled_equals_eager():
    z, y, w, _ = _data(6)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss(weight=1e-2))

    def step(x, y):
        out = head(x, y)
        return out.loss, out.terms["cross_entropy"]
    x1, x2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    loss, ce = torch.compile(step, fullgraph=True)(x1, y)
    loss.backward()
    want, want_ce = step(x2, y)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(ce, want_ce)
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.cpu
@BOTH
def test_buffer_follows_the_head_and_in_place_updates():
    z, y, w, _ = _data(7)
    w = w.clone()
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w))
    assert "class_weight_cross_entropy" not in head.state_dict()   # (a head in a model leaves checkpoints alone)
    w.mul_(3.0).add_(torch.linspace(0, 1, V))                      # in place: read at the next call
    compare("loss", head(z, y).loss, F.cross_entropy(z.double(), y, weight=w.double()), torch.float32)
    for copied in (copy.deepcopy(head), pickle.loads(pickle.dumps(head)), head.to(torch.float64)):
        compare("loss", copied(z, y).loss, F.cross_entropy(z.double(), y, weight=w.double()), torch.float32)



@pytest.mark.parametrize("kw", [{}, {"loss_mask": torch.ones(R, dtype=torch.bool)}, {"reduction": "none"}])
@BOTH
def test_a_few_small_ops_and_none_without_class_weights(kw):
    """Checking a call's inputs: no torch op for a head without class weights; a few ops on [rows]
    (none on [rows, V]) with them."""
    z, y, w, _ = _data(8)
    counts = {}
    for name, head in (("plain", lcg.HeadLoss(lcg.CrossEntropy())),
                       ("weighted", lcg.HeadLoss(lcg.CrossEntropy(class_weight=w)))):
        head.kernel
        with TorchOps() as mode:
            lcg_inputs.check_call(head, head.kernel.SPEC, z, y, dict(kw))
        counts[name] = mode.ops
    assert counts["plain"] == [], counts["plain"]
    assert len(counts["weighted"]) <= 8, counts["weighted"]
    sizes = [torch.Size(s).numel() for _, shapes in counts["weighted"] for s in shapes]
    assert all(n <= R for n in sizes), counts["weighted"]


# ---- refused, by name ---------------------------------------------------------------------------------
@BOTH
def test_bad_class_weights_are_refused():
    w = torch.rand(V)
    for bad, error, match in [
            ([1.0] * V, TypeError, "1-D float tensor"),
            (torch.ones(1, V), TypeError, "1-D float tensor"),
            (torch.ones(V, dtype=torch.long), TypeError, "1-D float tensor"),
            (torch.ones(0), TypeError, "1-D float tensor"),
            (torch.ones(V).requires_grad_(), ValueError, "requires grad"),
            (-w, ValueError, ">= 0"),
            (torch.where(w > 0.5, float("nan"), w), ValueError, "finite"),
            (torch.where(w > 0.5, float("inf"), w), ValueError, "finite")]:
        with pytest.raises(error, match=f"cross_entropy: class_weight.*{match}"):
            lcg.CrossEntropy(class_weight=bad)
    with pytest.raises(ValueError, match="class_weight with label_smoothing"):
        lcg.CrossEntropy(class_weight=w, label_smoothing=0.1)
    with pytest.raises(ValueError, match="class_weight with label_smoothing"):
        lcg.CrossEntropy(class_weight=w, label_smoothing=torch.tensor(0.0))
    with pytest.raises(ValueError, match="class_weight.*not 'sequence'"):
        lcg.CrossEntropy(class_weight=w, normalize="sequence")
    with pytest.raises(ValueError, match="forward_kl is not a row term that reads the labels"):
        lcg.ForwardKL(class_weight=w)
    with pytest.raises(ValueError, match="gspo is not a row term"):
        lcg.GSPO(class_weight=w)
    with pytest.raises(ValueError, match="metric"):
        lcg.TokenAccuracy(class_weight=w)
    with pytest.raises(ValueError, match="cross_entropy: a metric.*takes no class_weight"):
        lcg.HeadLoss(metrics=(lcg.CrossEntropy(class_weight=w),))
    with pytest.raises(ValueError, match="token names starting with 'class_weight__'"):
        lcg.declare_term("mine", S.token("class_weight__cross_entropy") * S.lse)


@pytest.mark.cpu
@BOTH
def test_bad_calls_are_refused():
    z, y, w, _ = _data(9)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w[:-1]))
    with pytest.raises(ValueError, match=rf"class_weight of cross_entropy must have one weight per class of the vocabulary \({V}\), got {V - 1}"):
        head(z, y)
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w))
    with pytest.raises(TypeError, match="unexpected keyword.*class_weight__cross_entropy"):
        head(z, y, class_weight__cross_entropy=torch.ones(R))
    with pytest.raises(ValueError, match="labels is required by cross_entropy"):
        head(z)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_against_torch(dtype):
    """The compiled kernel, a real vocabulary: value and gradient against F.cross_entropy(weight=)
    in float64, with a z-loss beside it, and the class weights on the wrong device refused."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 2048, 128256
    z = (torch.randn(rows, vocab, generator=g, device="cuda") * 3).to(dtype)
    y = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    y[::7] = -100
    w = torch.rand(vocab, generator=g, device="cuda") * 2
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=w), lcg.ZLoss(weight=1e-4))
    x = z.clone().requires_grad_()
    out = head(x, y)
    out.loss.backward()
    xr = z.double().requires_grad_()
    ce = F.cross_entropy(xr, y, weight=w.double())
    valid = y != -100
    want = ce + 1e-4 * torch.where(valid, torch.logsumexp(xr, -1) ** 2, 0.0).sum() / valid.sum()
    want.backward()
    compare("loss", out.loss, want.detach(), dtype)
    compare("cross_entropy", out.terms["cross_entropy"], ce.detach(), dtype)
    compare("gradient", x.grad, xr.grad, dtype)
    with pytest.raises(ValueError, match="class_weight of cross_entropy is on cpu"):
        lcg.HeadLoss(lcg.CrossEntropy(class_weight=w.cpu()))(z, y)
