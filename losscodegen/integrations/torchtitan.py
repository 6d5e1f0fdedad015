"""torchtitan: any head as torchtitan's loss (docs/distributed.md).

``HeadLossFunction`` is a torchtitan loss (a ``BaseLoss``): its ``Config`` goes where the trainer's
config takes a loss (``Trainer.Config(loss=HeadLossFunction.Config(head=...))``, or as the inner
``loss_fn`` of torchtitan's ``ChunkedLossWrapper``), and it keeps torchtitan's contract:
``loss_fn(pred, labels, global_valid_tokens) -> (loss, metrics)`` where ``loss`` is this rank's rows'
sum divided by ``global_valid_tokens`` (the trainer sums it over the data-parallel ranks) and
``metrics`` the head's terms and metrics.

The logits torchtitan hands its loss: a DTensor sharded over the vocabulary on the ``tp`` mesh
(``spmd_backend="partial_dtensor"``, ``loss_parallel`` on), a plain local vocabulary shard under
``spmd_backend="spmd_types"`` with tensor parallelism (the group of the current SPMD mesh's ``tp``
axis), or plain whole logits. All three run the head's one-round vocab-parallel path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import losscodegen as lcg
from losscodegen import distributed

try:
    from torchtitan.components.loss import BaseLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.torchtitan needs torchtitan: pip install "losscodegen[titan]"') from e

__all__ = ["HeadLossFunction"]


class HeadLossFunction(BaseLoss):
    """A head as torchtitan's loss. ``Config(head=None)``: ``None`` is ``HeadLoss(CrossEntropy())``,
    torchtitan's own cross-entropy (``ignore_index=-100``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        head: lcg.HeadLoss | None = None
        """The head; its ``ignore_index`` must be torchtitan's -100."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        head = config.head if config.head is not None else lcg.HeadLoss(lcg.CrossEntropy())
        if not isinstance(head, lcg.HeadLoss):
            raise TypeError(f"HeadLossFunction.Config.head must be a losscodegen HeadLoss, got {type(head).__name__}")
        if head.ignore_index != -100:
            raise ValueError(f"head.ignore_index={head.ignore_index}: torchtitan marks ignored labels with -100")
        self.head = head

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this rank's rows' loss summed and divided by ``global_valid_tokens``, or summed without
        it; the head's terms and metrics). ``inputs``: the head's keyword inputs (advantages, ...);
        torchtitan's ``positions`` is dropped."""
        inputs.pop("positions", None)
        if global_valid_tokens is None:
            inputs["reduction"] = "sum"
        else:
            inputs["divisor"] = global_valid_tokens
        if distributed.is_dtensor(pred):
            from torch.distributed.tensor import Shard
            rows = [p for p in pred.placements if isinstance(p, Shard) and p.dim % pred.ndim != pred.ndim - 1]
            if rows:
                raise ValueError(f"HeadLossFunction: logits with rows sharded on the mesh ({pred.placements}, "
                                 "spmd_backend='full_dtensor'); torchtitan's loss is each rank's own rows' sum: use "
                                 "spmd_backend='partial_dtensor' or 'spmd_types'")
            out = self.head(pred, labels, **inputs)
            loss = out.loss.to_local()
        else:
            if spmd_mesh_size("tp") > 1:
                inputs["process_group"] = current_spmd_mesh().get_group("tp")
            out = self.head(pred, labels, **inputs)
            loss = out.loss
        return loss, {**out.terms, **out.metrics}
