"""CONTRACT.md "Distributed engines" and "Vocab-parallel", checked as a user would on gloo CPU ranks
(one spawn for the 2-rank cases, one for the 4-rank mesh, one for FSDP2's): DTensor logits
Shard(-1) / Shard(0) / Replicate, a 2-D mesh, Partial refused naming it, head.linear with a Shard(0)
DTensor weight, and process_group vocab shards of unequal widths. Values against float64 torch
formulas written from the contract (tests/reference.py), gradients by torch.autograd."""
import os
import socket
import tempfile
import traceback

import pytest
import torch

import reference as R
from helpers import rank_process, rank_queue

FP32 = 5e-5


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, world, timeout=600):
    """Run ``worker(rank, world)`` on ``world`` gloo ranks; returns each rank's list of
    (case, error message or None). The ranks fork from the suite's server of ranks (tests/helpers.py),
    which imported torch and losscodegen once, and take this process's environment."""
    q = rank_queue()
    port = _free_port()
    procs = [rank_process(_main, worker, r, world, port, q) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    import queue
    try:
        for _ in range(world):
            rank, res = q.get(timeout=timeout)
            results[rank] = res
    except queue.Empty:
        pass
    finally:   # a hung rank is a failure, not a hung suite
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results.get(r, [("worker", "no answer: hung")]) for r in range(world)]


def _main(worker, rank, world, port, q):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("LOSSCODEGEN_CACHE", tempfile.mkdtemp(prefix="lcg-contract-"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, worker(rank, world)))
    except BaseException:
        q.put((rank, [("worker", traceback.format_exc())]))
    finally:
        dist.destroy_process_group()


def _case(results, name, fn):
    try:
        fn()
        results.append((name, None))
    except BaseException as e:   # noqa: BLE001 (every case reported, none stops the others)
        results.append((name, f"{type(e).__name__}: {e}"[:600]))


def _global(R_=13, V=42, seed=0):
    x, y, t = R.rows_in(R_, V, seed=seed, ignored=(1, 6, 12))
    return x, y, t


def _ce_kl_head():
    import losscodegen as lcg
    return lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), lcg.ForwardKL(weight=0.5, temperature=2.0),
                        metrics=(lcg.Entropy(), lcg.TokenAccuracy()))


def _ce_kl_reference(x, y, t):
    v = R.valid_rows(y)

    def loss(z):
        return (R.mean_over(R.ce_rows(z, y), v) + 0.1 * R.mean_over(R.z_loss_rows(z), v)
                + 0.5 * R.mean_over(R.forward_kl_rows(z, t, 2.0), v))
    x64 = x.double().requires_grad_(True)
    want = loss(x64)
    want.backward()
    terms = {"cross_entropy": R.mean_over(R.ce_rows(x.double(), y), v),
             "z_loss": R.mean_over(R.z_loss_rows(x.double()), v),
             "forward_kl": R.mean_over(R.forward_kl_rows(x.double(), t, 2.0), v),
             "entropy": R.mean_over(R.entropy_rows(x.double()), v),
             "token_accuracy": R.mean_over(R.accuracy_rows(x.double(), y), v)}
    return want, terms, x64.grad


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dtensor_case(mesh, x_pl, y_pl, t_pl, x, y, t):
    from torch.distributed.tensor import distribute_tensor
    head = _ce_kl_head()
    xd = distribute_tensor(x, mesh, x_pl).detach().requires_grad_(True)
    yd = distribute_tensor(y, mesh, y_pl)
    td = distribute_tensor(t, mesh, t_pl)
    out = head(xd, yd, teacher_logits=td)
    out.loss.backward()
    want, terms, grad = _ce_kl_reference(x, y, t)
    R.close(_full(out.loss), want, FP32, "loss")
    for k, w in terms.items():
        R.close(_full({**out.terms, **out.metrics}[k]), w, FP32, k)
    assert tuple(xd.grad.placements) == tuple(xd.placements), (xd.grad.placements, xd.placements)
    R.close(xd.grad.full_tensor(), grad, FP32, "grad")


