"""Launching a head's kernels: the per-call workspace, the plan's launches with what the host does
between them, and the arguments of each launch, passed by the names the kernel declares. What runs
on the device (the head's kernels, the prologue, the tiles) comes from the head's backend
(``losscodegen/backends``).

A default call on one device is: one allocation (the workspace), the backend's one-program
prologue, and one launch of the head's kernel, whose last program writes the terms, the metrics and
the loss. Nothing waits for the device. What a call's shapes decide (tiles, launches, each launch's
compiled kernel, where each argument of a launch comes from) is worked out once per signature and
kept by the head.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import itemgetter
from typing import Any, Callable, NamedTuple

import torch

from . import collectives, segments
from .backends import Launchable
from .interface import Arg, FileSpec, Region, Role, Value, resolve, slices_interface
from .plan import Launch, Then, pow2

_BLOCK_R = 256      # rows a tile when the last program reduces the rows' values
_MAX_OFFSETS = 64   # workspace layouts a layout keeps, by row count


def by_name(values: dict[str, Any], names: tuple[str, ...], kernel: str) -> list[Any]:
    """``values`` in the order of ``names`` (a kernel's declared CONSTEXPRS), each required."""
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(f"{kernel} takes {missing}, which the launcher does not provide")
    return [values[n] for n in names]


class LayoutKey(NamedTuple):
    """What a call's layout depends on, and the key of the head's layouts: ``_layout`` reads the
    call only through it (the head's own options are fixed when it is built)."""

    V_local: int
    dtype: torch.dtype
    element_size: int          # the widest of the logits and the teacher's
    device: torch.device
    reduction: str
    group: Any                 # vocab-parallel process group
    grad: bool
    divisor: bool              # whether the call gives a divisor
    topk: int                  # the teacher's top-k count (0: none)
    exchange: bool             # whether vocab shards exchange their stats in-kernel
    teacher_grad: bool         # the kernel that writes the teacher's gradient too (HeadLoss.kernel_for)
    aligned: bool              # rows of the logits (and the teacher's) at 16-byte multiples (``aligned``),
                               # of a multiple of 16 columns; False for head.linear's, made a chunk at a time


# Where the launcher takes each per-launch argument (``Arg.value``) from: one tuple a launch, the
# call's values (``Launcher.values``: those of ``_CALL``, then the workspace's offsets in Region's
# order, the tokens in TOKENS' and the vectors in VECTORS' order), then the launch's (``_LAUNCH``,
# ``Launcher._launch``). A kernel's arguments are picked from it by position (``binding``).
_CALL = (Value.LABELS, Value.MASK, Value.TOPK_IDS, Value.TOPK_LOGPROBS, Value.TOPK_STRIDE, Value.TOPK_COUNT,
         Value.SEGMENT_IDS, Value.N_SEG, Value.WORKSPACE, Value.DIVISOR, Value.FLAGS, Value.N_ROWS)
_LAUNCH = (Value.LOGITS, Value.LOGITS_STRIDE, Value.GRAD, Value.GRAD_STRIDE, Value.TEACHER, Value.TEACHER_STRIDE,
           Value.TEACHER_GRAD, Value.TEACHER_GRAD_STRIDE, Value.GATHERED, Value.PEERS, Value.EPOCH, Value.UP_LOSS,
           Value.UP_ROWS, Value.ROW_OFFSET, Value.LAUNCH_ROWS)


def binding(spec: FileSpec, names: tuple[str, ...], kernel: str, *,
            per_launch: bool = True) -> Callable[[tuple], tuple]:
    """A function of a launch's values (``Launcher.values`` then, where ``per_launch``, the launch's,
    as ``_CALL`` and ``_LAUNCH`` order them) that returns the arguments ``names`` (a kernel's ARGS)
    in their order, by position: worked out once a layout, so that a launch looks nothing up. A
    name the launcher does not know how to pass fails here, at a head's first call, naming it."""
    regions, call = tuple(Region), len(_CALL) + len(Region) + len(spec.tokens) + len(spec.vectors)

    def position(a: Arg) -> int:
        if a.role is not Role.ARG:
            raise TypeError(f"{kernel} takes {a.name!r} among each launch's arguments, where it is {a.role.value}")
        if a.value is Value.OFFSET:
            return len(_CALL) + regions.index(a.item)
        if a.value is Value.TOKEN:
            return len(_CALL) + len(Region) + spec.tokens.index(a.item)
        if a.value is Value.VECTOR:
            return len(_CALL) + len(Region) + len(spec.tokens) + spec.vectors.index(a.item)
        if a.value in _CALL:
            return _CALL.index(a.value)
        if not per_launch:
            raise TypeError(f"{kernel} takes {a.name!r}, a value of each launch, but it is launched once a call")
        return call + _LAUNCH.index(a.value)
    positions = [position(a) for a in resolve(names, spec.tokens, spec.vectors, kernel)]
    if len(positions) == 1:   # (itemgetter of one position returns the value, not a tuple)
        return lambda values: (values[positions[0]],)
    return itemgetter(*positions)


def fixed_values(spec: FileSpec, names: tuple[str, ...], values: dict[Value, Any], kernel: str) -> list[Any]:
    """The fixed arguments ``names`` (a kernel's FIXED) from ``values``, in their order."""
    args = resolve(names, spec.tokens, spec.vectors, kernel)
    wrong = [a.name for a in args if a.role is not Role.FIXED]
    if wrong:
        raise TypeError(f"{kernel} takes {wrong} among its fixed arguments, where they are each launch's")
    return [values[a.value] for a in args]


@dataclass(frozen=True)
class _Layout:
    """What a call's signature decides (not its row count: a training run may bring a new one every
    step), worked out at its first call and kept by the head: the vocabulary a rank holds, the tiles
    and the launches, each with its kernel (and what that compiled)."""

    world: int
    vocab: int
    steps: tuple[tuple[Launch, Launchable], ...]  # each launch with the head's kernel for it (its
                                                   # constexprs and the fixed arguments)
    cut: int                       # steps[:cut] run before the segment step
    deferred: bool                 # the last step is the gradient, run in backward (reduction="none")
    count: bool                    # whether a launch counts the valid rows (the default divisor)
    prologue: Launchable           # the backend's prologue (zeroes, and counts if ``count``)
    bind: Callable[[tuple], tuple]  # the head kernel's per-launch arguments (``binding``)
    bind_segments: Callable[[tuple], tuple] | None  # the segment kernel's (of the call's values alone)
    segment_kernel: Callable[[int], Launchable] | None  # the segment kernel for a BLOCK_S
    offsets: dict = field(default_factory=dict, compare=False)  # _offsets by (rows, segments)
    segment_kernels: dict = field(default_factory=dict, compare=False)  # by BLOCK_S


def _layout(head, sig: LayoutKey) -> _Layout:
    k, backend = head.kernel_for(sig.teacher_grad), head.backend
    spec = k.SPEC
    world = collectives.group_info(sig.group)[0]
    sharded = sig.group is not None
    config = backend.config(head, k, sig.V_local, sig.dtype, sig.device, sharded=sharded)
    # reduction="none" with a gradient: the forward keeps the stats, and backward runs the gradient
    # launch with each row's upstream gradients as the terms' weights (out.rows are differentiable)
    deferred = sig.grad and sig.reduction == "none"
    launches = head.launches(sharded=sharded, grad=sig.grad, split=config.split, exchange=sig.exchange,
                             deferred=deferred, teacher_grad=sig.teacher_grad)
    # the row-slices kernel serves a call of one launch with the gradient on one vocab shard (its
    # programs merge their own row's slices), where the file has it, on rows its copies can read
    # (``aligned``: Triton knows their 16-byte starts, and whole copies of at least 4 bytes cover them)
    slices = config.kernel == "slices"
    if slices and not (len(launches) == 1 and launches[0].grad and not sharded and sig.aligned
                       and hasattr(k, f"head_loss_slices_{spec.key}")):
        config, slices = config.fallback, False
    name = f"head_loss_slices_{spec.key}" if slices else f"head_loss_{spec.key}"
    cut = next((i + 1 for i, launch in enumerate(launches) if launch.then is Then.SEGMENTS), len(launches))
    fn = getattr(k, name)
    # (its interface: the head kernel's, or the row-slices kernel's, by name)
    args, fixed_names, constexpr_names = slices_interface(spec) if slices else (spec.args, spec.fixed, spec.constexprs)
    options = config.launch(sig.V_local, sig.element_size)
    vocab_start, n_vocab = head.shard_columns(sig.group, sig.V_local, sig.device)   # (shards of any width)
    fixed = {Value.WORLD: world, Value.LOGIT_SCALE: head.logit_scale, Value.SOFTCAP: float(head.softcap or 1.0),
             Value.VOCAB: sig.V_local, Value.VOCAB_START: vocab_start, Value.N_VOCAB: n_vocab,
             Value.IGNORE_INDEX: head.ignore_index, Value.SCALARS: head.scalar_buffer(sig.device)}
    constexprs = dict(SUM=sig.reduction == "sum", PER_ROW=sig.reduction == "none", BLOCK_V=options.pop("BLOCK_V"),
                      BLOCK_K=pow2(sig.topk) if sig.topk else 1, BLOCK_R=_BLOCK_R)
    # the row-slices kernel's own constexprs (its G programs of a row exchange and merge their stats,
    # as vocab shards do, whatever the launch)
    own = dict({n: options.pop(n) for n in ("G", "N_CHUNKS", "NBUF")}, logit_scale=head.logit_scale,
               EXCHANGE=True, MERGE=True) if slices else {}
    kernels = []
    for launch in launches:
        phases = {f.name.upper(): getattr(launch, f.name) for f in fields(Launch) if f.name != "then"}
        kernels.append(backend.kernel(fn, fixed_values(spec, fixed_names, fixed, name),
                                      dict(zip(constexpr_names, by_name({**constexprs, **phases, **own}, constexpr_names,
                                                                        name))),
                                      options))
    segment_kernel = None
    if spec.segments:
        seg_name = f"segments_{spec.key}"
        seg_fixed = fixed_values(spec, spec.segment_fixed, fixed, seg_name)

        def segment_kernel(block: int) -> Launchable:
            values = by_name(dict(SUM=sig.reduction == "sum", PER_ROW=sig.reduction == "none", BLOCK_S=block),
                             spec.segment_constexprs, seg_name)
            return backend.kernel(getattr(k, seg_name), seg_fixed, dict(zip(spec.segment_constexprs, values)), {})
    # The valid rows are counted when a row output is divided by them: a metric always, a term
    # normalised by tokens when the call gives no divisor (segment terms count their own rows; a
    # row term of segment statistics is a row term).
    norms = {spec.normalization[n] for n in spec.outputs if n not in spec.segments or n in spec.segment_row_terms}
    count = "mean" in norms or ("tokens" in norms and not sig.divisor and sig.reduction != "sum")
    return _Layout(world, n_vocab, tuple(zip(launches, kernels)), cut, deferred, count,
                   backend.prologue(count), binding(spec, args, name),
                   binding(spec, spec.segment_args, seg_name, per_launch=False) if spec.segments else None,
                   segment_kernel)


def aligned(x: torch.Tensor) -> bool:
    """Whether every row of ``x`` starts at a multiple of 16 bytes as Triton can tell when it compiles
    (a 16-byte aligned start and a stride of a multiple of 16 elements, which it specialises on): the
    row-slices kernel's asynchronous copies, 4 to 16 bytes each, need it (and a row of a multiple of 16
    columns, which the call's key checks: a mask Triton cannot tell is constant over 16 columns splits
    a copy into single elements, which ``cp.async`` does not move)."""
    return x.data_ptr() % 16 == 0 and x.stride(0) % 16 == 0


# The workspace after the kernel's fixed slots, region by region in this order (fp32 each); the
# prologue zeroes the fixed slots and the segment sums (what the kernel adds into), every other
# region is written before it is read.
def _regions(spec: FileSpec, n_rows: int, *, per_row: bool, keep_stats: bool, n_seg: int) -> dict[Region, int]:
    segs = max(n_seg, 1) if spec.segments else 0
    return {Region.SEG_SUMS: segs * (len(spec.segment_means) + 1),
            Region.ROWS: n_rows * len(spec.row_values), Region.LOSS_ROWS: n_rows if per_row else 0,
            Region.STATS: n_rows * len(spec.columns) if keep_stats else 0,
            Region.EXACT: n_rows * len(spec.exact) if keep_stats else 0,
            Region.SEG_COEFS: segs * len(spec.segment_means)}


def _offsets(spec: FileSpec, n_rows: int, **kw: Any) -> tuple[tuple[int, ...], int, int]:
    """The workspace's offsets, in Region's order (that of ``Workspace``'s fields after ``spec``: each
    call passes them by position, keywords cost a call host time), where its zeroed part ends, and
    its size."""
    if n_rows >= 1 << 24:
        raise ValueError(f"a call takes fewer than 2**24 rows (its counts are exact fp32), got {n_rows}")
    offsets, at = {}, spec.slots["fixed"]
    for region, size in _regions(spec, n_rows, **kw).items():
        offsets[region], at = at, at + size
    return tuple(offsets[region] for region in Region), offsets[Region.ROWS], at


def workspace(size: int, device: torch.device) -> torch.Tensor:
    """A workspace's memory, left as it comes (tests fill it with NaN, to show nothing reads it
    before writing it)."""
    return torch.empty(size, device=device)


@dataclass(slots=True)
class Workspace:
    """One call's fp32 scratch: the kernel's fixed slots (each output's value, the loss, the
    valid-row count, the finished-row count), then the regions of ``_regions``, each at its offset
    (a field a region, in Region's order)."""

    t: torch.Tensor
    n_rows: int
    spec: FileSpec
    off_seg_sums: int
    off_rows: int
    off_loss_rows: int
    off_stats: int
    off_exact: int
    off_seg_coefs: int

    def values(self) -> torch.Tensor:
        return self.t.narrow(0, 0, len(self.spec.outputs))

    def loss(self, call) -> torch.Tensor:
        # Detached: to autograd a tensor of its own, not a view of the workspace. An autograd
        # Function's output that is a view cannot be modified in place (the Hugging Face Trainer
        # scales the loss with ``loss *= ...``); ``detach`` costs no device work.
        if call.reduction == "none":
            return self.t[self.off_loss_rows:self.off_loss_rows + self.n_rows].view(call.shape).detach()
        return self.t.select(0, self.spec.slots["loss"]).detach()

    def stats(self, start: int, stop: int) -> torch.Tensor:
        width = len(self.spec.columns)
        return self.t[self.off_stats + start * width:self.off_stats + stop * width]

    def exact(self, start: int, stop: int) -> torch.Tensor:
        width = len(self.spec.exact)
        return self.t[self.off_exact + start * width:self.off_exact + stop * width]

    def rows(self, call) -> torch.Tensor:
        """Every row value (ROW_VALUES: the terms' and metrics' per-row values), ``[n, *rows]``."""
        n = len(self.spec.row_values)
        return self.t.narrow(0, self.off_rows, n * self.n_rows).view(n, *call.shape)

    def seg_sums(self, n_seg: int) -> torch.Tensor:
        return self.t[self.off_seg_sums:self.off_seg_sums + max(n_seg, 1) * (len(self.spec.segment_means) + 1)]


class Launcher:
    """Runs a plan's launches over the rows of one call, or over one chunk of them at a time."""

    def __init__(self, head, call, *, grad: bool, flags: torch.Tensor | None, dtype: torch.dtype,
                 element_size: int):
        """``dtype``: the logits'; ``element_size``: the widest of the logits and the teacher's."""
        spec = self.spec = head.kernel_for(call.teacher_grad).SPEC
        self.head, self.call, self.flags = head, call, flags
        # the teacher's gradient ([rows, V] in the teacher's dtype) where the call's teacher requires
        # grad, once a launch wrote it (``run``, ``backward``)
        self.tgrad: torch.Tensor | None = None
        self.gathered: torch.Tensor | None = None  # all ranks' packed stats, after a "gather"
        self.n_seg = segments.count(call, head.ignore_index) if spec.segments else 0
        # (an exact read takes the all-gather: it reads every row again after the exchange anyway)
        self.exchange = None if call.group is None or spec.has_exact or not head.backend.exchange \
            else collectives.exchange(call.group, call.device)
        # The layouts' key as a plain tuple, which equals its LayoutKey and hashes alike: a
        # NamedTuple costs a call host time, so one is made only for a new layout.
        key = (call.V_local, dtype, element_size, call.device, call.reduction, call.group, grad,
               call.divisor is not None, call.topk_ids.shape[1] if spec.uses_topk else 0, self.exchange is not None,
               call.teacher_grad, call.V_local % 16 == 0 and call.x is not None and aligned(call.x)
               and (call.teacher is None or aligned(call.teacher)))
        # (a configuration being measured takes no layout kept from a call before it, nor leaves one)
        layout = head.layouts.get(key) if head.tile_override is None else None
        if layout is None:
            sig = LayoutKey(*key)
            layout = _layout(head, sig)
            if head.tile_override is None:
                head.layouts[sig] = layout
        self.layout, self.vocab = layout, layout.vocab
        if head.tensor_scalars:
            head.refresh_scalars(call.device)
        offsets = layout.offsets.get((call.rows, self.n_seg))
        if offsets is None:
            if len(layout.offsets) >= _MAX_OFFSETS:   # (row counts that change every step)
                layout.offsets.clear()
            offsets = layout.offsets[call.rows, self.n_seg] = _offsets(
                spec, call.rows, per_row=call.reduction == "none", keep_stats=len(layout.steps) > 1, n_seg=self.n_seg)
        regions, zeroed, size = offsets
        self.ws = Workspace(workspace(size, call.device), call.rows, spec, *regions)
        self.values = self.call_values()
        layout.prologue(1, self.ws.t, zeroed, call.labels, call.mask, call.rows, head.ignore_index, spec.slots["count"])

    def call_values(self) -> tuple:
        """The call's values a launch may pass, in ``_CALL``'s order, then the workspace's offsets, the
        tokens and the vectors (as ``binding`` reads them)."""
        call, ws, topk = self.call, self.ws, self.call.topk_ids
        return (call.labels, call.mask, topk, call.topk_logprobs, 0 if topk is None else topk.stride(0),
                0 if topk is None else topk.shape[1], call.segment_ids, self.n_seg, ws.t, call.divisor, self.flags,
                call.rows, ws.off_seg_sums, ws.off_rows, ws.off_loss_rows, ws.off_stats, ws.off_exact,
                ws.off_seg_coefs, *call.tokens, *call.vectors)

    def run(self, launches: tuple[tuple[Launch, Launchable], ...], x: torch.Tensor, teacher: torch.Tensor | None,
            grad: torch.Tensor | None, row_offset: int = 0, up_loss: torch.Tensor | None = None,
            up_rows: torch.Tensor | None = None, tgrad: torch.Tensor | None = None) -> None:
        """``launches`` (from ``passes``) over rows ``[row_offset, row_offset + len(x))`` of the call,
        whose logits (and teacher logits) are ``x`` (``teacher``); the gradient goes to ``grad`` (the
        teacher's to ``tgrad``, for a teacher-gradient kernel). ``up_loss`` (``[rows]``) and
        ``up_rows`` (``[ROW_LOSS_TERMS, rows]``), fp32: the upstream gradients of a deferred
        gradient launch."""
        for launch, kernel in launches:
            self._launch(launch, kernel, x, teacher, grad, row_offset, up_loss, up_rows, tgrad)
            if launch.then is Then.GATHER:
                n = x.shape[0]
                gathered = torch.empty(self.layout.world * n * len(self.spec.columns), device=x.device)
                collectives.gather(gathered, self.ws.stats(row_offset, row_offset + n), self.call.group)
                self.gathered = gathered
            elif launch.then is Then.SUM_EXACT:
                collectives.all_reduce(self.ws.exact(row_offset, row_offset + x.shape[0]), self.call.group)

    def passes(self) -> tuple[tuple[tuple[Launch, Launchable], ...], tuple[tuple[Launch, Launchable], ...]]:
        """The launches (each with its kernel) before the segment step (it needs every row's
        values: all chunks of rows go through the first part before it), and those after it, but
        a deferred gradient launch (``deferred``)."""
        steps, cut = self.layout.steps, self.layout.cut
        end = len(steps) - self.layout.deferred
        return steps[:min(cut, end)], steps[cut:end]

    def deferred(self) -> tuple[tuple[Launch, Launchable], ...]:
        """The gradient launch that backward runs (reduction="none" with a gradient), or none."""
        return self.layout.steps[-1:] if self.layout.deferred else ()

    def upstream(self, grad_loss: torch.Tensor | None,
                 grad_rows: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A deferred gradient launch's ``up_loss`` and ``up_rows`` (fp32, flat) from the upstream
        gradients on ``out.loss`` and on each of ROW_LOSS_TERMS' rows (None: none)."""
        rows = self.call.rows
        up_loss = grad_loss.reshape(rows).float().contiguous() if grad_loss is not None \
            else torch.zeros(rows, device=self.call.device)
        up_rows = None
        if any(g is not None for g in grad_rows):
            up_rows = torch.stack([g.reshape(rows).float() if g is not None else up_loss.new_zeros(rows)
                                   for g in grad_rows])
        return up_loss, up_rows

    def segments(self) -> None:
        """The segment step, between the passes: the segment kernel (after summing the segments
        over ``segment_group``)."""
        if self.spec.segments:
            layout, block = self.layout, min(pow2(self.n_seg), 1024)
            kernel = layout.segment_kernels.get(block)
            if kernel is None:
                kernel = layout.segment_kernels[block] = layout.segment_kernel(block)
            segments.run(self.call, self.ws, self.n_seg, kernel, layout.bind_segments(self.values),
                         self.head.ignore_index)

    def _launch(self, launch: Launch, kernel: Launchable, x, teacher, grad, row_offset: int, up_loss, up_rows,
                tgrad) -> None:
        gathered, peers, epoch = (self.gathered if launch.merge else None), None, 0
        if launch.exchange:
            gathered, peers, epoch = self.exchange.next(x.shape[0], len(self.spec.columns))
        # (the call's values, then the launch's in ``_LAUNCH``'s order: one tuple, made at once)
        kernel(x.shape[0], *self.layout.bind((
            *self.values, x, x.stride(0), x if grad is None else grad, 0 if grad is None else grad.stride(0),
            teacher, 0 if teacher is None else teacher.stride(0),
            teacher if tgrad is None else tgrad, 0 if tgrad is None else tgrad.stride(0),
            gathered, peers, epoch, up_loss, up_rows, row_offset, x.shape[0])))


def run(head, call, *, grad: bool, inplace: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Launcher]:
    """One call on whole logits: (loss, values of the outputs, gradient buffer or None, the
    launcher). With ``inplace`` the gradient buffer is the logits' own storage. Under
    reduction="none" the gradient is deferred (``backward``): no buffer."""
    device = call.device
    flags = head.checks.before(device) if head.validate else None
    width = call.x.element_size() if call.teacher is None else max(call.x.element_size(), call.teacher.element_size())
    launcher = Launcher(head, call, grad=grad, flags=flags, dtype=call.x.dtype, element_size=width)
    grad_buf = None
    if grad and not launcher.layout.deferred:
        # laid out for the kernel, [rows, V] with unit column stride, whatever the logits' strides
        grad_buf = call.x if inplace else torch.empty(call.x.shape, dtype=call.x.dtype, device=call.device)
        launcher.tgrad = _teacher_grad(call)
    first, second = launcher.passes()
    launcher.run(first, call.x, call.teacher, grad_buf, tgrad=launcher.tgrad)
    launcher.segments()
    launcher.run(second, call.x, call.teacher, grad_buf, tgrad=launcher.tgrad)
    if flags is not None:
        head.checks.after(device, launcher.vocab, launcher.n_seg)
    return launcher.ws.loss(call), launcher.ws.values(), grad_buf, launcher


def backward(launcher: Launcher, grad_loss: torch.Tensor | None, grad_rows: list[torch.Tensor | None], *,
             inplace: bool) -> torch.Tensor:
    """A reduction="none" call's deferred gradient launch, on whole logits: dL/dlogits for the
    upstream gradients on its per-row loss and on each loss term's rows (``grad_rows``, in
    ROW_LOSS_TERMS' order), in one pass."""
    call = launcher.call
    # the call's inputs as they are now: under torch.compile, autograd gives back the saved ones
    # (autograd._head_grad_op puts them into the call)
    launcher.values = launcher.call_values()
    # (laid out for the kernel, [rows, V] with unit column stride, whatever the logits' strides)
    grad = call.x if inplace else torch.empty(call.x.shape, dtype=call.x.dtype, device=call.device)
    launcher.tgrad = _teacher_grad(call)
    launcher.run(launcher.deferred(), call.x, call.teacher, grad, 0, *launcher.upstream(grad_loss, grad_rows),
                 launcher.tgrad)
    return grad


def _teacher_grad(call) -> torch.Tensor | None:
    """The buffer of dL/dteacher_logits ([rows, V], the teacher's dtype) where the call's teacher
    requires grad, else None: nothing is allocated or written for a teacher that does not."""
    return torch.empty(call.teacher.shape, dtype=call.teacher.dtype, device=call.device) \
        if call.teacher_grad else None
