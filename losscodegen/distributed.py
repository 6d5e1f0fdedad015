"""PyTorch's distributed engines: DTensor logits, weights and hidden states (tensor, sequence and data
parallelism over a ``DeviceMesh``), and weights sharded by FSDP2 (docs/distributed.md).

A head called on DTensors runs the head on the local tensors, with the mesh dimensions' groups as its
vocab-parallel ``process_group`` and sequence-parallel ``segment_group``, and gives back DTensors:

- a mesh dimension that shards the last dim (the vocabulary) is the vocab-parallel path over its group
  (the packed stats exchanged once);
- a mesh dimension that shards another dim shards the rows: the local call gets the global divisor
  (one all-reduce of the valid-row count first, unless ``divisor=`` is given) and its loss, terms and
  metrics are summed over the group afterwards (one all-reduce of one packed vector, whose backward
  is the identity: each rank's rows get the gradient of the global loss);
- a replicated mesh dimension needs nothing.

Nothing here is imported by ``import losscodegen``: ``is_dtensor`` looks for DTensor only where
``torch.distributed.tensor`` is loaded already (no DTensor can exist otherwise)."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import collectives
from .inputs import _POLICY_TOKENS
from .terms import kernel_normalize

# the keyword inputs laid out as the rows: shaped like the labels, or [..., K] (the teacher's top-k);
# besides these, the head's own per-row tokens (the teacher's logits are laid out as the logits)
_ROW_INPUTS = ("loss_mask", "segment_ids", "teacher_topk_ids", "teacher_topk_logprobs", *_POLICY_TOKENS)


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@dataclass(frozen=True)
class _Layout:
    """How a DTensor's mesh dimensions split a head's call: ``rows`` the mesh dimensions that shard
    the rows, ``vocab`` the one that shards the vocabulary (or None); ``placements`` the rows' own
    (the logits' without the vocabulary shard, Shard dims counted from the front)."""

    mesh: Any
    rows: tuple[int, ...]
    vocab: int | None
    placements: tuple          # per-row inputs'
    logits_placements: tuple   # the logits' (and the teacher's), normalised

    @property
    def vocab_group(self) -> Any:
        return None if self.vocab is None else self.mesh.get_group(self.vocab)

    @property
    def row_groups(self) -> list:
        return [self.mesh.get_group(d) for d in self.rows]


# (both kept per mesh and layout: a training run brings the same few at every step)
@functools.lru_cache(maxsize=64)
def _layout(mesh: Any, placements: tuple, ndim: int, what: str, *, vocab_dim: int) -> _Layout:
    """The layout of a tensor whose dim ``vocab_dim`` (of ``ndim``) is the vocabulary: every mesh
    dimension must be Replicate or a plain Shard; at most one shards the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    rows, vocab, normal = [], [], []
    for i, p in enumerate(placements):
        if type(p) is Shard:
            dim = p.dim % ndim
            (vocab if dim == vocab_dim else rows).append(i)
            normal.append(Shard(dim))
        elif p.is_replicate():
            normal.append(p)
        else:
            raise ValueError(f"losscodegen: {what} has placement {p} on mesh dimension {i}{_mesh_name(mesh, i)}; "
                             "a head takes Shard (rows or vocabulary) or Replicate there (redistribute first: a "
                             "Partial tensor is a sum still to be made)")
    if len(vocab) > 1:
        raise ValueError(f"losscodegen: {what} shards the vocabulary over mesh dimensions {vocab} ({placements}); "
                         "a head takes it sharded over one")
    rows_placements = tuple(Replicate() if i in vocab else p for i, p in enumerate(normal))
    return _Layout(mesh, tuple(rows), vocab[0] if vocab else None, rows_placements, tuple(normal))


def _mesh_name(mesh: Any, i: int) -> str:
    names = mesh.mesh_dim_names
    return f" ({names[i]!r})" if names else ""


@functools.lru_cache(maxsize=64)
def _check_vocab(layout: _Layout, V: int, what: str) -> None:
    """The vocab-parallel path's shards are equal and in rank order: rank r of the mesh dimension's
    group holds columns [r*V/n, (r+1)*V/n). Decided from the global shape and the whole mesh, which
    every rank holds alike, so the error is the same on every rank."""
    i = layout.vocab
    n = layout.mesh.size(i)
    if V % n:
        raise ValueError(f"losscodegen: {what} shards a vocabulary of {V} over {n} ranks of mesh dimension {i}"
                         f"{_mesh_name(layout.mesh, i)} unevenly; pad the vocabulary to a multiple of {n}")
    ranks = layout.mesh.mesh.movedim(i, -1).reshape(-1, n)
    if not bool((ranks.diff(dim=1) > 0).all()):
        raise ValueError(f"losscodegen: mesh dimension {i}{_mesh_name(layout.mesh, i)} lists its ranks out of "
                         "order; the vocab-parallel path needs shard r on the group's rank r")


def _offsets(shape: tuple[int, ...], layout: _Layout, placements: tuple) -> tuple[slice, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    size, start = compute_local_shape_and_global_offset(shape, layout.mesh, placements)
    return tuple(slice(o, o + s) for o, s in zip(start, size))


def _local(name: str, t: Any, layout: _Layout, placements: tuple, local_shape: tuple[int, ...]) -> Any:
    """This rank's part of an input laid out with ``placements`` over the layout's mesh: a DTensor's
    local tensor (redistributed first where it is laid out otherwise: the collective DTensor would
    make); a plain tensor of the global shape sliced to this rank's part; any other plain tensor as
    it is (this rank's part already; a wrong shape is named by the head's checks)."""
    if is_dtensor(t):
        if t.device_mesh != layout.mesh:
            raise ValueError(f"losscodegen: {name} is a DTensor on {t.device_mesh}, the logits on {layout.mesh}")
        if _normal(t.placements, t.ndim) != placements:
            t = t.redistribute(layout.mesh, placements)
        return t.to_local()
    if isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape[:len(local_shape)]) != local_shape:
        global_shape = tuple(t.shape)
        return t[_offsets(global_shape, layout, placements)]
    return t


def _normal(placements: tuple, ndim: int) -> tuple:
    from torch.distributed.tensor import Shard
    return tuple(Shard(p.dim % ndim) if type(p) is Shard else p for p in placements)


def _valid_rows(head, labels: torch.Tensor | None, mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """This rank's number of valid rows (fp32, [1]): the default divisor's count."""
    if labels is not None:
        valid = labels != head.ignore_index
        if mask is not None:
            valid = valid & mask.bool()
    elif mask is not None:
        valid = mask.bool()
    else:
        return torch.full((1,), float(like.numel() // like.shape[-1]), device=like.device)
    return valid.sum(dtype=torch.float32).reshape(1)


class _SumOverRanks(torch.autograd.Function):
    """Sums ``t`` over ``groups`` in place of a copy. Backward is the identity: every rank calls
    backward on the same (replicated) sum, and its own part's gradient is the sum's."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, groups: list) -> torch.Tensor:
        out = t.clone()
        for g in groups:
            collectives.all_reduce(out, g)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumGradOverRanks(torch.autograd.Function):
    """The identity, whose backward sums the gradient over ``groups``: a weight replicated over the mesh
    dimensions that shard the rows gets every rank's rows' share."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, groups: list) -> torch.Tensor:
        ctx.groups = groups
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        for g in ctx.groups:
            collectives.all_reduce(grad, g)
        return grad, None


def _refuse_groups(inputs: dict[str, Any]) -> None:
    for key in ("process_group", "segment_group"):
        if inputs.get(key) is not None:
            raise ValueError(f"losscodegen: {key}= with DTensor inputs: the mesh decides the groups (pass local "
                             "tensors to choose them yourself)")


def _local_inputs(head, layout: _Layout, rows_local: tuple[int, ...], labels: Any,
                  inputs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Every input but the logits (and ``teacher_logits``) made local, and the groups the local call
    takes from the mesh."""
    spec = head.kernel.SPEC
    labels = _local("labels", labels, layout, layout.placements, rows_local)
    local = dict(inputs)
    for name in (*_ROW_INPUTS, *spec.tokens):
        if local.get(name) is not None:
            local[name] = _local(name, local[name], layout, layout.placements, rows_local)
    if is_dtensor(local.get("divisor")):
        local["divisor"] = local["divisor"].full_tensor()
    local["process_group"] = layout.vocab_group
    if spec.segments and layout.rows:
        if len(layout.rows) > 1:
            raise ValueError(f"losscodegen: segment terms {spec.segments} with rows sharded over mesh dimensions "
                             f"{layout.rows}: a head sums segments over one group (shard the rows over one)")
        local["segment_group"] = layout.row_groups[0]
    return labels, local


def _rows_divisor(head, layout: _Layout, labels: Any, local: dict[str, Any], like: torch.Tensor) -> None:
    """Rows sharded, a mean without ``divisor=``: the global number of valid rows, as the divisor of
    the local call (one all-reduce of one number per row dimension)."""
    reduction = local.get("reduction", "mean")
    if not layout.rows or reduction == "sum" or local.get("divisor") is not None:
        return
    weighted = [t.name for t in head.loss_terms if t.class_weight is not None and t.normalize == "tokens"]
    if weighted:    # (reduction="none" too: their out.terms value is that mean)
        raise ValueError(f"losscodegen: class-weighted terms {weighted} with rows sharded over the mesh: their "
                         "mean divides by the global sum of class weights, which the head does not gather; pass "
                         "divisor= (that sum) or reduction='sum'")
    if reduction == "none":
        return      # (no divisor in the rows; token terms' values are combined as means)
    tokens = [t.name for t in head.loss_terms if kernel_normalize(t) == "tokens"]
    segments = [n for n in tokens if n in head.kernel.SPEC.segments]
    if len(segments) == len(tokens):
        return   # (a segment mean's default divisor is its segments' count, global already)
    if segments:
        raise ValueError(f"losscodegen: {segments} (a mean over segments) beside token means "
                         f"{[n for n in tokens if n not in segments]} with rows sharded over the mesh: a divisor "
                         "would apply to both; pass divisor= (the global divisor both take)")
    count = _valid_rows(head, labels, local.get("loss_mask"), like)
    for g in layout.row_groups:
        collectives.all_reduce(count, g)
    local["divisor"] = count.clamp_min(1.0)


def _globalise(head, out, layout: _Layout, labels: Any, local: dict[str, Any], like: torch.Tensor,
               wrap_rows: Callable[[torch.Tensor], Any], wrap_scalar: Callable[[torch.Tensor], Any]):
    """The local call's output made the global one. Rows sharded: one all-reduce per row dimension
    of [the loss, the summed terms, the metrics times this rank's valid rows, those rows]. A segment
    term is global already (its segments were summed over the group) and stays out of the sum."""
    HeadOutput = type(out)     # (head.py's, which imports this module)
    reduction = local.get("reduction", "mean")
    per_row = reduction == "none"
    if layout.rows:
        segment = set(head.kernel.SPEC.segments)
        counted = per_row and local.get("divisor") is None   # token terms are local means then
        names = [t.name for t in head.loss_terms]
        count = _valid_rows(head, labels, local.get("loss_mask"), like)
        summed = [t.name for t in head.loss_terms if t.name not in segment and not
                  (counted and kernel_normalize(t) == "tokens")]
        means = [n for n in names if n not in segment and n not in summed] + list(out.metrics)
        values = {**out.terms, **out.metrics}
        loss = out.loss
        fixed = sum((_weight(t) * out.terms[t.name] for t in head.loss_terms if t.name in segment),
                    torch.zeros((), device=like.device))
        parts = [] if per_row else [(loss - fixed).reshape(1)]
        parts += [values[n].reshape(1) for n in summed] + [values[n].reshape(1) * count for n in means] + [count]
        total = _SumOverRanks.apply(torch.cat(parts), layout.row_groups)
        if not per_row:
            loss, total = total[0] + fixed, total[1:]
        total = total.detach()
        new = dict(zip(summed, total[:len(summed)].unbind()))
        new.update(zip(means, (total[len(summed):-1] / total[-1].clamp_min(1.0)).unbind()))
        new.update({n: out.terms[n] for n in names if n in segment})
        out = HeadOutput(loss, {n: new[n] for n in names}, {n: new[n] for n in out.metrics}, out.rows)
    if per_row:
        return HeadOutput(wrap_rows(out.loss), out.terms, out.metrics, {n: wrap_rows(r) for n, r in out.rows.items()})
    return HeadOutput(wrap_scalar(out.loss), out.terms, out.metrics, out.rows)


def _weight(term) -> Any:
    w = term.weight
    return w.detach() if isinstance(w, torch.Tensor) else float(w)


def forward(head, logits: Any, labels: Any, inputs: dict[str, Any]):
    """``head(logits, labels, **inputs)`` with DTensor logits: the loss a replicated DTensor (as
    torch's ``loss_parallel`` gives it), ``reduction="none"``'s rows DTensors laid out as the rows,
    the terms and metrics plain tensors (equal on every rank); the gradient has the logits' placement."""
    from torch.distributed.tensor import DTensor, Replicate
    _refuse_groups(inputs)
    ndim = logits.ndim
    layout = _layout(logits.device_mesh, logits.placements, ndim, "logits", vocab_dim=ndim - 1)
    if layout.vocab is not None:
        _check_vocab(layout, logits.shape[-1], "logits")
    x = logits.to_local()
    rows_local = tuple(x.shape[:-1])
    labels, local = _local_inputs(head, layout, rows_local, labels, inputs)
    if local.get("teacher_logits") is not None:
        local["teacher_logits"] = _local("teacher_logits", local["teacher_logits"], layout,
                                         layout.logits_placements, tuple(x.shape))
    _rows_divisor(head, layout, labels, local, x)
    out = head(x, labels, **local)
    mesh = layout.mesh
    replicated = (Replicate(),) * mesh.ndim
    return _globalise(head, out, layout, labels, local, x,
                      lambda r: DTensor.from_local(r, mesh, layout.placements, run_check=False,
                                                   shape=logits.shape[:-1], stride=_contiguous(logits.shape[:-1])),
                      lambda s: DTensor.from_local(s, mesh, replicated, run_check=False))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


# ---- head.linear ------------------------------------------------------------------------------------
def linear(head, hidden, weight, labels, bias, teacher_hidden, teacher_weight, teacher_bias, chunk_rows,
           inputs: dict[str, Any]):
    """``head.linear`` where the weight or the hidden states are DTensors.

    - A weight that FSDP2 manages (``fully_shard`` of a module holding it): the call runs as that
      module's forward, so FSDP's own hooks gather the weight (its mixed precision, its resharding),
      and reduce-scatter its gradient.
    - A weight ``Shard(0)`` on a mesh dimension (a tensor-parallel lm_head): the vocab-parallel fused
      path over that dimension's group, the hidden states replicated over it (redistributed to
      Replicate there when they are a DTensor laid out otherwise); hidden states sharded by rows on
      the other mesh dimensions are data/sequence parallel as in ``forward``.
    """
    for param in (weight, teacher_weight):
        owner = _fsdp_owner(param) if is_dtensor(param) else None
        if owner is not None:
            module, live = owner
            return through_module(module, lambda h: head.linear(
                h, live(weight), labels, bias=live(bias), teacher_hidden=teacher_hidden,
                teacher_weight=live(teacher_weight), teacher_bias=live(teacher_bias), chunk_rows=chunk_rows,
                **inputs), hidden)
    from torch.distributed.tensor import DTensor, Replicate
    _refuse_groups(inputs)
    if is_dtensor(weight):
        mesh = weight.device_mesh
        wl = _layout(mesh, weight.placements, 2, "weight", vocab_dim=0)
        if wl.rows:
            raise ValueError(f"losscodegen: weight has placements {weight.placements}: a [V, H] weight is sharded "
                             "over the vocabulary (Shard(0)) or replicated; gather the hidden dimension first")
        vocab = wl.vocab
        if vocab is not None:
            _check_vocab(wl, weight.shape[0], "weight")
    else:
        mesh, vocab = hidden.device_mesh, None
    if is_dtensor(hidden):
        if hidden.device_mesh != mesh:
            raise ValueError(f"losscodegen: hidden is on {hidden.device_mesh}, weight on {mesh}")
        placements = list(_normal(hidden.placements, hidden.ndim))
        if vocab is not None and not placements[vocab].is_replicate():
            placements[vocab] = Replicate()
            hidden = hidden.redistribute(mesh, placements)
        layout = _layout(mesh, tuple(placements), hidden.ndim, "hidden", vocab_dim=hidden.ndim - 1)
        if layout.vocab is not None:
            raise ValueError(f"losscodegen: hidden is sharded over its hidden dimension ({hidden.placements}); "
                             "a fused linear head takes it whole on every rank")
        layout = _Layout(mesh, layout.rows, vocab, layout.placements, layout.placements)
        h = hidden.to_local()
        rows_global, rows_local = tuple(hidden.shape[:-1]), tuple(h.shape[:-1])
    else:
        layout = _Layout(mesh, (), vocab, (Replicate(),) * mesh.ndim, (Replicate(),) * mesh.ndim)
        h, rows_global = hidden, tuple(hidden.shape[:-1])
        rows_local = rows_global

    def local_weight(name: str, t: Any) -> Any:
        if not is_dtensor(t):
            return t
        if t.device_mesh != mesh or _normal(t.placements, t.ndim) != _normal(weight.placements, weight.ndim):
            raise ValueError(f"losscodegen: {name} must be laid out as weight ({weight.placements} on {mesh}), "
                             f"got {t.placements} on {t.device_mesh}")
        return t.to_local()

    w, b = local_weight("weight", weight), local_weight("bias", bias)
    if layout.rows and is_dtensor(weight):   # (replicated over the row dimensions: _layout refused others)
        w, b = [t if t is None or not t.requires_grad else _SumGradOverRanks.apply(t, layout.row_groups)
                for t in (w, b)]
    tw, tb = local_weight("teacher_weight", teacher_weight), local_weight("teacher_bias", teacher_bias)
    th = _local("teacher_hidden", teacher_hidden, layout, layout.placements, rows_local) \
        if teacher_hidden is not None else None
    labels, local = _local_inputs(head, layout, rows_local, labels, inputs)
    _rows_divisor(head, layout, labels, local, h)
    out = head.linear(h, w, labels, bias=b, teacher_hidden=th, teacher_weight=tw, teacher_bias=tb,
                      chunk_rows=chunk_rows, **local)
    if not is_dtensor(hidden):
        return out
    replicated = (Replicate(),) * mesh.ndim
    return _globalise(head, out, layout, labels, local, h,
                      lambda r: DTensor.from_local(r, mesh, layout.placements, run_check=False,
                                                   shape=rows_global, stride=_contiguous(rows_global)),
                      lambda s: DTensor.from_local(s, mesh, replicated, run_check=False))


def _fsdp_owner(param: Any) -> tuple[torch.nn.Module, Callable[[Any], Any]] | None:
    """Where FSDP2 manages ``param`` as a sharded parameter: (the module ``fully_shard`` was applied
    to, a function giving each of that module's sharded parameters its current value, the gathered
    one while the module's forward runs, and anything else as it is); None otherwise."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError as e:  # (a torch that moved it: the weight's kind cannot be told, so no guess)
        raise RuntimeError("losscodegen: a DTensor weight, and FSDP's record of its parameters "
                           "(torch.distributed._composable_state) is not where this torch keeps it") from e
    for module, state_ref in list(_module_state_mapping.items()):
        held = {id(p.sharded_param): p._module_info for group in _fsdp_param_groups(module, state_ref())
                for p in group.fsdp_params}
        if id(param) in held:
            def live(t: Any) -> Any:
                info = held.get(id(t))
                return t if info is None else getattr(info.module, info.param_name)
            return module, live
    return None


def _fsdp_param_groups(module: torch.nn.Module, state: Any) -> list[Any]:
    """The parameter groups of one composable state (``fully_shard``'s, or another API's: none).
    Torch 2.13 keeps a list (``_fsdp_param_groups``), earlier ones a single group or None
    (``_fsdp_param_group``). Not finding an FSDP state's groups must not pass for "no FSDP": the
    weight would be taken for a tensor-parallel shard, each rank's batch mixed with the others'."""
    from torch.distributed.fsdp import FSDPModule   # (loaded: the caller saw torch.distributed.fsdp)
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if state is None:        # (a module collected since: its weights are no longer in use)
        return []
    group = vars(state).get("_fsdp_param_group")
    if group is not None or "_fsdp_param_group" in vars(state):
        return [] if group is None else [group]
    if isinstance(module, FSDPModule) or type(state).__name__ == "FSDPState":
        raise RuntimeError("losscodegen: an FSDP2 state without parameter groups where this torch keeps them "
                           "(_fsdp_param_groups / _fsdp_param_group): which weights FSDP shards cannot be told")
    return []


def through_module(module: torch.nn.Module, fn: Callable[[torch.Tensor], Any], hidden: torch.Tensor):
    """``fn(hidden)`` run as ``module``'s forward, so that the hooks the engine wrapping ``module``
    put on it run around it (FSDP2: its parameters gathered before, resharded after, their gradients
    reduce-scattered in backward; inputs cast by its mixed-precision policy). ``fn`` returns a head's
    output; the hooks see its tensors (a tuple and dicts, which they flatten: a dataclass they would
    not), so that FSDP's pre-backward hook gathers the parameters again where a deferred backward
    (``reduction="none"``) reads them."""
    kind: list = []

    def flat(h: torch.Tensor) -> tuple:
        out = fn(h)
        kind.append(type(out))
        return out.loss, out.terms, out.metrics, out.rows
    had = "forward" in vars(module)
    previous = vars(module).get("forward")
    module.forward = flat      # (an instance attribute: nn.Module.__call__ calls self.forward)
    try:
        loss, terms, metrics, rows = module(hidden)
        return kind[0](loss, terms, metrics, rows)
    finally:
        if had:
            module.forward = previous
        else:
            del module.forward