def _world2(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    import losscodegen as lcg
    mesh = init_device_mesh("cpu", (world,))
    x, y, t = _global()
    res = []
    _case(res, "dtensor Shard(-1)", lambda: _dtensor_case(mesh, [Shard(1)], [Replicate()], [Shard(1)], x, y, t))
    _case(res, "dtensor Shard(-1) local teacher and labels", lambda: _local_inputs_case(mesh, x, y, t))
    _case(res, "dtensor Shard(0) uneven rows", lambda: _dtensor_case(mesh, [Shard(0)], [Shard(0)], [Shard(0)], x, y, t))
    _case(res, "dtensor Replicate", lambda: _dtensor_case(mesh, [Replicate()], [Replicate()], [Replicate()], x, y, t))

    def partial():
        xd = DTensor.from_local(x / world, mesh, [Partial()])
        try:
            lcg.HeadLoss(lcg.CrossEntropy())(xd, distribute_tensor(y, mesh, [Replicate()]))
        except (ValueError, TypeError, NotImplementedError) as e:
            assert "Partial" in str(e), str(e)
            return
        raise AssertionError("Partial logits were accepted")
    _case(res, "dtensor Partial refused naming it", partial)

    def linear_tp():
        gen = torch.Generator().manual_seed(3)
        h, w = torch.randn(9, 8, generator=gen), torch.randn(42, 8, generator=gen) * 0.5
        yy = torch.randint(0, 42, (9,), generator=gen)
        yy[4] = R.IGNORE
        wd = distribute_tensor(w, mesh, [Shard(0)]).detach().requires_grad_(True)
        hh = h.clone().requires_grad_(True)
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1))
        out = head.linear(hh, wd, yy, chunk_rows=4)
        out.loss.backward()
        v = R.valid_rows(yy)
        h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
        z = h64 @ w64.T
        want = R.mean_over(R.ce_rows(z, yy) + 0.1 * R.z_loss_rows(z), v)
        want.backward()
        R.close(_full(out.loss), want, FP32, "loss")
        R.close(hh.grad, h64.grad, 1e-4, "hidden grad (complete on every rank)")
        R.close(_full(wd.grad), w64.grad, 1e-4, "weight grad")
    _case(res, "head.linear Shard(0) weight", linear_tp)

    def uneven_process_group(widths):
        lo = sum(widths[:rank])
        V = sum(widths)
        xx, yy, tt = _global(V=V, seed=4)
        xs = xx[:, lo:lo + widths[rank]].clone().requires_grad_(True)
        out = _ce_kl_head()(xs, yy, teacher_logits=tt[:, lo:lo + widths[rank]].clone(), process_group=dist.group.WORLD)
        out.loss.backward()
        want, terms, grad = _ce_kl_reference(xx, yy, tt)
        R.close(out.loss, want, FP32, "loss")
        for k, w in terms.items():
            R.close({**out.terms, **out.metrics}[k], w, FP32, k)
        R.close(xs.grad, grad[:, lo:lo + widths[rank]], FP32, "shard grad")
    _case(res, "process_group equal widths", lambda: uneven_process_group([21, 21]))
    _case(res, "process_group unequal widths", lambda: uneven_process_group([30, 11]))

    def linear_process_group():
        widths = [25, 16]
        lo = sum(widths[:rank])
        gen = torch.Generator().manual_seed(5)
        h, w, b = torch.randn(9, 8, generator=gen), torch.randn(41, 8, generator=gen) * 0.5, torch.randn(41, generator=gen) * 0.1
        yy = torch.randint(0, 41, (9,), generator=gen)
        yy[2] = R.IGNORE
        hh = h.clone().requires_grad_(True)
        ws = w[lo:lo + widths[rank]].clone().requires_grad_(True)
        bs = b[lo:lo + widths[rank]].clone().requires_grad_(True)
        head = lcg.HeadLoss(lcg.CrossEntropy())
        out = head.linear(hh, ws, yy, bias=bs, chunk_rows=4, process_group=dist.group.WORLD)
        out.loss.backward()
        v = R.valid_rows(yy)
        h64, w64, b64 = (a.double().requires_grad_(True) for a in (h, w, b))
        want = R.mean_over(R.ce_rows(h64 @ w64.T + b64, yy), v)
        want.backward()
        R.close(out.loss, want, FP32, "loss")
        R.close(hh.grad, h64.grad, 1e-4, "hidden grad")
        R.close(ws.grad, w64.grad[lo:lo + widths[rank]], 1e-4, "weight shard grad")
        R.close(bs.grad, b64.grad[lo:lo + widths[rank]], 1e-4, "bias shard grad")
    _case(res, "head.linear process_group unequal widths", linear_process_group)
    return res


