"""FSDP2 over gloo CPU ranks (one spawn, every case inside): ``head.linear`` with a weight that
``fully_shard`` manages, and ``apply_losscodegen`` on a tiny Llama wrapped by FSDP2 (lm_head as its own
unit or in the root, tied or not); and ``apply_losscodegen`` on a model loaded with transformers'
tensor-parallel plan (``tp_plan="auto"``). Each rank trains on its own rows; FSDP averages the gradients over
the ranks, so each parameter's gradient must be the mean over the ranks of the unsharded model's
gradients (float64 reference for ``head.linear``, the model's own loss for the integration)."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from helpers import run_ranks, spec
from reference import head_reference

pytestmark = pytest.mark.cpu   # CPU tensors throughout (conftest's ``cpu``)

TOL = 2e-5


def _err(got, want):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max()), max(1.0, float(want.abs().max()))


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _linear_cases(rank, world):
    """head.linear(hidden, lm_head.weight, ...) with ``fully_shard(lm_head)``: the weight gathered and
    its gradient reduce-scattered (averaged) by FSDP, the hidden states' gradient this rank's."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    V, H, R = 24, 16, 7
    lm_head = torch.nn.Linear(H, V, bias=True)
    W, b = lm_head.weight.detach().clone(), lm_head.bias.detach().clone()
    fully_shard(lm_head)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2), metrics=(lcg.Entropy(),))
    rows = []
    for reduction in ("mean", "none"):
        lm_head.zero_grad()
        g = torch.Generator().manual_seed(20)
        hiddens = [torch.randn(R, H, generator=g) for _ in range(world)]
        labels = [torch.randint(0, V, (R,), generator=g) for _ in range(world)]
        h = hiddens[rank].clone().requires_grad_()
        out = head.linear(h, lm_head.weight, labels[rank], bias=lm_head.bias, reduction=reduction)
        (out.loss.sum() if reduction == "none" else out.loss).backward()
        # reference: each rank's float64 loss, gradients averaged over the ranks as FSDP does
        Wd, bd = W.double().requires_grad_(), b.double().requires_grad_()
        grads_h = []
        for r in range(world):
            hd = hiddens[r].double().requires_grad_()
            loss, values, _ = head_reference([spec(t, head) for t in head.loss_terms],
                                             [spec(t, head) for t in head.metric_terms],
                                             hd @ Wd.T + bd, labels[r], reduction=reduction)
            grads_h.append(hd.grad)
            if r == rank:
                rows += [(f"linear/{reduction}/loss", *_err(out.loss, loss))]
                rows += [(f"linear/{reduction}/{n}", *_err(v, values[n]))
                         for n, v in {**out.terms, **out.metrics}.items()]
        rows += [(f"linear/{reduction}/grad_hidden", *_err(h.grad, grads_h[rank])),
                 (f"linear/{reduction}/grad_weight", *_err(_full(lm_head.weight.grad), Wd.grad / world)),
                 (f"linear/{reduction}/grad_bias", *_err(_full(lm_head.bias.grad), bd.grad / world))]
    return rows


class _Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, the hidden states the embeddings."""

    def __init__(self, V, H):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return torch.tanh(self.embed(ids))


def _tied_cases(rank, world):
    """Tied embeddings in one FSDP2 unit (the root): head.linear on the root's output with
    ``model.lm_head.weight``, the shared weight's gradient from both uses, averaged over the ranks."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(1)
    V, H = 24, 16
    model = _Tied(V, H)
    reference = copy.deepcopy(model).double()
    fully_shard(model)
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    g = torch.Generator().manual_seed(21)
    ids = [torch.randint(0, V, (9,), generator=g) for _ in range(world)]
    labels = [torch.randint(0, V, (9,), generator=g) for _ in range(world)]
    out = head.linear(model(ids[rank]), model.lm_head.weight, labels[rank])
    out.loss.backward()
    losses = []
    for r in range(world):
        loss, _, _ = head_reference([spec(t, head) for t in head.loss_terms], [], reference(ids[r]) @
                                    reference.lm_head.weight.T, labels[r])
        losses.append(loss)
    return [("tied/loss", *_err(out.loss, losses[rank])),
            ("tied/grad", *_err(_full(model.embed.weight.grad), reference.embed.weight.grad / world))]


