"""Heads on DTensors over gloo CPU ranks (one spawn per world size, every case inside): the vocabulary
sharded (``Shard(-1)``), the rows sharded (``Shard(0)``, uneven), replicated, and both on a 2-D mesh;
``head.linear`` with a tensor-parallel weight. Each value and gradient against the unsharded float64
reference (tests/reference.py), and cross-entropy against torch's own ``loss_parallel``."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import losscodegen as lcg
from helpers import run_ranks, spec, topk_inputs
from reference import head_reference

pytestmark = pytest.mark.cpu   # CPU tensors throughout (conftest's ``cpu``)

TOL = 2e-5


def _heads():
    return {
        "ce_family": (lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                                   metrics=(lcg.Entropy(), lcg.TokenAccuracy())), set()),
        "distill": (lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.ForwardKL(temperature=2.0),
                                 lcg.TopKForwardKL(weight=0.3)), {"teacher", "topk"}),
        "grpo": (lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.Entropy(), lcg.ClipFraction())), {"policy"}),
        "gspo": (lcg.HeadLoss(lcg.GSPO()), {"policy", "segments"}),
    }


def _inputs(needs, shape, V, seed=3):
    """Global inputs, the same on every rank: logits [*shape, V], labels with ignored rows."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.tensor(shape).prod())
    x = torch.randn(R, V, generator=g) * 2
    y = torch.randint(0, V, (R,), generator=g)
    y[1::5] = -100
    kw = {}
    if "teacher" in needs:
        kw["teacher_logits"] = torch.randn(R, V, generator=g) * 2
    if "topk" in needs:
        kw.update(topk_inputs(R, V, 4, g))
    if "policy" in needs:
        lp = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
        kw.update(old_logprobs=lp + 0.3 * torch.randn(R, generator=g), ref_logprobs=lp,
                  advantages=torch.randn(R, generator=g))
    if "segments" in needs:      # segments cross every row shard; segment 1 is empty
        kw["segment_ids"] = torch.arange(R) % 5 // 2 * 2
    kw = {k: v.reshape(*shape, *v.shape[1:]) for k, v in kw.items()}
    return x.reshape(*shape, V), y.reshape(shape), kw


def _reference(head, x, y, **kw):
    ref_kw = {k: v for k, v in kw.items() if k not in ("num_segments",)}
    return head_reference([spec(t, head) for t in head.loss_terms], [spec(t, head) for t in head.metric_terms],
                          x, y, ignore_index=head.ignore_index, **ref_kw)


def _err(got, want):
    """(worst absolute error, scale) of ``got`` against ``want``; DTensors compared whole."""
    from torch.distributed.tensor import DTensor
    if isinstance(got, DTensor):
        got = got.full_tensor()
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max()), max(1.0, float(want.abs().max()))


def _check(case, head, logits, y, x, kw, call):
    """Run ``head(logits, y, **call)`` on the DTensor ``logits``, backward, and compare with the float64
    reference of the global inputs ``x``, ``kw``. Returns [(case/what, error, scale)]."""
    from torch.distributed.tensor import DTensor
    out = head(logits, y, **call)
    assert isinstance(out.loss, DTensor), type(out.loss)
    assert all(p.is_replicate() for p in out.loss.placements), out.loss.placements
    out.loss.backward()
    ref_loss, ref_values, ref_grad = _reference(head, x, y.full_tensor() if isinstance(y, DTensor) else y, **kw)
    rows = [(f"{case}/loss", *_err(out.loss, ref_loss))]
    for name, value in {**out.terms, **out.metrics}.items():
        assert not isinstance(value, DTensor) and not value.requires_grad
        rows.append((f"{case}/{name}", *_err(value, ref_values[name])))
    assert logits.grad.placements == logits.placements, (logits.grad.placements, logits.placements)
    rows.append((f"{case}/grad", *_err(logits.grad, ref_grad)))
    return rows