def _local_inputs_case(mesh, x, y, t):
    """Shard(-1) logits with labels and teacher logits given as local tensors (the teacher as this
    rank's columns, like the logits)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    head = _ce_kl_head()
    xd = distribute_tensor(x, mesh, [Shard(1)]).detach().requires_grad_(True)
    td = distribute_tensor(t, mesh, [Shard(1)])
    out = head(xd, y, teacher_logits=td)
    out.loss.backward()
    want, _, grad = _ce_kl_reference(x, y, t)
    R.close(_full(out.loss), want, FP32, "loss")
    R.close(xd.grad.full_tensor(), grad, FP32, "grad")


def _world4(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, y, t = _global(R_=10, V=40, seed=6)
    res = []
    _case(res, "2-D mesh rows x vocab", lambda: _dtensor_case(mesh, [Shard(0), Shard(1)], [Shard(0), Replicate()],
                                                             [Shard(0), Shard(1)], x, y, t))
    return res


def _check(results):
    bad = {}
    for rank, res in enumerate(results):
        for name, err in res:
            if err is not None:
                bad.setdefault(name, []).append(f"rank {rank}: {err}")
    return bad


def _two_rank_cases(rank, world):
    """Every 2-rank worker of this file but FSDP2's in one spawn: each spawn imports torch and
    losscodegen again, some ten seconds of the suite a spawn on 2 busy cores."""
    return (_world2(rank, world) + _dtensor_more(rank, world) + _pg_policy(rank, world)
            + _dtensor_refusals(rank, world) + _label_case(rank, world) + _empty_case(rank, world))


@pytest.fixture(scope="module")
def ranks2():
    return _spawn(_two_rank_cases, 2)


def _only(results, prefix):
    """The cases of ``results`` whose name starts with ``prefix``, each rank's."""
    return [[(n, err) for n, err in res if n.startswith(prefix)] for res in results]


@pytest.fixture(scope="module")
def world2(ranks2):
    return ranks2


CASES_2 = ["dtensor Shard(-1)", "dtensor Shard(-1) local teacher and labels", "dtensor Shard(0) uneven rows",
           "dtensor Replicate", "dtensor Partial refused naming it", "head.linear Shard(0) weight",
           "process_group equal widths", "process_group unequal widths", "head.linear process_group unequal widths"]


@pytest.mark.parametrize("case", CASES_2)
def test_on_two_gloo_ranks(world2, case):
    names = {n for res in world2 for n, _ in res}
    assert case in names, world2
    bad = _check(world2).get(case)
    assert not bad, "\n".join(bad)


@pytest.mark.slow   # (a spawn of its own; a 2-D mesh on four ranks in the default tier: tests/runtime/test_dtensor.py)
def test_two_dimensional_mesh_on_four_gloo_ranks():
    bad = _check(_spawn(_world4, 4))
    assert not bad, bad


