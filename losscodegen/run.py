"""Stage 6, run: ``HeadLoss`` -- checks inputs, launches the planned kernels, wires autograd.

The forward launch also writes dL/dlogits for an upstream gradient of 1; backward only rescales it,
in place, with a kernel that reads the upstream gradient on the device and skips rows where it is
exactly 1 (the usual case), so no call synchronises with the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import sympy as sp
import torch
import triton
import triton.language as tl

from . import load as _load
from . import symbols as S
from .emit import emit
from .lower import Lowered, lower
from .plan import Plan, plan
from .terms import Term, bind

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_STANDARD_INPUTS = ("teacher_logits", "loss_mask", "teacher_topk_ids", "teacher_topk_logprobs",
                    "segment_ids", "process_group", "segment_group", "num_segments", "divisor",
                    "reduction")


@dataclass
class HeadOutput:
    """``loss``: fp32 scalar (or per-row with reduction="none"), differentiable w.r.t. the logits.
    ``terms`` and ``metrics``: detached fp32 scalars, unweighted."""

    loss: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@triton.jit
def _scale_rows(grad_ptr, grad_stride, g_ptr, g_stride, V, BLOCK_V: tl.constexpr):
    # dL/dlogits was written for an upstream gradient of 1: multiply by the real one, and skip the
    # row entirely when it is 1, which is the common case, without the host ever looking at it.
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr + row * g_stride)
    if g != 1.0:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ptr = grad_ptr + row * grad_stride + cols
            d = tl.load(ptr, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(ptr, (d * g).to(grad_ptr.dtype.element_ty), mask=cols < V)


def _block_v(V: int) -> int:
    return min(triton.next_power_of_2(V), 4096)


def _launch_config(V: int, tile: tuple[int, int], element_size: int = 2) -> dict:
    """The plan's tile (chosen for 2-byte logits and a large vocabulary), with as many bytes a tile
    for wider inputs, shrunk with its warps to a small vocabulary."""
    block_v, warps = tile[0] * 2 // max(element_size, 2), tile[1]
    block = min(triton.next_power_of_2(V), block_v)
    return dict(BLOCK_V=block, num_warps=max(4, warps * block // block_v))


class _HeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, head, inputs):
        loss, values, grad = head._compute(logits, inputs)
        ctx.grad = grad
        ctx.mark_non_differentiable(values)
        ctx.set_materialize_grads(False)  # no zero tensor for the values' (absent) gradient
        return loss, values

    @staticmethod
    def backward(ctx, grad_loss, _grad_values):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("HeadLoss: backward ran twice through the same call; its gradient "
                               "buffer is consumed by the first (call the head again instead)")
        ctx.grad = None
        if grad_loss is None:
            return None, None, None
        g = grad_loss.to(torch.float32).reshape(-1).contiguous()
        flat = grad.view(-1, grad.shape[-1])
        _scale_rows[(flat.shape[0],)](flat, flat.stride(0), g, 0 if g.numel() == 1 else 1,
                                      flat.shape[1], BLOCK_V=_block_v(flat.shape[1]))
        return grad, None, None


class HeadLoss(torch.nn.Module):
    """Several loss terms and metrics over the same logits, computed by one generated kernel.

    See CONTRACT.md: ``HeadLoss(*terms, metrics=(), ignore_index=-100, logit_scale=1.0,
    softcap=None, validate=True)``; call it with ``logits [..., V]``, ``labels [...]`` and the
    keyword inputs the terms need.
    """

    def __init__(self, *terms: Term, metrics: tuple[Term, ...] = (), ignore_index: int = -100,
                 logit_scale: float = 1.0, softcap: float | None = None, validate: bool = True):
        super().__init__()
        metrics = tuple(metrics)
        for t in terms + metrics:
            if not isinstance(t, Term):
                raise TypeError(f"HeadLoss takes terms such as lcg.CrossEntropy(), got {t!r} "
                                "(did you pass the class instead of calling it?)")
        for t in terms:
            if t.metric_only:
                raise ValueError(f"{t.name} is a metric only: pass it in metrics=(...)")
        names = [t.name for t in terms + metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"term names must be unique in a head, got {names}")
        if not terms and not metrics:
            raise ValueError("HeadLoss needs at least one term or metric")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        if not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        self.loss_terms, self.metric_terms = terms, metrics
        self.ignore_index, self.logit_scale, self.softcap = ignore_index, float(logit_scale), softcap
        self.validate = validate
        head = terms + metrics
        self._bound = tuple((t.name, bind(t, head), t in metrics) for t in head)
        self._launches: dict[tuple[bool, bool], tuple] = {}
        self._consts: dict[torch.device, _DeviceConsts] = {}
        self.spec_text = "\n".join(
            [f"{'metric' if m else 'loss'} {n} {sp.srepr(f)}" for n, f, m in self._bound]
            + [f"softcap {softcap is not None}"])
        self.key = _load.kernel_key(self.spec_text)

    @property
    def kernel(self) -> ModuleType:
        """The kernel module: from generated/, else the cache, else generated now (first use)."""
        return _load.load(self.key, lambda: self.source().text)

    # ---- the pipeline, for explain() and generation --------------------------------------------
    def lowered(self) -> Lowered:
        return lower(self._bound)

    def plan(self) -> Plan:
        return plan(self.lowered(), softcap=self.softcap is not None)

    def source(self):
        p = self.plan()
        return emit(p, self.key, _header(self._bound, p, self.softcap is not None))

    def explain(self) -> str:
        """Formulas, reductions, the derived gradient, the reads and the kernel file serving it."""
        p = self.plan()
        return "\n".join([
            "terms:", *[f"  {'metric' if m else 'loss  '} {n} = {f}" for n, f, m in self._bound],
            str(p.lowered), "plan:", *["  " + line for line in str(p).splitlines()],
            f"kernel: {_load.module_path(self.key)}"])

    # ---- call -----------------------------------------------------------------------------------
    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None, **inputs: Any) -> HeadOutput:
        reduction = inputs.get("reduction", "mean")
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        inputs = dict(inputs, labels=labels, reduction=reduction)
        if logits.requires_grad and torch.is_grad_enabled():
            loss, values = _HeadFunction.apply(logits, self, inputs)
        else:
            loss, values, _ = self._compute(logits, inputs, grad=False)
        n = len(self.loss_terms)
        names = [t.name for t in self.loss_terms + self.metric_terms]
        terms = {k: values[i] for i, k in enumerate(names[:n])}
        metrics = {k: values[n + i] for i, k in enumerate(names[n:])}
        return HeadOutput(loss, terms, metrics)

    def _compute(self, logits, inputs, grad=True):
        k = self.kernel
        unknown = set(inputs) - set(_STANDARD_INPUTS) - {"labels"} - set(k.TOKENS)
        known_tokens = {"advantages", "old_logprobs", "ref_logprobs"}
        if unknown - known_tokens:
            raise TypeError(f"HeadLoss got unexpected keyword argument(s) {sorted(unknown - known_tokens)}")
        x, rows_shape, V_local = _check_logits(logits)
        rows = x.shape[0]
        group = inputs.get("process_group")
        world, rank = _group_info(group)
        V = V_local * world
        dev = x.device
        labels = _check_rowwise("labels", inputs["labels"], rows_shape, dev, integer=True,
                                required=k.USES_LABELS)
        mask = _check_rowwise("loss_mask", inputs.get("loss_mask"), rows_shape, dev, boolean=True)
        if labels is not None and self.validate:
            bad = (labels != self.ignore_index) & ((labels < 0) | (labels >= V))
            if bool(bad.any()):
                raise ValueError(f"labels: values must be in [0, {V}) or ignore_index="
                                 f"{self.ignore_index}; found {labels[bad][0].item()}")
        tokens = {name: _check_rowwise(name, inputs.get(name), rows_shape, dev, required=True).float()
                  for name in k.TOKENS}
        teacher = None
        if k.USES_TEACHER:
            teacher = inputs.get("teacher_logits")
            if teacher is None:
                raise ValueError("teacher_logits is required by " + self._terms_needing("teacher_logits"))
            if not isinstance(teacher, torch.Tensor) or teacher.shape != logits.shape:
                raise ValueError(f"teacher_logits must have the logits' shape {tuple(logits.shape)}, "
                                 f"got {getattr(teacher, 'shape', type(teacher).__name__)}")
            if teacher.dtype not in _FLOATS or teacher.device != dev:
                raise TypeError(f"teacher_logits must be a float tensor on {dev}, got "
                                f"{teacher.dtype} on {teacher.device}")
            teacher = _rows_view(teacher.detach(), V_local)
        topk = None
        if k.USES_TOPK:
            topk = _check_topk(inputs, rows_shape, dev, self._terms_needing("teacher_topk_ids"))
        seg_ids = None
        if k.SEGMENTS:
            if inputs.get("segment_ids") is None:
                raise ValueError("segment_ids is required by " + self._terms_needing("segment_ids"))
            seg_ids = _check_rowwise("segment_ids", inputs["segment_ids"], rows_shape, dev, integer=True)
        valid = labels != self.ignore_index if labels is not None else None
        if mask is not None:
            valid = mask if valid is None else valid & mask
        if valid is None:
            valid = torch.ones(rows, dtype=torch.bool, device=dev)
        n_valid = valid.sum(dtype=torch.float32)

        divisor = inputs.get("divisor")
        reduction = inputs["reduction"]
        if isinstance(divisor, torch.Tensor):
            divisor = divisor.to(device=dev, dtype=torch.float32).reshape(())
        elif divisor is not None:  # a fill on the device, not a copy from the host
            divisor = torch.full((), float(divisor), device=dev)
        row_div = divisor if divisor is not None else n_valid.clamp_min(1.0)
        c = self._device_consts(dev)
        if k.SEGMENTS and reduction == "none":
            raise ValueError(f"reduction='none' has no per-row value for segment terms {k.SEGMENTS}")
        w_rows = c.row_weights / row_div if reduction == "mean" else c.row_weights

        n_values = len(k.ROW_VALUES)
        out_rows = torch.empty(rows, n_values, dtype=torch.float32, device=dev)
        stats = torch.empty(rows, len(k.COLUMNS), dtype=torch.float32, device=dev)
        grad_buf = torch.empty_like(x, memory_format=torch.contiguous_format) if grad else None
        seg_state: dict[str, torch.Tensor] = {}
        seg_values: dict[str, torch.Tensor] = {}
        args = dict(x=x, labels=labels, mask=mask, teacher=teacher, tokens=tokens, topk=topk,
                    w=w_rows, grad=grad_buf, rows=out_rows, stats=stats, segments=seg_state,
                    V_local=V_local, vocab_start=rank * V_local, V=V)
        for launch in self.plan_launches(sharded=group is not None, grad=grad):
            self._launch(launch, args)
            if launch.then == "merge":
                _merge_stats(stats, c, group, world)
            elif launch.then == "sum_exact":
                _sum_exact(stats, c.exact_columns, group)
            elif launch.then == "segments":
                seg_values = self._segments(k, out_rows, valid, seg_ids, inputs, c, divisor, dev, seg_state)
        if not seg_values and k.SEGMENTS:  # no gradient wanted: still the values
            seg_values = self._segments(k, out_rows, valid, seg_ids, inputs, c, divisor, dev, seg_state)

        values = out_rows.sum(0).index_select(0, c.value_columns) / row_div
        if seg_values:
            names = [t.name for t in self.loss_terms + self.metric_terms]
            values = torch.stack([seg_values[n] if n in seg_values else values[i]
                                  for i, n in enumerate(names)])
        n_loss = len(self.loss_terms)
        if reduction == "none":
            loss = (out_rows.index_select(1, c.row_term_columns) * c.row_weights).sum(1).reshape(rows_shape)
        else:
            loss = (values[:n_loss] * c.weights).sum() if n_loss else values.new_zeros(())
        grad_out = grad_buf.view(logits.shape) if grad else None
        return loss, values, grad_out

    def plan_launches(self, *, sharded: bool, grad: bool):
        key = (sharded, grad)
        if key not in self._launches:
            p = Plan(_MetaLowered(self.kernel), self.softcap is not None, ())
            self._launches[key] = p.launches(sharded=sharded, grad=grad)
        return self._launches[key]

    def _device_consts(self, dev: torch.device) -> _DeviceConsts:
        if dev not in self._consts:
            self._consts[dev] = _DeviceConsts.build(self, self.kernel, dev)
        return self._consts[dev]

    def _terms_needing(self, input_name: str) -> str:
        """The names of the head's terms that read ``input_name``, for error messages."""
        reads = {
            "teacher_logits": lambda f: f.has(S.teacher_logit) or any(a.args[1] != 0 for a in f.atoms(S.LSE)),
            "teacher_topk_ids": lambda f: f.has(S.topk_sum),
            "segment_ids": lambda f: f.has(S.segment_mean)}[input_name]
        return ", ".join(n for n, f, _ in self._bound if reads(f))

    def _launch(self, launch, a):
        k = self.kernel
        x = a["x"]
        rows = x.shape[0]
        dev = x.device
        dummy = torch.empty(1, dtype=torch.float32, device=dev)
        labels, mask = a["labels"], a["mask"]
        args = [x, x.stride(0), labels if labels is not None else dummy,
                mask if mask is not None else dummy]
        if k.USES_TEACHER:
            args += [a["teacher"], a["teacher"].stride(0)]
        args += [a["tokens"][t] for t in k.TOKENS]
        block_k = 1
        if k.USES_TOPK:
            ids, lps = a["topk"]
            args += [ids, lps, ids.stride(0), ids.shape[1]]
            block_k = triton.next_power_of_2(ids.shape[1])
        if k.SEGMENTS:
            seg = a["segments"]
            args += [seg.get("ids", dummy), seg.get("coefs", dummy)]
        grad = a["grad"] if launch.grad else None
        args += [a["w"], grad if grad is not None else x, grad.stride(0) if grad is not None else 0,
                 a["rows"], a["stats"], self.logit_scale, float(self.softcap or 1.0),
                 a["V_local"], a["vocab_start"], float(a["V"]), self.ignore_index]
        width = max(x.element_size(), a["teacher"].element_size() if k.USES_TEACHER else 0)
        kernel = getattr(k, f"head_loss_{k.KEY}")
        kernel[(rows,)](*args, HAS_LABELS=labels is not None, HAS_MASK=mask is not None,
                        STATS=launch.stats, EXACT=launch.exact, STORE_STATS=launch.store_stats,
                        ROWS=launch.rows, GRAD=launch.grad, BLOCK_K=block_k,
                        **_launch_config(a["V_local"], k.TILE, width))

    def _segments(self, k, out_rows, valid, seg, inputs, c, divisor, dev, seg_state):
        """Per-segment sums of the row quantities (one index_add_; with ``segment_group``, for
        segments split across sequence-parallel ranks, one all-reduce of them), then one launch
        of the generated segment kernel: each segment term's value, and per segment dL/du for
        the gradient launch. No host sync unless num_segments is unknown."""
        rows = out_rows.shape[0]
        group = inputs.get("segment_group")
        n_seg = inputs.get("num_segments")
        if n_seg is None:  # one sync (and a MAX all-reduce over segment_group); num_segments= avoids it
            top = torch.where(valid, seg, -1).max() if rows else torch.full((), -1, device=dev)
            if group is not None:
                _all_reduce(top, group, "max")
            n_seg = int(top.item()) + 1
        elif not isinstance(n_seg, int) or n_seg < 0:
            raise ValueError(f"num_segments must be a non-negative int, got {n_seg!r}")
        if self.validate and rows and bool((valid & ((seg < 0) | (seg >= n_seg))).any()):
            raise ValueError(f"segment_ids of valid rows must be in [0, num_segments={n_seg})")
        per_row = torch.cat([valid.float()[:, None], out_rows.index_select(1, c.segment_columns)], 1)
        slot = torch.where(valid, seg, n_seg)  # invalid rows go to a spill segment that is dropped
        sums = torch.zeros(n_seg + 1, per_row.shape[1], device=dev).index_add_(0, slot, per_row)
        if group is not None:
            _all_reduce(sums, group, "sum")
        values = torch.empty(len(k.SEGMENTS), device=dev)
        coefs = torch.empty(max(n_seg, 1), len(k.SEGMENT_MEANS), device=dev)
        div = divisor if divisor is not None else values  # values: a placeholder, not read
        getattr(k, f"segments_{k.KEY}")[(1,)](
            sums, n_seg, c.weights, div, values, coefs,
            HAS_DIVISOR=divisor is not None, BLOCK_S=min(triton.next_power_of_2(max(n_seg, 1)), 1024))
        seg_state["ids"], seg_state["coefs"] = seg.contiguous(), coefs
        return dict(zip(k.SEGMENTS, values))