def _cases_1d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows = []
    V = 8 * world

    def dt(t, placements, grad=False):
        d = distribute_tensor(t.clone(), mesh, placements)
        return d.requires_grad_() if grad else d

    for name, (head, needs) in _heads().items():
        # the vocabulary sharded: labels and per-row inputs plain global tensors, the teacher a DTensor
        x, y, kw = _inputs(needs, (3, 4), V)
        skw = dict(kw)
        if "teacher_logits" in kw:
            skw["teacher_logits"] = dt(kw["teacher_logits"], [Shard(2)])
        rows += _check(f"vocab/{name}", head, dt(x, [Shard(-1)], True), y, x, kw, skw)
        # the rows sharded, unevenly (7 rows); labels a DTensor, the rest plain global tensors
        x, y, kw = _inputs(needs, (7,), V, seed=5)
        rows += _check(f"rows/{name}", head, dt(x, [Shard(0)], True), dt(y, [Shard(0)]), x, kw, kw)
    head = _heads()["ce_family"][0]
    x, y, kw = _inputs(set(), (7,), V, seed=6)
    # plain labels of this rank's rows (a sequence-parallel loader's), reduction="none" and "sum", divisor=
    local_y = torch.tensor_split(y, world)[rank]
    rows += _check_local_labels(head, dt(x, [Shard(0)], True), local_y, x, y)
    for call in ({"reduction": "none"}, {"reduction": "sum"}, {"divisor": 11.0}):
        rows += _check_call(f"rows/{call}", head, dt(x, [Shard(0)], True), dt(y, [Shard(0)]), x, y, call)
        rows += _check_call(f"vocab/{call}", head, dt(x, [Shard(1)], True), y, x, y, call)
    rows += _check("replicate/ce_family", head, dt(x, [Replicate()], True), y, x, {}, {})

    # torch's own loss_parallel, the same value and gradient
    ce = lcg.HeadLoss(lcg.CrossEntropy())
    x, y, _ = _inputs(set(), (3, 4), V, seed=7)
    ours, theirs = dt(x, [Shard(-1)], True), dt(x, [Shard(-1)], True)
    out = ce(ours, y)
    out.loss.backward()
    with loss_parallel():
        loss = F.cross_entropy(theirs.flatten(0, 1), dt(y.flatten(), [Replicate()]))
        loss.backward()
    rows.append(("loss_parallel/loss", *_err(out.loss, loss.full_tensor())))
    rows.append(("loss_parallel/grad", *_err(ours.grad, theirs.grad.full_tensor())))

    # refused alike on every rank: a Partial placement; with rows sharded and no divisor=, a segment
    # mean beside a token mean, and class weights
    with pytest.raises(ValueError, match="Partial"):
        ce(DTensor.from_local(x, mesh, [Partial()]), y)
    x, y, kw = _inputs({"policy", "segments"}, (7,), V, seed=8)
    with pytest.raises(ValueError, match="divisor="):
        lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy())(dt(x, [Shard(0)]), y, **kw)
    with pytest.raises(ValueError, match="class_weight|class-weighted"):
        lcg.HeadLoss(lcg.CrossEntropy(class_weight=torch.rand(V) + 0.5))(dt(x, [Shard(0)]), y)
    rows += _linear_tp(mesh, rank, world)
    return rows


def _check_local_labels(head, logits, local_y, x, y):
    out = head(logits, local_y)
    out.loss.backward()
    ref_loss, ref_values, ref_grad = _reference(head, x, y)
    return [("rows/local_labels/loss", *_err(out.loss, ref_loss)),
            ("rows/local_labels/grad", *_err(logits.grad, ref_grad))]


def _check_call(case, head, logits, labels, x, y, call):
    out = head(logits, labels, **call)
    per_row = call.get("reduction") == "none"
    if per_row:
        # the rows laid out as the logits' rows; upstream gradients that differ row by row
        from torch.distributed.tensor import Replicate
        assert out.loss.placements == tuple(Replicate() if p.is_shard(1) else p for p in logits.placements)
        up = torch.linspace(0.5, 2.0, x.shape[0])
        (out.loss.full_tensor() * up).sum().backward()
    else:
        out.loss.backward()
    ref_loss, ref_values, ref_grad = _reference(head, x, y, **call)
    if per_row:     # (rows are independent: each row's gradient scales with its upstream gradient)
        ref_grad = ref_grad * up.double()[:, None]
    rows = [(f"{case}/loss", *_err(out.loss, ref_loss)), (f"{case}/grad", *_err(logits.grad, ref_grad))]
    rows += [(f"{case}/{n}", *_err(v, ref_values[n])) for n, v in {**out.terms, **out.metrics}.items()]
    return rows