def _errors_alike(rank, world):
    """Bad input under process_group: every rank raises (the same error), none hangs or returns a value."""
    import torch.distributed as dist
    import losscodegen as lcg
    res = []
    x, y, t = _global(V=40, seed=7)

    def call(xs, yy):
        try:
            out = lcg.HeadLoss(lcg.CrossEntropy())(xs, yy, process_group=dist.group.WORLD)
            float(out.loss)
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    def bad_label():
        yy = y.clone()
        yy[3] = 40                      # == V (global), in range of no shard
        msg = call(x[:, rank * 20:(rank + 1) * 20].clone(), yy)
        assert "labels" in msg, msg
        gathered = [None] * world
        dist.all_gather_object(gathered, msg)
        assert len(set(gathered)) == 1, gathered
    if CASE == "label":
        _case(res, "label out of range: same error on every rank", bad_label)

    def empty_shard():
        widths = [40, 0]
        lo = sum(widths[:rank])
        xs = x[:, lo:lo + widths[rank]].clone().requires_grad_(True)
        try:
            out = lcg.HeadLoss(lcg.CrossEntropy())(xs, y, process_group=dist.group.WORLD)
            out.loss.backward()
            got = f"value {float(out.loss):.6f}"
        except (ValueError, TypeError) as e:
            got = f"error {type(e).__name__}: {e}"
        gathered = [None] * world
        dist.all_gather_object(gathered, got)
        assert len(set(gathered)) == 1, gathered
        if got.startswith("value"):
            R.close(out.loss, R.mean_over(R.ce_rows(x.double(), y), R.valid_rows(y)), FP32, "loss")
    if CASE == "empty":
        _case(res, "a rank with an empty vocab shard: the value or one error everywhere", empty_shard)
    return res


def _label_case(rank, world):
    global CASE
    CASE = "label"
    return _errors_alike(rank, world)


def _empty_case(rank, world):
    global CASE
    CASE = "empty"
    return _errors_alike(rank, world)


def test_bad_label_under_process_group_is_the_same_error_on_every_rank(ranks2):
    label = _only(ranks2, "label out of range")
    assert all(label), ranks2
    bad = _check(label)
    assert not bad, bad


def test_empty_vocab_shard_gives_the_value_or_one_error_on_every_rank(ranks2):
    empty = _only(ranks2, "a rank with an empty vocab shard")
    assert all(empty), ranks2
    bad = _check(empty)
    assert not bad, bad


def _fsdp_linear(rank, world):
    """Data parallel: each rank its own hidden states and labels; ``fully_shard(lm_head)`` holds the
    weight as Shard(0) over the ranks. head.linear(hidden, lm_head.weight, ...) gives each rank its own
    data's loss, and the weight's gradient FSDP's: the ranks' gradients averaged, sharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import losscodegen as lcg
    res = []

    def case():
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(11)
        w = torch.randn(40, 8, generator=gen) * 0.5
        hs = [torch.randn(7, 8, generator=gen) for _ in range(world)]
        ys = [torch.randint(0, 40, (7,), generator=gen) for _ in range(world)]
        ys[0][2] = R.IGNORE
        lm_head = torch.nn.Linear(8, 40, bias=False)
        with torch.no_grad():
            lm_head.weight.copy_(w)
        fully_shard(lm_head, mesh=mesh)
        hh = hs[rank].clone().requires_grad_(True)
        out = lcg.HeadLoss(lcg.CrossEntropy()).linear(hh, lm_head.weight, ys[rank], chunk_rows=3)
        out.loss.backward()
        w64 = w.double().requires_grad_(True)
        losses = []
        for r in range(world):
            v = R.valid_rows(ys[r])
            losses.append(R.mean_over(R.ce_rows(hs[r].double() @ w64.T, ys[r]), v))
        (sum(losses) / world).backward()     # FSDP's default: the mean of the ranks' gradients
        h64 = hs[rank].double().requires_grad_(True)
        R.mean_over(R.ce_rows(h64 @ w.double().T, ys[rank]), R.valid_rows(ys[rank])).backward()
        R.close(_full(out.loss) if not hasattr(out.loss, "placements") else out.loss.to_local(), losses[rank], FP32,
                "this rank's loss")
        R.close(hh.grad, h64.grad, 1e-4, "hidden grad (this rank's data)")
        g = lm_head.weight.grad
        R.close(g.full_tensor() if hasattr(g, "full_tensor") else g, w64.grad, 1e-4, "weight grad as FSDP's")
        dist.barrier()
    _case(res, "fsdp2 lm_head", case)
    return res


def _fsdp2_cases(rank, world):
    """FSDP2's workers in one spawn of their own (a spawn imports torch and losscodegen again)."""
    return _fsdp_linear(rank, world) + _fsdp_model(rank, world)