@dataclass
class _DeviceConsts:
    """A head's constant tensors on one device, made once: indexing with Python lists would copy
    the indices from the host on every call, and such a copy waits for the device."""

    weights: torch.Tensor            # every loss term's weight
    row_weights: torch.Tensor        # the weights of the row (not segment) loss terms
    row_term_columns: torch.Tensor   # their columns of the per-row values
    value_columns: torch.Tensor      # the column of each reported term (0 for a segment term)
    segment_columns: torch.Tensor    # the columns of SEGMENT_MEANS
    exact_columns: torch.Tensor      # the packed stats summed by the exact all-reduce
    merge_is_max: torch.Tensor       # per packed column: merged by max (else by sum, unless below)
    merge_scaled: torch.Tensor       # the running sums, rescaled to the global maxima when merged
    merge_alpha: torch.Tensor        # their exponents' coefficients of m and m_t
    merge_beta: torch.Tensor
    m_column: int
    m_t_column: int | None
    argmax_column: int | None

    @staticmethod
    def build(head: HeadLoss, k: ModuleType, dev: torch.device) -> _DeviceConsts:
        col = {name: i for i, name in enumerate(k.ROW_VALUES)}
        row_terms = [t for t in head.loss_terms if t.name not in k.SEGMENTS]

        def on(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype).to(dev)
        rule = {name: r for name, r, _, _ in k.MERGE}
        cols = [name for name, _, _, _ in k.MERGE]
        scaled = [(j, a, b) for j, (_, r, a, b) in enumerate(k.MERGE) if r == "scaled"]
        return _DeviceConsts(
            weights=on([t.weight for t in head.loss_terms], torch.float32),
            row_weights=on([t.weight for t in row_terms], torch.float32),
            row_term_columns=on([col[t.name] for t in row_terms]),
            value_columns=on([col.get(t.name, 0) for t in head.loss_terms + head.metric_terms]),
            segment_columns=on([col[u] for u in k.SEGMENT_MEANS]),
            exact_columns=on([j for j, m in enumerate(k.MERGE) if m[1] == "sum" and m[0].startswith("acc")]),
            merge_is_max=on([rule[n] == "max" for n in cols], torch.bool),
            merge_scaled=on([j for j, _, _ in scaled]),
            merge_alpha=on([a for _, a, _ in scaled], torch.float32),
            merge_beta=on([b for _, _, b in scaled], torch.float32),
            m_column=cols.index("m"),
            m_t_column=cols.index("m_t") if "m_t" in rule else None,
            argmax_column=cols.index("argmax") if "argmax" in rule else None)


