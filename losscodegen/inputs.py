"""Input checks: one call's arguments, checked and normalised into a ``Call``.

Everything here looks at shapes, dtypes and devices only, never at values (that would wait for the
device): values are checked by the kernel itself (see ``validation.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import segments
from .interface import FileSpec
from .symbols import STANDARD_INPUTS  # (declared with the formula language: no token takes these names)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")
# tokens of the built-in policy terms: accepted (and ignored) by heads that do not read them, so
# that one training loop can pass them to any head
_POLICY_TOKENS = ("advantages", "old_logprobs", "ref_logprobs")
_ACCEPTED = frozenset(STANDARD_INPUTS + _POLICY_TOKENS)


def _quantile_rows_only(spec: FileSpec) -> bool:
    """Whether every segment term is a row term that reads batch quantiles alone (S.row_quantile):
    detached, so that each row's value and gradient are its own, as reduction="none" gives them."""
    quantiles = {name for name, _ in spec.segment_quantiles}
    return set(spec.segments) <= set(spec.segment_row_terms) and set(spec.segment_means) <= quantiles


@dataclass(slots=True)
class Call:
    """One call's inputs, checked: per-row tensors flat over the rows; the logits (and the teacher's)
    as ``[rows, V_local]`` views with unit column stride, or None under ``head.linear`` (which
    makes them a chunk of rows at a time)."""

    shape: tuple[int, ...]                  # the rows' shape (the labels' shape)
    V_local: int                            # this rank's vocabulary columns
    device: torch.device
    x: torch.Tensor | None
    labels: torch.Tensor | None             # int64 [rows]
    mask: torch.Tensor | None               # bool [rows]
    teacher: torch.Tensor | None            # [rows, V_local], read by the kernel only
    tokens: tuple[torch.Tensor, ...]        # fp32 [rows], in the kernel's TOKENS order
    topk_ids: torch.Tensor | None           # int64 [rows, K]
    topk_logprobs: torch.Tensor | None      # fp32 [rows, K]
    segment_ids: torch.Tensor | None        # int64 [rows]
    num_segments: int | None
    divisor: torch.Tensor | None            # fp32 0-d on the device
    reduction: str
    group: Any = None                       # vocab-parallel process group
    segment_group: Any = None               # sequence-parallel group for segment terms
    # reduction="none": (output index, divisor) of each class-weighted term, whose kernel value is
    # its rows' sum (inputs.class_weight_rows): out.terms holds that sum divided
    value_divisors: tuple[tuple[int, torch.Tensor], ...] = ()
    # the head's runtime scalars as this call's forward read them, where its backward launches
    # again and the head has tensor scalars (HeadLoss.keep_scalars): a later call may change them
    scalars: torch.Tensor | None = None
    vectors: tuple[torch.Tensor, ...] = ()  # fp32 [V] (the whole vocabulary), in the kernel's VECTORS order
    # whether the teacher's logits (head.linear: hidden, weight or bias) require grad in grad mode:
    # the call runs the head's kernel that writes their gradient too (HeadLoss.kernel_for)
    teacher_grad: bool = False
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = math.prod(self.shape)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor a launch reads (the user's inputs, or views of them). A backward that
        launches again (reduction="none", ``head.linear``'s) saves them for backward, so that one the
        user changed in place since the forward fails there with torch's "modified by an inplace
        operation" error instead of giving a gradient of other values."""
        return (self.x, self.teacher, self.labels, self.mask, *self.tokens, self.topk_ids, self.topk_logprobs,
                self.segment_ids, self.divisor, *self.vectors)


def check_call(head, spec: FileSpec, logits: Any, labels: Any, inputs: dict[str, Any]) -> Call:
    """Check ``head(logits, labels, **inputs)`` against what the head's kernel reads (its file's ``spec``)."""
    group = inputs.get("process_group") if inputs else None
    if group is not None and isinstance(logits, torch.Tensor) and logits.dim() >= 1 and logits.shape[-1] == 0:
        # a rank with an empty vocab shard still takes part in the shards' width exchange, which
        # then refuses the call on every rank (raising here alone would leave the others waiting)
        head.shard_columns(group, 0, logits.device)
    x, shape = check_logits(logits)
    if head.inplace_backward and not torch.compiler.is_compiling():
        if x.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            raise ValueError("inplace_backward=True needs logits whose rows can be viewed as [rows, V] "
                             f"with unit column stride (got strides {logits.stride()}); pass .contiguous() "
                             "logits")
        if x.shape[0] > 1 and x.stride(0) < x.shape[1]:
            raise ValueError("inplace_backward=True needs logits whose rows do not share memory (got "
                             f"shape {tuple(logits.shape)}, strides {logits.stride()}: expanded or "
                             "overlapping); pass .contiguous() logits or inplace_backward=False")
    teacher = None
    if spec.uses_teacher:
        teacher = inputs.get("teacher_logits")
        if teacher is None:
            raise ValueError("teacher_logits is required by " + head.terms_reading("teacher_logits"))
        if not isinstance(teacher, torch.Tensor) or teacher.shape != logits.shape:
            raise ValueError(f"teacher_logits must have the logits' shape {tuple(logits.shape)}, "
                             f"got {getattr(teacher, 'shape', type(teacher).__name__)}")
        if teacher.dtype not in _FLOATS or teacher.device != x.device:
            raise TypeError(f"teacher_logits must be a float tensor on {x.device}, got "
                            f"{teacher.dtype} on {teacher.device}")
        teacher_grad = teacher.requires_grad and torch.is_grad_enabled()
        teacher = rows_view(teacher, x.shape[1])
    call = check_rows(head, spec, shape, x.shape[1], x.device, labels, inputs, x=x, teacher=teacher)
    if teacher is not None:
        call.teacher_grad = teacher_grad
    if head.inplace_backward and x.numel() and not torch.compiler.is_compiling():
        refuse_aliases(call, spec)
    return call


def refuse_aliases(call: Call, spec: FileSpec) -> None:
    """inplace_backward=True: the kernel writes the gradient over the logits while it still reads the
    other inputs, so none of them may overlap the logits' memory (``teacher_logits=logits.detach()``, a
    self-distillation, would read gradient values as the teacher's); another part of their storage may."""
    lo, hi = _bytes(call.x)
    names = ("teacher_logits", "labels", "loss_mask", *spec.tokens, "teacher_topk_ids", "teacher_topk_logprobs",
             "segment_ids", "divisor", *spec.vectors)
    for name, t in zip(names, call.tensors()[1:], strict=True):
        if isinstance(t, torch.Tensor) and t.numel() and t.device == call.x.device \
                and _bytes(t)[0] < hi and lo < _bytes(t)[1]:
            raise ValueError(f"{name} shares the logits' memory, which inplace_backward=True overwrites with "
                             f"their gradient while {name} is still read: pass {name}.clone(), or build the "
                             "head with inplace_backward=False")


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    """The address range a non-empty tensor's elements lie in (first byte, past the last)."""
    last = sum((n - 1) * step for n, step in zip(t.shape, t.stride()))    # (torch strides are >= 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_rows(head, spec: FileSpec, shape: tuple[int, ...], V_local: int, dev: torch.device,
               labels: Any, inputs: dict[str, Any], *, x: torch.Tensor | None = None,
               teacher: torch.Tensor | None = None) -> Call:
    """Every input but the logits and the teacher's: the per-row ones shaped like ``shape``."""
    head.backend.check_device(dev)
    unknown = [k for k in inputs if k not in _ACCEPTED and k not in spec.vectors
               and (k not in spec.tokens or k in head.class_weight_tokens)] \
        if inputs else ()
    if unknown:
        raise TypeError(f"HeadLoss got unexpected keyword argument(s) {sorted(unknown)}")
    reduction = inputs.get("reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if spec.segments and reduction == "none" and not _quantile_rows_only(spec):
        raise ValueError(f"reduction='none' has no per-row value for segment terms {spec.segments}")
    if spec.segment_row_terms and inputs.get("segment_group") is not None:
        raise ValueError(f"segment_group: {spec.segment_row_terms} read(s) segment statistics per row, "
                         "whose gradient through the means needs every rank's rows: not supported "
                         "sequence-parallel yet (gather the segment's rows on one rank)")
    labels = check_rowwise("labels", labels, shape, dev, integer=True, required=spec.uses_labels,
                           needed_by=head.terms_reading)
    topk_ids = topk_logprobs = None
    if spec.uses_topk:
        topk_ids, topk_logprobs = check_topk(inputs, shape, dev, head.terms_reading)
    segment_ids, num_segments = None, None
    if spec.segments and inputs.get("segment_ids") is None \
            and set(spec.segment_means) <= {n for n, _ in spec.segment_quantiles}:
        # batch quantiles (S.row_quantile) alone: every row in one segment, whose slot holds them
        segment_ids, num_segments = torch.zeros(math.prod(shape), dtype=torch.int64, device=dev), 1
    elif spec.segments:
        if inputs.get("segment_ids") is None:
            raise ValueError("segment_ids is required by " + head.terms_reading("segment_ids"))
        segment_ids = check_rowwise("segment_ids", inputs["segment_ids"], shape, dev, integer=True)
        num_segments = inputs.get("num_segments")
        if num_segments is not None and (not isinstance(num_segments, int) or isinstance(num_segments, bool)
                                         or num_segments < 0):
            raise ValueError(f"num_segments must be a non-negative int, got {num_segments!r}")
        if num_segments == 0:
            # no segment: every valid row's id is out of range, and the kernel reports one; made
            # negative, since 0 is the flag buffer's clear value (validation.CLEAR)
            segment_ids = segment_ids.clamp(max=-1)
        elif num_segments is not None:
            segments.check_count(num_segments)
        elif inputs.get("segment_group") is None and not any(spec.normalization[n] == "sequence"
                                                           for n in spec.segments):
            # Ids of any size (global sample indices) where they only group rows: compacted on the
            # device, no host sync, at most one segment a row. (A normalize="sequence" term divides
            # by the number of ids, and a segment_group's ranks must agree on them: those count
            # them as they are, segments.count.)
            segment_ids, num_segments = segments.compact(segment_ids), math.prod(shape)
    mask = check_rowwise("loss_mask", inputs.get("loss_mask"), shape, dev, boolean=True)
    divisor = check_divisor(inputs.get("divisor"), reduction, dev)
    tokens, value_divisors = [], []
    for name in spec.tokens:
        if name in head.class_weight_tokens:
            rows, value_divisor = class_weight_rows(head, name, labels, mask, V_local, divisor, reduction, inputs)
            if value_divisor is not None:
                value_divisors.append((spec.outputs.index(head.class_weight_tokens[name][0]), value_divisor))
        else:
            rows = check_rowwise(name, inputs.get(name), shape, dev, required=True, needed_by=head.terms_reading)
        tokens.append(rows)
    # the whole vocabulary's size: under vocab parallelism, from every rank's width (shards of any
    # width: 61 columns as 31 + 30), so that a wrong vector is refused alike on every rank
    vectors = ()
    if spec.vectors:
        n_vocab = head.shard_columns(inputs.get("process_group"), V_local, dev)[1]
        vectors = tuple(check_vector(name, inputs.get(name), n_vocab, dev, head.terms_reading)
                        for name in spec.vectors)
    # (by position, in the fields' order: a dataclass's keywords cost a microsecond a call)
    return Call(shape, V_local, dev, x, labels, mask, teacher, tuple(tokens), topk_ids, topk_logprobs,
                segment_ids, num_segments, divisor, reduction, inputs.get("process_group"),
                inputs.get("segment_group"), tuple(value_divisors), None, vectors)


def check_vector(name: str, value: Any, V: int, dev: torch.device, needed_by) -> torch.Tensor:
    """A per-class input (``S.vector``): a 1-D float tensor over the whole vocabulary of ``V``
    classes (on a vocab shard too), fp32 contiguous for the kernel."""
    if value is None:
        raise ValueError(f"{name} is required by {needed_by(name)}")
    if not isinstance(value, torch.Tensor) or value.shape != (V,) or not value.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of shape ({V},) (one value per class of the whole "
                         f"vocabulary), got " + (f"{value.dtype} of shape {tuple(value.shape)}"
                                                  if isinstance(value, torch.Tensor) else type(value).__name__))
    if value.device != dev:
        raise ValueError(f"{name} must be on {dev}, got {value.device}")
    refuse_grad(name, value)
    return value.float().contiguous()


def refuse_grad(name: str, t: torch.Tensor) -> None:
    """A ValueError for an input other than the logits and the teacher's (``head.linear``'s hidden,
    weight and bias, and the teacher's) that requires grad in grad mode: the kernel derives no
    gradient for it, and a silent zero (its .grad left None) would never train it. (A term's tensor
    weight is learnable: HeadLoss's ``_learnable_weights``.) Two host attributes: no wait for the device."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but losscodegen gives it no gradient (only the logits, the "
                         f"teacher's logits, head.linear's hidden, weight and bias and the teacher's, and a "
                         f"term's tensor weight get one): pass {name}.detach()")


def class_weight_rows(head, token: str, labels: torch.Tensor, mask: torch.Tensor | None, V_local: int,
                      divisor: torch.Tensor | None, reduction: str,
                      inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-row token of a term with class weights (``S.class_weight``): its ``class_weight`` at
    each valid row's label (0 on the others), divided by the term's divisor where the call takes a
    mean: the call's ``divisor``, else the valid rows' sum of class weights (a sum of 0 divides
    nothing: every row's weight is 0 then). The kernel sums the term's rows (``kernel_normalize``),
    so ``F.cross_entropy(weight=)``'s mean is its sum of these. Under reduction="none" the rows keep
    their class weights undivided (torch's per-row values) and the divisor comes back second, for
    the term's value in ``out.terms`` (``Call.value_divisors``). A few small ops on [rows], no wait
    for the device; under vocab parallelism ``class_weight`` covers the whole vocabulary, as the
    labels do, and every rank computes the same."""
    term, mean_of_rows = head.class_weight_tokens[token]
    weights = getattr(head, f"class_weight_{term}")
    vocab = head.shard_columns(inputs.get("process_group"), V_local, labels.device)[1]
    if weights.shape[0] != vocab:
        raise ValueError(f"class_weight of {term} must have one weight per class of the vocabulary "
                         f"({vocab}), got {weights.shape[0]}")
    if weights.device != labels.device:
        raise ValueError(f"class_weight of {term} is on {weights.device} but logits are on {labels.device} "
                         "(head.to(device) moves it)")
    valid = labels != head.ignore_index
    if mask is not None:
        valid = valid & mask
    # (clamped: a label outside the vocabulary reads no memory out of bounds; the kernel flags it)
    rows = weights[labels.clamp(0, weights.shape[0] - 1)].float() * valid   # (weights are finite: checked)
    if reduction == "sum" or not mean_of_rows:
        return rows, None
    div = divisor if divisor is not None else rows.sum().clamp_min(torch.finfo(torch.float32).tiny)
    return (rows, div) if reduction == "none" else (rows / div, None)


def check_divisor(divisor: Any, reduction: str, device: torch.device, *, name: str = "divisor") -> torch.Tensor | None:
    """``divisor`` as an fp32 0-d tensor on ``device``; errors name it ``name`` (an integration's
    argument that becomes the divisor)."""
    if divisor is None:
        return None
    if reduction == "sum":
        raise ValueError(f"{name}= and reduction='sum' contradict each other (sum is divisor=1)")
    if isinstance(divisor, torch.Tensor):
        if divisor.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(divisor.shape)}")
        if divisor.dtype == torch.bool:     # (as a Python bool is refused: True would divide by 1)
            raise TypeError(f"{name} must be a number or a numeric tensor, got a bool tensor")
        refuse_grad(name, divisor)
        return divisor.to(device=device, dtype=torch.float32).reshape(())
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(divisor).__name__}")
    if not 0 < divisor < math.inf:     # (a tensor's value is not looked at: that would wait for it)
        raise ValueError(f"{name} must be a positive finite number, got {divisor!r}")
    return torch.full((), float(divisor), device=device)  # a fill on the device, not a host copy