@pytest.fixture(scope="module")
def fsdp2():
    return _spawn(_fsdp2_cases, 2, timeout=300)


def test_linear_head_with_an_fsdp2_sharded_weight_on_data_parallel_ranks(fsdp2):
    cases = _only(fsdp2, "fsdp2 lm_head")
    assert all(cases), fsdp2
    bad = _check(cases)
    assert not bad, bad


def _dtensor_more(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import losscodegen as lcg
    mesh = init_device_mesh("cpu", (world,))
    res = []
    x, y, t = _global(R_=13, V=40, seed=12)
    zero = torch.zeros((), dtype=torch.float64)

    def rows_case(pl):
        xd = distribute_tensor(x, mesh, [pl]).detach().requires_grad_(True)
        yd = distribute_tensor(y, mesh, [Shard(0) if pl == Shard(0) else Replicate()])
        out = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1))(xd, yd, reduction="none")
        up = torch.linspace(-1, 1, 13)
        v = R.valid_rows(y)

        def ref(z):
            return torch.where(v, R.ce_rows(z, y) + 0.1 * R.z_loss_rows(z), zero)
        R.close(_full(out.loss), ref(x.double()), FP32, "rows")
        updt = distribute_tensor(up, mesh, list(out.loss.placements)) if hasattr(out.loss, "placements") else up
        (out.loss * updt).sum().backward()
        x64 = x.double().requires_grad_(True)
        (ref(x64) * up.double()).sum().backward()
        R.close(xd.grad.full_tensor(), x64.grad, FP32, "grad")
    _case(res, "reduction none Shard(0)", lambda: rows_case(Shard(0)))
    _case(res, "reduction none Shard(-1)", lambda: rows_case(Shard(1)))

    def gspo_rows_sharded():
        gen = torch.Generator().manual_seed(13)
        l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
        old = l + 0.01 * torch.randn(13, generator=gen)
        adv = torch.randn(13, generator=gen)
        seg = torch.tensor([0, 0, 0, 5, 5, 5, 5, 5, 9, 9, 9, 9, 9])      # segments cross the row shards (7 | 6)
        d = lambda a: distribute_tensor(a, mesh, [Shard(0)])  # noqa: E731
        xd = d(x).detach().requires_grad_(True)
        out = lcg.HeadLoss(lcg.GSPO(), metrics=(lcg.LogProb(),))(xd, d(y), advantages=d(adv), old_logprobs=d(old),
                                                                segment_ids=d(seg))
        out.loss.backward()
        v = R.valid_rows(y)
        x64 = x.double().requires_grad_(True)
        want = R.gspo_total(x64, y, adv, old, seg, v)
        want.backward()
        R.close(_full(out.loss), want, FP32, "gspo loss")
        R.close(_full(out.metrics["logprob"]), R.mean_over(R.logprob_rows(x.double(), y), v), FP32, "logprob")
        R.close(xd.grad.full_tensor(), x64.grad, FP32, "gspo grad")
    _case(res, "GSPO segments across Shard(0) rows", gspo_rows_sharded)

    def divisor_sharded():
        xd = distribute_tensor(x, mesh, [Shard(0)]).detach().requires_grad_(True)
        out = lcg.HeadLoss(lcg.CrossEntropy())(xd, distribute_tensor(y, mesh, [Shard(0)]), divisor=31)
        out.loss.backward()
        v = R.valid_rows(y)
        ref = lambda z: torch.where(v, R.ce_rows(z, y), zero).sum() / 31  # noqa: E731
        R.close(_full(out.loss), ref(x.double()), FP32, "divisor loss")
        x64 = x.double().requires_grad_(True)
        ref(x64).backward()
        R.close(xd.grad.full_tensor(), x64.grad, FP32, "divisor grad")
    _case(res, "divisor Shard(0)", divisor_sharded)
    return res


@pytest.fixture(scope="module")
def more2(ranks2):
    return ranks2