class _MetaLowered:
    """What ``Plan.launches`` needs, read off a loaded kernel module (no sympy at call time)."""

    def __init__(self, module: ModuleType):
        self.segments = module.SEGMENTS
        self.has_exact = module.HAS_EXACT


def _header(bound, p: Plan, softcap: bool) -> str:
    lines = ["# Generated by losscodegen -- do not edit; `python -m losscodegen generate` rewrites it.",
             "#", "# terms (per-row formulas):"]
    lines += [f"#   {'metric' if m else 'loss  '} {n} = {f}" for n, f, m in bound]
    lines += [f"# softcap: {softcap}", "#", "# lowered:"]
    lines += ["#   " + line for line in str(p.lowered).splitlines()]
    lines += ["#", "# plan:"] + ["#   " + line for line in str(p).splitlines()]
    return "\n".join(lines)


# ---- input checks --------------------------------------------------------------------------------
def _rows_view(t: torch.Tensor, V: int) -> torch.Tensor:
    """[..., V] as [rows, V] with unit column stride, copying only when no such view exists."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, V)
    except RuntimeError:
        return t.reshape(-1, V).contiguous()


def _check_logits(logits):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _FLOATS:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0, got shape {tuple(logits.shape)}")
    V = logits.shape[-1]
    return _rows_view(logits.detach(), V), tuple(logits.shape[:-1]), V


def _check_rowwise(name, t, rows_shape, device, *, integer=False, boolean=False, required=False):
    if t is None:
        if required:
            raise ValueError(f"{name} is required by this head's terms")
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(rows_shape):
        raise ValueError(f"{name} must have shape {tuple(rows_shape)} (the logits without the vocab "
                         f"dim), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logits are on {device}")
    if integer and (t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex()):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if boolean and t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {t.dtype}")
    if not (integer or boolean) and not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    t = t.reshape(-1)
    return (t.long() if integer else t).contiguous()


def _check_topk(inputs, rows_shape, device, needed_by: str):
    ids, lps = inputs.get("teacher_topk_ids"), inputs.get("teacher_topk_logprobs")
    for name, t in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps)):
        if t is None:
            raise ValueError(f"{name} is required by {needed_by}")
        if not isinstance(t, torch.Tensor) or tuple(t.shape[:-1]) != tuple(rows_shape) or t.dim() == 0:
            raise ValueError(f"{name} must have shape {tuple(rows_shape)} + (K,), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but logits are on {device}")
    if ids.shape != lps.shape:
        raise ValueError(f"teacher_topk_ids {tuple(ids.shape)} and teacher_topk_logprobs "
                         f"{tuple(lps.shape)} must have the same shape")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"teacher_topk_ids must be an integer tensor, got {ids.dtype}")
    if not lps.dtype.is_floating_point:
        raise TypeError(f"teacher_topk_logprobs must be a float tensor, got {lps.dtype}")
    K = ids.shape[-1]
    return ids.reshape(-1, K).long().contiguous(), lps.reshape(-1, K).float().contiguous()


# ---- vocab-parallel ----------------------------------------------------------------------------
def _group_info(group):
    if group is None:
        return 1, 0
    import torch.distributed as dist
    return dist.get_world_size(group), dist.get_rank(group)


def _merge_stats(stats: torch.Tensor, c: _DeviceConsts, group, world: int) -> None:
    """One all-gather of every rank's packed stats, merged locally by each column's rule, with a
    fixed number of tensor operations whatever the number of columns."""
    import torch.distributed as dist
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats.contiguous(), group=group)
    parts = torch.stack(gathered)                                   # [world, rows, columns]
    top = parts.amax(0)
    merged = torch.where(c.merge_is_max, top, parts.sum(0))        # "max" and "sum" columns
    # "scaled": each rank's running sum was taken relative to its own maxima; bring it to the global ones
    shift = (parts[:, :, c.m_column] - top[:, c.m_column])[:, :, None] * c.merge_alpha
    if c.m_t_column is not None:
        shift = shift + (parts[:, :, c.m_t_column] - top[:, c.m_t_column])[:, :, None] * c.merge_beta
    merged.index_copy_(1, c.merge_scaled, (parts.index_select(2, c.merge_scaled) * torch.exp(shift)).sum(0))
    if c.argmax_column is not None:  # the rank holding the first maximum
        owner = parts[:, :, c.m_column].argmax(0, keepdim=True)
        merged[:, c.argmax_column] = parts[:, :, c.argmax_column].gather(0, owner)[0]
    stats.copy_(merged)


def _sum_exact(stats: torch.Tensor, columns: torch.Tensor, group) -> None:
    part = stats.index_select(1, columns)
    _all_reduce(part, group, "sum")
    stats.index_copy_(1, columns, part)


def _all_reduce(t: torch.Tensor, group, op: str) -> None:
    import torch.distributed as dist
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