def rows_view(t: torch.Tensor, V: int) -> torch.Tensor:
    """[..., V] as [rows, V] with unit column stride, copying only when no such view exists (and
    without a torch op when ``t`` is one already: this runs on every call)."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    t = t.detach()
    return (t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, V)


def check_logits(logits: Any, name: str = "logits") -> tuple[torch.Tensor, tuple[int, ...]]:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must be [..., V] with V > 0, got shape {tuple(logits.shape)}")
    return rows_view(logits, logits.shape[-1]), tuple(logits.shape[:-1])


def check_rowwise(name: str, t: Any, rows_shape: tuple[int, ...], device: torch.device, *,
                  integer: bool = False, boolean: bool = False, required: bool = False,
                  needed_by: Callable[[str], str] | None = None) -> torch.Tensor | None:
    """A per-row input shaped like the labels, flat and contiguous: int64 (``integer``), bool
    (``boolean``) or fp32; ``needed_by(name)`` names the terms that read it (called only for the
    error message)."""
    if t is None:
        if required:
            raise ValueError(f"{name} is required by {needed_by(name) if needed_by else 'this head'}")
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != rows_shape:
        raise ValueError(f"{name} must have shape {tuple(rows_shape)} (the logits without the vocab "
                         f"dim), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logits are on {device}")
    refuse_grad(name, t)
    want = torch.int64 if integer else torch.bool if boolean else torch.float32
    if t.dtype != want:     # (the checks below only where a conversion is due: this runs every call)
        if integer and (t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex()):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if boolean:
            raise TypeError(f"{name} must be a bool tensor, got {t.dtype}")
        if not integer and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
        t = t.to(want)
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()


def check_topk(inputs: dict[str, Any], rows_shape: tuple[int, ...], device: torch.device,
               needed_by: Callable[[str], str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, lps = inputs.get("teacher_topk_ids"), inputs.get("teacher_topk_logprobs")
    for name, t in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps)):
        if t is None:
            raise ValueError(f"{name} is required by {needed_by('teacher_topk_ids')}")
        if not isinstance(t, torch.Tensor) or tuple(t.shape[:-1]) != tuple(rows_shape) or t.dim() == 0:
            raise ValueError(f"{name} must have shape {tuple(rows_shape)} + (K,), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but logits are on {device}")
    if ids.shape != lps.shape:
        raise ValueError(f"teacher_topk_ids {tuple(ids.shape)} and teacher_topk_logprobs "
                         f"{tuple(lps.shape)} must have the same shape")
    if ids.shape[-1] == 0:
        raise ValueError(f"teacher_topk_ids and teacher_topk_logprobs must hold K >= 1 candidates a row, got "
                         f"shape {tuple(ids.shape)} (K = 0)")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"teacher_topk_ids must be an integer tensor, got {ids.dtype}")
    if not lps.dtype.is_floating_point:
        raise TypeError(f"teacher_topk_logprobs must be a float tensor, got {lps.dtype}")
    refuse_grad("teacher_topk_logprobs", lps)
    K = ids.shape[-1]
    return ids.reshape(-1, K).long().contiguous(), lps.reshape(-1, K).float().contiguous()