def _model_cases(rank, world):
    """apply_losscodegen on a tiny Llama under FSDP2 against the unsharded, unpatched model."""
    from torch.distributed.fsdp import fully_shard
    from losscodegen.integrations.transformers import apply_losscodegen
    from helpers import tiny_causal_lm
    rows = []
    for case in ("lm_head_unit", "root", "tied"):
        model = tiny_causal_lm(32, tie_word_embeddings=case == "tied")
        reference = copy.deepcopy(model)
        if case == "lm_head_unit":
            fully_shard(model.lm_head)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        apply_losscodegen(model)
        model.train()
        g = torch.Generator().manual_seed(30)
        ids = [torch.randint(4, 32, (2, 6), generator=g) for _ in range(world)]
        out = model(input_ids=ids[rank], labels=ids[rank])
        out.loss.backward()
        reference.train()
        losses = [reference(input_ids=i, labels=i).loss for i in ids]
        (sum(losses) / world).backward()
        rows.append((f"model/{case}/loss", *_err(out.loss, losses[rank])))
        ours = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            rows.append((f"model/{case}/grad/{name}", *_err(_full(ours[name].grad), p.grad)))
    return rows


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = _linear_cases(rank, world) + _tied_cases(rank, world)
        if world == 2:
            rows += _model_cases(rank, world)
        queue.put((rank, rows, None))
    except Exception:  # (reported by the test, not lost in a child's stderr)
        import traceback
        queue.put((rank, [], traceback.format_exc()))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_fsdp2_sharded_weights_give_the_unsharded_values_and_averaged_gradients(world):
    pytest.importorskip("transformers")
    for rank, rows, error in run_ranks(_worker, world, world):
        assert error is None, f"rank {rank}:\n{error}"
        assert rows
        for what, err, scale in rows:
            assert err <= TOL * scale, (rank, what, err, scale)


def _tp_plan_worker(rank, world, port, queue):
    """A tiny Llama loaded with ``tp_plan="auto"`` (its lm_head weight a DTensor ``Shard(0)``: the
    vocab-parallel fused path), patched, against the same checkpoint loaded whole and unpatched."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from helpers import tiny_causal_lm
        from losscodegen.integrations.transformers import apply_losscodegen
        path = os.environ["LCG_TP_CHECKPOINT"]
        if rank == 0:
            tiny_causal_lm(32).save_pretrained(path)
        dist.barrier()
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, tp_plan="auto", device_mesh=init_device_mesh("cpu", (world,)))
        assert model.lm_head.weight.placements[0].is_shard(0)
        apply_losscodegen(model)
        model.train()
        reference.train()
        ids = torch.randint(4, 32, (2, 6), generator=torch.Generator().manual_seed(40))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        ref = reference(input_ids=ids, labels=ids)
        ref.loss.backward()
        ours = dict(model.named_parameters())
        rows = [("tp_plan/loss", *_err(out.loss, ref.loss))]
        rows += [(f"tp_plan/grad/{n}", *_err(_full(ours[n].grad), p.grad)) for n, p in reference.named_parameters()]
        queue.put((rank, rows, None))
    except Exception:  # (reported by the test, not lost in a child's stderr)
        import traceback
        queue.put((rank, [], traceback.format_exc()))
    dist.destroy_process_group()


def test_apply_losscodegen_under_transformers_tp_plan_equals_the_unsharded_model(tmp_path):
    pytest.importorskip("transformers")
    os.environ["LCG_TP_CHECKPOINT"] = str(tmp_path / "tiny")
    for rank, rows, error in run_ranks(_tp_plan_worker, 2, 2):
        assert error is None, f"rank {rank}:\n{error}"
        assert rows
        for what, err, scale in rows:
            assert err <= TOL * scale, (rank, what, err, scale)


def test_fsdp2_weights_are_told_apart_from_tensor_parallel_shards_on_every_torch_layout():
    """FSDP2's state keeps its parameter groups as a list in torch 2.13 (``_fsdp_param_groups``) and as
    one group or None in earlier releases (``_fsdp_param_group``, torch 2.11 on the H100 image). Missing
    the older layout made an FSDP-sharded lm_head pass for a tensor-parallel ``Shard(0)`` weight: each
    rank's batch scored against the other ranks' (found on 2 H100s, bench/multi_gpu.py's FSDP part).
    An FSDP module whose state has neither is an error, never "not FSDP"."""
    from types import SimpleNamespace

    from losscodegen.distributed import _fsdp_param_groups
    group = SimpleNamespace(fsdp_params=[])
    module = torch.nn.Linear(2, 2)
    FSDPState = type("FSDPState", (SimpleNamespace,), {})    # (named as fully_shard's state class)
    assert _fsdp_param_groups(module, SimpleNamespace(_fsdp_param_groups=[group, group])) == [group, group]
    assert _fsdp_param_groups(module, SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _fsdp_param_groups(module, SimpleNamespace(_fsdp_param_group=None)) == []
    assert _fsdp_param_groups(module, SimpleNamespace()) == []          # another composable API's state
    assert _fsdp_param_groups(module, None) == []                        # (its state collected)
    with pytest.raises(RuntimeError, match="_fsdp_param_groups"):
        _fsdp_param_groups(module, FSDPState())