def _linear_tp(mesh, rank, world):
    """``head.linear`` with a tensor-parallel weight (``Shard(0)`` over the vocabulary), plain hidden
    states replicated over the group: the unsharded float64 values and gradients."""
    from torch.distributed.tensor import Shard, distribute_tensor
    g = torch.Generator().manual_seed(11)
    V, H, R = 8 * world, 16, 9
    hidden, W = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (R,), generator=g)
    y[2] = -100
    head = _heads()["ce_family"][0]
    h = hidden.clone().requires_grad_()
    w = distribute_tensor(W.clone(), mesh, [Shard(0)]).requires_grad_()
    out = head.linear(h, w, y)
    out.loss.backward()
    hd, Wd = hidden.double().requires_grad_(), W.double().requires_grad_()
    ref_loss, ref_values, _ = _reference(head, hd @ Wd.T, y)
    rows = [("linear_tp/loss", *_err(out.loss, ref_loss))]
    ref = _reference_graph(head, hd, Wd, y)
    rows += [("linear_tp/grad_hidden", *_err(h.grad, ref[0])), ("linear_tp/grad_weight", *_err(w.grad, ref[1]))]
    assert w.grad.placements == w.placements
    rows += [(f"linear_tp/{n}", *_err(v, ref_values[n])) for n, v in {**out.terms, **out.metrics}.items()]
    # sequence parallel: hidden states sharded by rows over the vocabulary's own group are gathered
    # (as ColwiseParallel gathers its input) and their gradient comes back with their placement
    hs = distribute_tensor(hidden.clone(), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(W.clone(), mesh, [Shard(0)]).requires_grad_()
    out = head.linear(hs, w, y)
    out.loss.backward()
    assert hs.grad.placements == hs.placements
    rows += [("linear_sp/loss", *_err(out.loss, ref_loss)), ("linear_sp/grad_hidden", *_err(hs.grad, ref[0])),
             ("linear_sp/grad_weight", *_err(w.grad, ref[1]))]
    return rows


def _reference_graph(head, hd, Wd, y):
    """The float64 reference's gradients of the hidden states and the weight (through hd @ Wd.T)."""
    hd, Wd = hd.detach().requires_grad_(), Wd.detach().requires_grad_()
    _reference(head, hd @ Wd.T, y)
    return hd.grad, Wd.grad


def _cases_2d(rank, world):
    """dp x tp = 2 x 2: rows sharded over dp, the vocabulary over tp; loss_parallel's sum alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = []
    V = 16
    for name, (head, needs) in _heads().items():
        x, y, kw = _inputs(needs, (5, 3), V, seed=9)
        skw = dict(kw)
        if "teacher_logits" in kw:
            skw["teacher_logits"] = distribute_tensor(kw["teacher_logits"], mesh, [Shard(0), Shard(2)])
        logits = distribute_tensor(x.clone(), mesh, [Shard(0), Shard(2)]).requires_grad_()
        labels = distribute_tensor(y, mesh, [Shard(0), Replicate()])
        out = head(logits, labels, **skw)
        out.loss.backward()
        ref_loss, ref_values, ref_grad = _reference(head, x, y, **kw)
        rows += [(f"2d/{name}/loss", *_err(out.loss, ref_loss)), (f"2d/{name}/grad", *_err(logits.grad, ref_grad))]
        rows += [(f"2d/{name}/{n}", *_err(v, ref_values[n])) for n, v in {**out.terms, **out.metrics}.items()]
    ce = lcg.HeadLoss(lcg.CrossEntropy())
    x, y, _ = _inputs(set(), (6,), V, seed=10)
    ours = distribute_tensor(x.clone(), mesh, [Shard(0), Shard(1)]).requires_grad_()
    theirs = distribute_tensor(x.clone(), mesh, [Shard(0), Shard(1)]).requires_grad_()
    labels = distribute_tensor(y, mesh, [Shard(0), Replicate()])
    out = ce(ours, labels, reduction="sum")
    out.loss.backward()
    with loss_parallel():
        loss = F.cross_entropy(theirs, labels, reduction="sum")
        loss.backward()
    rows += [("2d/loss_parallel/loss", *_err(out.loss, loss.full_tensor())),
             ("2d/loss_parallel/grad", *_err(ours.grad, theirs.grad.full_tensor()))]
    # tensor-parallel linear on the 2-D mesh: hidden rows over dp, the weight's vocabulary over tp
    g = torch.Generator().manual_seed(12)
    hidden, W = torch.randn(6, 8, generator=g), torch.randn(V, 8, generator=g)
    h = distribute_tensor(hidden.clone(), mesh, [Shard(0), Replicate()]).requires_grad_()
    w = distribute_tensor(W.clone(), mesh, [Replicate(), Shard(0)]).requires_grad_()
    out = ce.linear(h, w, labels)
    out.loss.backward()
    hd, Wd = hidden.double().requires_grad_(), W.double().requires_grad_()
    ref_loss, _, _ = _reference(ce, hd @ Wd.T, y)
    rows += [("2d/linear/loss", *_err(out.loss, ref_loss)), ("2d/linear/grad_hidden", *_err(h.grad, hd.grad)),
             ("2d/linear/grad_weight", *_err(w.grad, Wd.grad))]
    return rows


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = _cases_1d(rank, world)
        if world == 4:
            rows += _cases_2d(rank, world)
        queue.put((rank, rows, None))
    except Exception as e:  # (reported by the test, not lost in a child's stderr)
        import traceback
        queue.put((rank, [], traceback.format_exc()))
    dist.destroy_process_group()


# (4 ranks run every 1-D case too, and the 2-D mesh; DTensors on 2 ranks are
# tests/runtime/test_contract_distributed.py's)
@pytest.mark.parametrize("world", [4])
def test_heads_on_dtensors_equal_the_unsharded_float64_reference(world):
    results = run_ranks(_worker, world, world)
    for rank, rows, error in results:
        assert error is None, f"rank {rank}:\n{error}"
        assert rows
        for what, err, scale in rows:
            assert err <= TOL * scale, (rank, what, err, scale)
