"""Vocab-parallel heads over gloo on the CPU: every rank gets the unsharded values and its shard of
the gradient, with one all_gather_into_tensor of the packed stats (and one all-reduce more where the
head has an exact read). Also segment
terms whose segments are split across sequence-parallel ranks (``segment_group``)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import losscodegen as lcg
from helpers import run_ranks, topk_inputs


def _heads():
    return {
        "ce_family": (lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                                   metrics=(lcg.Entropy(), lcg.TokenAccuracy())), {}),
        "distill": (lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.ForwardKL(temperature=2.0),
                                 lcg.TopKForwardKL(weight=0.3)), {"teacher", "topk"}),
        "jsd": (lcg.HeadLoss(lcg.JSD(beta=0.3)), {"teacher"}),
        "grpo": (lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.Entropy(), lcg.ClipFraction())),
                 {"policy"}),
        "gspo": (lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1)), {"policy", "segments"}),
    }


def _inputs(needs, R=10, V=504):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R, V, generator=g) * 2
    y = torch.randint(0, V, (R,), generator=g)
    y[3] = -100
    kw = {}
    if "teacher" in needs:
        kw["teacher_logits"] = torch.randn(R, V, generator=g) * 2
    if "topk" in needs:
        kw.update(topk_inputs(R, V, 6, g))
    if "policy" in needs:
        l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
        kw.update(old_logprobs=l + 0.3 * torch.randn(R, generator=g), ref_logprobs=l,
                  advantages=torch.randn(R, generator=g))
    if "segments" in needs:  # segment 2 is empty; segment 3 holds only the ignored row
        kw["segment_ids"] = torch.tensor([0, 0, 1, 3, 1, 1, 4, 4, 0, 4])[:R]
    return x, y, kw


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls = {"all_gather_into_tensor": 0, "all_reduce": 0}
    for fn in calls:
        original = getattr(dist, fn)

        def counted(*a, _fn=fn, _orig=original, **k):
            calls[_fn] += 1
            return _orig(*a, **k)
        setattr(dist, fn, counted)
    for name, (head, needs) in _heads().items():
        queue.put((name, rank) + _compare(head, needs, rank, world, calls))
    queue.put(("sequence_parallel", rank) + _compare_sequence_parallel(rank, world, calls))
    dist.destroy_process_group()


def _compare(head, needs, rank, world, calls):
    for fn in calls:
        calls[fn] = 0
    x, y, kw = _inputs(needs)
    V = x.shape[1]
    Vl = V // world
    cols = slice(rank * Vl, (rank + 1) * Vl)
    shard = x[:, cols].clone().requires_grad_()
    skw = dict(kw)
    if "teacher_logits" in kw:
        skw["teacher_logits"] = kw["teacher_logits"][:, cols].contiguous()
    out = head(shard, y, process_group=dist.group.WORLD, **skw)
    out.loss.backward()
    sharded_calls = dict(calls)
    full = x.clone().requires_grad_()
    ref = head(full, y, **kw)
    ref.loss.backward()
    ref_values = {**ref.terms, **ref.metrics}
    return (float(out.loss), float(ref.loss),
            {k: (float(v), float(ref_values[k])) for k, v in {**out.terms, **out.metrics}.items()},
            float((shard.grad - full.grad[:, cols]).abs().max()), float(full.grad.abs().max()),
            sharded_calls)


def _compare_sequence_parallel(rank, world, calls):
    """Rows split in contiguous chunks across ranks, segments spanning them: every rank gets the
    global GSPO value and, for its rows, the unsharded gradient."""
    for fn in calls:
        calls[fn] = 0
    head = lcg.HeadLoss(lcg.GSPO())
    x, y, kw = _inputs({"policy", "segments"}, R=13)
    kw["segment_ids"] = torch.tensor([0, 2, 2, 5, 0, 2, 6, 0, 2, 2, 5, 0, 0])  # 1, 3, 4 empty
    rows = torch.tensor_split(torch.arange(x.shape[0]), world)[rank]
    part = x[rows].clone().requires_grad_()
    out = head(part, y[rows], segment_group=dist.group.WORLD,
               **{k: v[rows] for k, v in kw.items()})
    out.loss.backward()
    sharded_calls = dict(calls)
    full = x.clone().requires_grad_()
    ref = head(full, y, **kw)
    ref.loss.backward()
    return (float(out.loss), float(ref.loss), {"gspo": (float(out.terms["gspo"]), float(ref.terms["gspo"]))},
            float((part.grad - full.grad[rows]).abs().max()), float(full.grad.abs().max()),
            sharded_calls)


# on both backends (conftest's ``backend``; the torch backend's merge is one code for any world)
@pytest.mark.cpu
# (3 ranks in the slow tier: a middle rank is test_vocab_shards_of_uneven_widths_match_the_whole_vocabulary's too)
@pytest.mark.parametrize("world,backend", [(2, "triton"), pytest.param(3, "triton", marks=pytest.mark.slow), (2, "torch")],
                         indirect=["backend"])
def test_sharded_equals_unsharded(world, backend):
    heads = _heads()
    results = run_ranks(_worker, world, world * (len(heads) + 1))
    for name, rank, loss, ref_loss, values, grad_err, grad_max, calls in results:
        if name == "sequence_parallel":
            assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (rank, loss, ref_loss)
            assert grad_err <= 1e-5 * grad_max, (rank, grad_err, grad_max)
            # num_segments unknown: a MAX all-reduce for it, then one SUM of the packed segment sums
            assert calls == {"all_gather_into_tensor": 0, "all_reduce": 2}, calls
            continue
        exact = heads[name][0].plan().lowered.has_exact
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (name, rank, loss, ref_loss)
        for k, (v, r) in values.items():
            assert abs(v - r) <= 1e-5 * max(1.0, abs(r)), (name, rank, k, v, r)
        assert grad_err <= 1e-5 * grad_max, (name, rank, grad_err, grad_max)
        # one round: the packed stats; a head with an exact read adds one all-reduce. (This is the
        # head's first call: one all-gather more exchanges the shards' widths, once.)
        assert calls == {"all_gather_into_tensor": 1 + 1, "all_reduce": int(exact)}, (name, calls)


def test_in_kernel_exchange_keeps_one_launch_where_it_applies():
    """Where the GPUs of a group map each other's memory, the packed stats go from kernel to kernel:
    a head without an exact read is one launch, and a segment term's first launch exchanges and
    merges in-kernel before its rows. An exact read keeps the all-gather between launches (it reads
    every row again after the exchange anyway)."""
    from losscodegen.plan import launch_sequence
    (one,) = launch_sequence(has_exact=False, segments=False, sharded=True, grad=True, exchange=True)
    assert one.stats and one.exchange and one.merge and one.rows and one.grad and not one.then
    rows, grad = launch_sequence(has_exact=False, segments=True, sharded=True, grad=True, exchange=True)
    assert rows.stats and rows.exchange and rows.merge and rows.rows and rows.store_stats and not rows.grad
    assert rows.then == "segments" and grad.grad and not (grad.stats or grad.exchange or grad.merge)
    kw = dict(has_exact=True, segments=False)
    seq = launch_sequence(**kw, sharded=True, grad=True, exchange=True)
    assert seq == launch_sequence(**kw, sharded=True, grad=True)
    assert not any(launch.exchange for launch in seq)


def test_no_in_kernel_exchange_off_the_gpu():
    from losscodegen import collectives
    assert collectives.exchange(None, torch.device("cpu")) is None
    assert collectives.exchange(object(), torch.device("cpu")) is None


def _uneven_heads():
    return {
        "ce_family": lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                                  metrics=(lcg.Entropy(), lcg.TokenAccuracy())),
        "distill": lcg.HeadLoss(lcg.CrossEntropy(weight=0.5), lcg.ForwardKL(temperature=2.0)),
        "grpo": lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.ClipFraction(),)),
    }


def _uneven_worker(rank, world, port, queue):
    """Each rank holds its share of 61 columns, as torch.tensor_split cuts them (31 + 30; 21 + 20
    + 20): against the float64 reference of the whole vocabulary, by head(...) and head.linear."""
    from helpers import spec
    from reference import head_reference
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    V, R, H = 61, 10, 6
    cols = torch.tensor_split(torch.arange(V), world)[rank]
    for name, head in _uneven_heads().items():
        x, y, kw = _inputs({"teacher", "policy"} if name != "ce_family" else set(), R=R, V=V)
        skw = dict(kw)
        if "teacher_logits" in kw:
            skw["teacher_logits"] = kw["teacher_logits"][:, cols].contiguous()
        if name != "distill":
            skw.pop("teacher_logits", None)
            kw.pop("teacher_logits", None)
        shard = x[:, cols].clone().requires_grad_()
        out = head(shard, y, process_group=dist.group.WORLD, **skw)
        out.loss.backward()
        terms = [spec(t, head) for t in head.loss_terms]
        loss, values, grad = head_reference(terms, [spec(t, head) for t in head.metric_terms], x, y, **kw)
        errors = {k: abs(float(v) - float(values[k])) / max(1.0, abs(float(values[k])))
                  for k, v in {**out.terms, **out.metrics}.items()}
        errors["loss"] = abs(float(out.loss) - float(loss)) / max(1.0, abs(float(loss)))
        errors["grad"] = float((shard.grad.double() - grad[:, cols]).abs().max() / grad.abs().max())
        queue.put((name, rank, errors))
    # head.linear: this rank's rows of the output layer
    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (R,), generator=g)
    head = _uneven_heads()["ce_family"]
    h = hidden.clone().requires_grad_()
    w = weight[cols].clone().requires_grad_()
    out = head.linear(h, w, y, process_group=dist.group.WORLD, chunk_rows=4)
    out.loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss, _, _ = head_reference([spec(t, head) for t in head.loss_terms], [], h64 @ w64.T, y)  # (and backward)
    errors = {"loss": abs(float(out.loss) - float(loss)) / max(1.0, abs(float(loss))),
              "hidden": float((h.grad.double() - h64.grad).abs().max() / h64.grad.abs().max()),
              "weight": float((w.grad.double() - w64.grad[cols]).abs().max() / w64.grad.abs().max())}
    # torch.compile, class weights (one per class of the whole vocabulary): the widths' exchange
    # runs once while tracing
    x = torch.randn(R, V, generator=g)
    class_weight = torch.rand(V, generator=g) + 0.5
    head = lcg.HeadLoss(lcg.CrossEntropy(class_weight=class_weight))
    step = torch.compile(lambda s: head(s, y, process_group=dist.group.WORLD).loss, fullgraph=True,
                         backend="aot_eager")
    shard = x[:, cols].clone().requires_grad_()
    step(shard).backward()
    x64 = x.double().requires_grad_()
    ref = F.cross_entropy(x64, y, weight=class_weight.double())
    ref.backward()
    errors["compiled"] = abs(float(step(x[:, cols])) - float(ref)) / max(1.0, abs(float(ref)))
    errors["compiled grad"] = float((shard.grad.double() - x64.grad[:, cols]).abs().max() / x64.grad.abs().max())
    queue.put(("linear, compiled", rank, errors))
    dist.destroy_process_group()


# (3 ranks: 21 + 20 + 20 columns, a middle rank among them; two ranks' exchange is every other
# vocab-parallel test's)
@pytest.mark.cpu
@pytest.mark.parametrize("world", [3])
def test_vocab_shards_of_uneven_widths_match_the_whole_vocabulary(world):
    results = run_ranks(_uneven_worker, world, world * (len(_uneven_heads()) + 1))
    assert len(results) == world * 4
    for name, rank, errors in results:
        assert max(errors.values()) <= 2e-5, (name, rank, errors)