@pytest.mark.parametrize("case", ["reduction none Shard(0)", "reduction none Shard(-1)", "GSPO segments across Shard(0) rows",
                                  "divisor Shard(0)"])
def test_dtensor_reductions_segments_and_divisor(more2, case):
    names = {n for res in more2 for n, _ in res}
    assert case in names, more2
    bad = _check(more2).get(case)
    assert not bad, "\n".join(bad)


def _pg_policy(rank, world):
    import torch.distributed as dist
    import losscodegen as lcg
    res = []
    widths = [27, 13]
    lo, V = sum(widths[:rank]), sum(widths)
    x, y, t = _global(R_=12, V=V, seed=21)
    gen = torch.Generator().manual_seed(21)
    ids = torch.stack([torch.randperm(V, generator=gen)[:4] for _ in range(12)])
    lps = torch.log_softmax(t, -1).gather(1, ids)
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    old, adv = l + 0.3 * torch.randn(12, generator=gen), torch.randn(12, generator=gen)
    v = R.valid_rows(y)
    zero = torch.zeros((), dtype=torch.float64)

    def policy_topk_none():
        head = lcg.HeadLoss(lcg.GRPO(kl_beta=0.1), lcg.TopKForwardKL(weight=0.4, temperature=1.5),
                            metrics=(lcg.ClipFraction(), lcg.Entropy()))
        xs = x[:, lo:lo + widths[rank]].clone().requires_grad_(True)
        out = head(xs, y, teacher_topk_ids=ids, teacher_topk_logprobs=lps, advantages=adv, old_logprobs=old,
                   ref_logprobs=l, reduction="none", process_group=dist.group.WORLD)
        up = torch.linspace(-1, 1, 12)
        (out.loss * up).sum().backward()

        def rows(z):
            return torch.where(v, R.grpo_rows(z, y, adv, old, l, kl_beta=0.1)
                               + 0.4 * R.topk_forward_kl_rows(z, ids, lps, 1.5), zero)
        x64 = x.double().requires_grad_(True)
        (rows(x64) * up.double()).sum().backward()
        R.close(out.loss, rows(x.double()), FP32, "rows")
        R.close(xs.grad, x64.grad[:, lo:lo + widths[rank]], FP32, "shard grad")
        r = torch.exp(R.logprob_rows(x.double(), y) - old.double())
        R.close(out.metrics["clip_fraction"], R.mean_over(((r < 0.8) | (r > 1.2)).double(), v), 1e-6, "clip_fraction")
        R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), FP32, "entropy")
    _case(res, "process_group GRPO + top-k, reduction none, unequal widths", policy_topk_none)

    def linear_teacher_sum():
        gen2 = torch.Generator().manual_seed(22)
        h, w = torch.randn(12, 8, generator=gen2), torch.randn(V, 8, generator=gen2) * 0.5
        th, tw = torch.randn(12, 6, generator=gen2), torch.randn(V, 6, generator=gen2)
        hh = h.clone().requires_grad_(True)
        ws = w[lo:lo + widths[rank]].clone().requires_grad_(True)
        head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.JSD(beta=0.3, weight=0.5, temperature=2.0))
        out = head.linear(hh, ws, y, teacher_hidden=th, teacher_weight=tw[lo:lo + widths[rank]].clone(),
                          reduction="sum", chunk_rows=5, process_group=dist.group.WORLD)
        out.loss.backward()
        h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
        z, tt = h64 @ w64.T, th.double() @ tw.double().T
        want = torch.where(v, R.ce_rows(z, y) + 0.5 * R.jsd_rows(z, tt, 0.3, 2.0), zero).sum()
        want.backward()
        R.close(out.loss, want, FP32, "loss")
        R.close(hh.grad, h64.grad, 1e-4, "hidden grad")
        R.close(ws.grad, w64.grad[lo:lo + widths[rank]], 1e-4, "weight shard grad")
    _case(res, "head.linear process_group teacher JSD, reduction sum", linear_teacher_sum)
    return res


@pytest.fixture(scope="module")
def pg2(ranks2):
    return ranks2


