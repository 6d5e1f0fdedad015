"""torchtitan (where it is installed): a head as torchtitan's loss (``HeadLossFunction``) on gloo CPU
ranks, on the hidden states of a tiny model from torchtitan's own registry (llama3 "debugmodel"),
against torchtitan's ``CrossEntropyLoss`` with tensor parallelism (its ``partial_dtensor`` backend's
DTensor logits and its ``spmd_types`` backend's local shards) and the float64 reference."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

import losscodegen as lcg  # noqa: E402
from helpers import run_ranks, spec  # noqa: E402
from reference import head_reference  # noqa: E402

TOL = 2e-5


def _err(got, want):
    from torch.distributed.tensor import DTensor
    got = got.full_tensor() if isinstance(got, DTensor) else got
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max()), max(1.0, float(want.abs().max()))


def _reference(head, h, W, labels, gvt):
    """The float64 loss torchtitan's contract asks of a rank (its rows' sum / global_valid_tokens)
    and its gradient with respect to the output layer's weight."""
    Wd = W.double().requires_grad_()
    logits = (h.double() @ Wd.T).flatten(0, 1)
    loss, values, _ = head_reference([spec(t, head) for t in head.loss_terms],
                                     [spec(t, head) for t in head.metric_terms], logits, labels.flatten(),
                                     divisor=float(gvt))
    return loss, values, Wd.grad


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, _cases(rank, world), None))
    except Exception:  # (reported by the test, not lost in a child's stderr)
        import traceback
        queue.put((rank, [], traceback.format_exc()))
    dist.destroy_process_group()


def _cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh

    from losscodegen.integrations.torchtitan import HeadLossFunction
    saved = torch.load(os.environ["LCG_TITAN_INPUTS"])
    h, W, labels = saved["hidden"], saved["weight"], saved["labels"]
    V = W.shape[0]
    gvt = (labels != -100).sum().float()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows = []
    heads = {"cross_entropy": lcg.HeadLoss(lcg.CrossEntropy()),
             "ce_z_entropy": lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-3), metrics=(lcg.Entropy(),))}
    theirs = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=V))

    def lm_head():
        lin = torch.nn.Linear(W.shape[1], V, bias=False)
        with torch.no_grad():
            lin.weight.copy_(W)
        return parallelize_module(lin, mesh, ColwiseParallel(use_local_output=False))

    for name, head in heads.items():
        ours = HeadLossFunction(HeadLossFunction.Config(head=head))
        ref_loss, ref_values, ref_grad = _reference(head, h, W, labels, gvt)
        # partial_dtensor: the TP lm_head's DTensor logits, sharded over the vocabulary
        titan_utils.set_spmd_backend("partial_dtensor")
        lin = lm_head()
        with loss_parallel():
            loss, metrics = ours(lin(h), labels, gvt)
            loss.backward()
        assert not isinstance(loss, torch.distributed.tensor.DTensor)
        rows += [(f"partial_dtensor/{name}/loss", *_err(loss, ref_loss)),
                 (f"partial_dtensor/{name}/grad", *_err(lin.weight.grad, ref_grad))]
        rows += [(f"partial_dtensor/{name}/{k}", *_err(v, ref_values[k])) for k, v in metrics.items()]
        if name == "cross_entropy":
            lin2 = lm_head()
            with loss_parallel():
                their_loss, _ = theirs(lin2(h), labels, gvt)
                their_loss.backward()
            rows += [("partial_dtensor/titan/loss", *_err(loss, their_loss)),
                     ("partial_dtensor/titan/grad", *_err(lin.weight.grad, lin2.weight.grad.full_tensor()))]
        # spmd_types (torchtitan's default): plain local vocabulary shards
        titan_utils.set_spmd_backend("spmd_types")
        w_local = distribute_tensor(W, mesh, [Shard(0)]).to_local().clone().requires_grad_()
        with set_current_spmd_mesh(mesh):
            loss, metrics = ours(h @ w_local.T, labels, gvt)
            loss.backward()
            rows += [(f"spmd_types/{name}/loss", *_err(loss, ref_loss)),
                     (f"spmd_types/{name}/grad", *_err(w_local.grad, ref_grad.chunk(world)[rank]))]
            if name == "cross_entropy":
                w2 = w_local.detach().clone().requires_grad_()
                their_loss, _ = theirs(h @ w2.T, labels, gvt)
                their_loss.backward()
                rows += [("spmd_types/titan/loss", *_err(loss, their_loss)),
                         ("spmd_types/titan/grad", *_err(w_local.grad, w2.grad))]
    return rows


def _inputs(path):
    """Hidden states of torchtitan's llama3 "debugmodel" (built from its registry, random weights),
    its output layer's weight and labels, saved for the ranks."""
    from torchtitan.models.llama3 import model_registry
    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_weights(buffer_device=None)
    ids = torch.randint(0, 2048, (1, 128))
    positions = torch.arange(128)[None]
    model._skip_lm_head = True
    with torch.no_grad():   # (flex attention has no backward on the CPU; the loss's gradient is the point)
        hidden = model(ids, positions, model.get_attention_masks(positions=positions))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[0, 2] = -100
    # (128 positions: a whole flex-attention block, shorter sequences come out NaN at times on the CPU;
    # the first 16 are enough for the loss)
    torch.save({"hidden": hidden[:, :16].clone(), "weight": model.lm_head.weight.detach() * 4,
                "labels": labels[:, :16].clone()}, path)


def test_head_as_torchtitan_loss_equals_torchtitan_cross_entropy(tmp_path):
    path = tmp_path / "inputs.pt"
    # (in a process of its own without Triton's interpreter, which the model's own kernels do not run
    # under: its hidden states come out NaN there)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST")}
    here = os.path.dirname(os.path.abspath(__file__))   # (this file, and helpers.py one folder up)
    subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; "
                    f"from test_torchtitan import _inputs; _inputs({str(path)!r})"], env=env, check=True)
    os.environ["LCG_TITAN_INPUTS"] = str(path)
    for rank, rows, error in run_ranks(_worker, 2, 2):
        assert error is None, f"rank {rank}:\n{error}"
        assert rows
        for what, err, scale in rows:
            assert err <= TOL * scale, (rank, what, err, scale)