@pytest.mark.parametrize("case", ["process_group GRPO + top-k, reduction none, unequal widths",
                                  "head.linear process_group teacher JSD, reduction sum"])
def test_process_group_policy_topk_and_teacher_linear(pg2, case):
    names = {n for res in pg2 for n, _ in res}
    assert case in names, pg2
    bad = _check(pg2).get(case)
    assert not bad, "\n".join(bad)


def _dtensor_refusals(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    import losscodegen as lcg
    mesh = init_device_mesh("cpu", (world,))
    x, y, t = _global(R_=10, V=40, seed=30)
    res = []

    def partial_teacher():
        xd = distribute_tensor(x, mesh, [Shard(1)])
        td = DTensor.from_local(t / world, mesh, [Partial()])
        try:
            out = lcg.HeadLoss(lcg.ForwardKL())(xd, y, teacher_logits=td)
        except (ValueError, TypeError, NotImplementedError) as e:
            assert "Partial" in str(e) and "teacher_logits" in str(e), str(e)
            return
        # accepted: then honoured (the teacher is the sum of the partial values)
        R.close(_full(out.loss), R.mean_over(R.forward_kl_rows(x.double(), t), R.valid_rows(y)), FP32,
                "Partial teacher_logits accepted: the loss of the summed teacher")
    _case(res, "Partial teacher_logits refused naming it or honoured", partial_teacher)

    def bad_label_same_everywhere():
        yy = y.clone()
        yy[4] = 40
        xd = distribute_tensor(x, mesh, [Shard(1)])
        try:
            float(_full(lcg.HeadLoss(lcg.CrossEntropy())(xd, yy).loss))
            msg = "no error"
        except (ValueError, TypeError) as e:
            msg = f"{type(e).__name__}: {e}"
        gathered = [None] * world
        dist.all_gather_object(gathered, msg)
        assert "labels" in msg and len(set(gathered)) == 1, gathered
    _case(res, "DTensor bad label: one error on every rank", bad_label_same_everywhere)
    return res


@pytest.fixture(scope="module")
def refusals2(ranks2):
    return ranks2


@pytest.mark.parametrize("case", ["Partial teacher_logits refused naming it or honoured",
                                  "DTensor bad label: one error on every rank"])
def test_dtensor_refusals(refusals2, case):
    names = {n for res in refusals2 for n, _ in res}
    assert case in names, refusals2
    bad = _check(refusals2).get(case)
    assert not bad, "\n".join(bad)


def _fsdp_model(rank, world):
    """apply_losscodegen on a tiny llama wrapped by FSDP2 (lm_head its own unit, then not; tied, then
    not): each rank's loss is its own batch's shifted cross-entropy."""
    import copy
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from losscodegen.integrations.transformers import apply_losscodegen
    mesh = init_device_mesh("cpu", (world,))
    res = []
    for tied in (False, True):
        for own_unit in (True, False):
            def case(tied=tied, own_unit=own_unit):
                config = transformers.AutoConfig.for_model(
                    "llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=2, bos_token_id=3, tie_word_embeddings=tied)
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(config).float()
                ref = copy.deepcopy(model).double()
                g = torch.Generator().manual_seed(100 + rank)
                ids = torch.randint(4, 48, (2, 7), generator=g)
                labels = ids.clone()
                labels[0, :2] = R.IGNORE
                apply_losscodegen(model)
                if own_unit:     # (FSDP2 puts a tied weight's two modules in one unit)
                    fully_shard([model.model.embed_tokens, model.lm_head] if tied else model.lm_head, mesh=mesh)
                fully_shard(model, mesh=mesh)
                out = model(input_ids=ids, labels=labels)
                out.loss.backward()
                want = ref(input_ids=ids, labels=labels).loss
                R.close(out.loss, want, 1e-4, "this rank's loss")
            _case(res, f"fsdp2 model tied={tied} lm_head_unit={own_unit}", case)
    return res


def test_apply_losscodegen_under_fsdp2(fsdp2):
    cases = _only(fsdp2, "fsdp2 model")
    assert all(len(res) == 4 for res in cases), fsdp2
    bad = _check(cases)
    assert not bad, bad
