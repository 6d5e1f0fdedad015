"""Stage 6, run: ``HeadLoss``, the module users call. It holds the head's terms and options, drives
the pipeline (lower, plan, emit, load) for ``explain()`` and for its kernel, and sends each call to
the input checks, then to autograd (eager or compiled) or to the fused linear path."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import sympy as sp
import torch

from . import autograd, backends, collectives, distributed
from . import load as _load
from . import symbols as S
from .emit import KernelSource, header
from .inputs import Call, check_call
from .interface import weight_name
from .lower import Lowered, lower
from .plan import Launch, Plan, launch_sequence, plan
from .stable import numerics_report
from .terms import Term, bind, check_metric, is_tensor, kernel_normalize, scalar_values
from .validation import DeviceChecks


def _real(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {x!r}")
    return float(x)


def _constant_under_compile(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo (2-3 s) with the
    package: the decorator sets this mark and nothing else (tests/compiler/test_imports.py checks that
    against torch's)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def _kernel_of(head_id: str) -> ModuleType:
    # torch.compile runs this once while tracing and keeps the module as a constant: finding or
    # generating a kernel (files, sympy) is nothing Dynamo should trace.
    head = autograd.head_of(head_id)
    return _load.load(head.key, lambda: head.source().text, head.backend)


def _teacher_kernel_of(head: HeadLoss) -> ModuleType:
    """The head's variant that also writes dL/dteacher_logits, generated at first use (never built
    into the package: a head's default kernel computes and writes nothing for the teacher)."""
    module = _load.load(head.teacher_key, lambda: head.source(teacher_grad=True).text, head.backend)
    if module.SPEC.scalars != head.kernel.SPEC.scalars:
        # (both read the head's one scalar buffer, laid out by the default kernel's SCALARS)
        raise ValueError(f"the teacher-gradient kernel of terms {head._names} reads runtime scalars "
                         f"{module.SPEC.scalars}, not the head's {head.kernel.SPEC.scalars}: pass "
                         "teacher_logits.detach()")
    return module


@_constant_under_compile
def _shard_columns_of(head_id: str, group: str, width: int, device: str) -> tuple[int, int]:
    # torch.compile runs this once while tracing and keeps the result as a constant: the widths'
    # exchange (a collective that waits for its result) is nothing Dynamo should trace.
    return autograd.head_of(head_id)._kept_shard_columns(collectives.resolve(group), width, torch.device(device))


@dataclass
class HeadOutput:
    """``loss``: fp32 scalar (per-row with ``reduction="none"``), differentiable. ``terms`` and
    ``metrics``: detached fp32 scalars, unweighted. ``rows`` (``reduction="none"`` only): every
    term's and metric's per-row value, the labels' shape (0 on invalid rows), unweighted; a term's
    rows are differentiable (one backward takes upstream gradients on any of them and on ``loss``),
    a metric's detached."""

    loss: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


class HeadLoss(torch.nn.Module):
    """Several loss terms and metrics over the same logits, computed by one generated kernel.

    ``HeadLoss(*terms, metrics=(), ignore_index=-100, logit_scale=1.0, softcap=None, validate=True,
    inplace_backward=False, linear_chunk_bytes=400 MiB, backend="auto")``; call it with ``logits [..., V]``,
    ``labels [...]`` and the keyword inputs the terms need (docs/api.md), or use
    ``head.linear(hidden, weight, labels, ...)``, whose chunks of logits take at most
    ``linear_chunk_bytes``. ``backend``: ``"triton"``, ``"torch"`` (any device, no Triton needed)
    or ``"auto"`` (Triton where it can run, torch elsewhere: ``backends.resolve``); ``backend_name``
    names the one that runs.
    """

    def __init__(self, *terms: Term, metrics: tuple[Term, ...] = (), ignore_index: int = -100,
                 logit_scale: float = 1.0, softcap: float | None = None, validate: bool = True,
                 inplace_backward: bool = False, linear_chunk_bytes: int = 400 * 2**20,
                 backend: str = "auto"):
        super().__init__()
        if backend not in backends.NAMES:
            raise ValueError(f"backend must be one of {backends.NAMES}, got {backend!r}")
        self._backend_option = backend     # ("auto" is resolved again in each process: _attach)
        if isinstance(metrics, Term):
            raise TypeError(f"metrics must be a tuple of terms, got the single term {metrics.name!r}: write "
                            "metrics=(term,)")
        try:
            metrics = tuple(metrics)
        except TypeError:
            raise TypeError(f"metrics must be a tuple of terms such as (lcg.Entropy(),), got {metrics!r}") from None
        for t in terms + metrics:
            if not isinstance(t, Term):
                raise TypeError(f"HeadLoss takes terms such as lcg.CrossEntropy(), got {t!r} "
                                "(did you pass the class instead of calling it?)")
        for t in terms:
            if t.metric_only:
                raise ValueError(f"{t.name} is a metric only: pass it in metrics=(...)")
        for t in metrics:
            check_metric(t.name, t.formula)
            if t.normalize != "tokens":
                raise ValueError(f"{t.name}: a metric is a mean over the valid rows, so "
                                 f"normalize={t.normalize!r} would be ignored; pass the term in the head's "
                                 "terms (weight=0.0 to log it) for another normalisation")
            if t.class_weight is not None:
                raise ValueError(f"{t.name}: a metric is a mean over the valid rows and takes no "
                                 "class_weight; pass the term in the head's terms (weight=0.0 to log it)")
        names = self._names = [t.name for t in terms + metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"term names must be unique in a head, got {names}")
        if not terms and not metrics:
            raise ValueError("HeadLoss needs at least one term or metric")
        if softcap is not None and not 0 < _real("softcap", softcap) < math.inf:
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
        if not math.isfinite(_real("logit_scale", logit_scale)):
            raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r}")
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        if not -2**63 <= ignore_index < 2**63:
            raise ValueError(f"ignore_index must fit in int64 (the labels' dtype), got {ignore_index}")
        self.loss_terms, self.metric_terms = terms, metrics
        self.ignore_index, self.logit_scale, self._softcap = ignore_index, float(logit_scale), softcap
        self.validate, self.inplace_backward = bool(validate), bool(inplace_backward)
        if isinstance(linear_chunk_bytes, bool) or not isinstance(linear_chunk_bytes, int) or linear_chunk_bytes < 1:
            raise ValueError(f"linear_chunk_bytes must be a positive int, got {linear_chunk_bytes!r}")
        self.linear_chunk_bytes = linear_chunk_bytes
        head = terms + metrics
        self._bound = tuple((t.name, bind(t, head), t in metrics) for t in head)
        # the runtime scalars by name (weights and runtime parameters: numbers or 0-dim tensors),
        # and their fp32 buffer on each device (``scalar_buffer``)
        self.scalars = scalar_values(terms, metrics)
        self.tensor_scalars = any(is_tensor(v) for v in self.scalars.values())
        # what each scalar's name is of, for learnable weights and messages (made from the terms as
        # the kernel names its scalars: each term's weight, each term's parameters)
        self._weight_terms = {weight_name(t.name): t.name for t in terms}
        self._scalar_labels = {**{S.runtime(t.name, key).name: f"parameter {key} of {t.name}"
                                  for t in head for key, _ in t.params},
                               **{w: f"the weight of {t}" for w, t in self._weight_terms.items()}}
        # each class-weighted term's [V] weights: a buffer ``class_weight_<term>`` (head.to(device)
        # moves it, as nn.CrossEntropyLoss's weight) left out of state_dict (a head inside a model
        # leaves its checkpoints as they were). By the per-row token it fills (inputs.py): the
        # term, and whether the term is a mean over its rows (its class weights then divide it)
        self.class_weight_tokens: dict[str, tuple[str, bool]] = {}
        for t in terms:
            if t.class_weight is not None:
                token = S.class_weight(t.name).name[len(S.TOKEN_PREFIX):]
                self.class_weight_tokens[token] = (t.name, t.normalize == "tokens")
                self.register_buffer(f"class_weight_{t.name}", t.class_weight.detach(), persistent=False)
        self._scalar_buffers: dict[torch.device, tuple[torch.Tensor, list]] = {}
        self._shards: dict[tuple, tuple[int, int]] = {}   # shard_columns by (group, width, device)
        self._kernel: ModuleType | None = None
        self.layouts: dict[tuple, Any] = {}        # launch.py's per-signature layouts
        self.tile_override: Any = None             # a backend Config every call takes (its tune)
        self.spec_text = "\n".join(
            [f"{'metric' if m else 'loss'} {n} {sp.srepr(f)}" for n, f, m in self._bound]
            + [f"normalize {t.name} {kernel_normalize(t)}" for t in terms if kernel_normalize(t) != "tokens"]
            + [f"softcap {softcap is not None}"])
        self.key = _load.kernel_key(self.spec_text)
        # the kernel for calls whose teacher requires grad: the same formulas, with dL/dt derived
        self.teacher_key = _load.kernel_key(self.spec_text + "\nteacher_grad True")
        self._teacher_kernel: ModuleType | None = None
        self._attach()

    def _attach(self) -> None:
        """What a head holds for its calls in this process: its backend, its flag buffers and an id
        of its own (the compiled op names heads by id), given again to a copy or an unpickled head."""
        self.backend = backends.get(backends.resolve(self._backend_option))
        self.checks = DeviceChecks(self.ignore_index)
        self.head_id = autograd.register(self)

    @property
    def backend_name(self) -> str:
        """The backend that runs this head's calls in this process, ``"triton"`` or ``"torch"``: a
        head built with ``backend="auto"`` names the one it resolved to, never ``"auto"``."""
        return self.backend.name

    # A copy (deepcopy, pickle, torch.save) keeps the terms and options (the ``backend=`` option as
    # given, so that ``"auto"`` is resolved again where the copy is loaded), and leaves behind what
    # belongs to this process and to this head: the loaded kernel module (found again from its
    # file), the backend (resolved again), the layouts (compiled kernels), the scalar buffers, the
    # flag buffers and the id.
    _PER_PROCESS = ("_kernel", "_teacher_kernel", "backend", "layouts", "_scalar_buffers", "_shards", "checks",
                    "head_id")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self._PER_PROCESS:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a head pickled before the option existed, or when it was kept as ``backend_name``)
        state.setdefault("_backend_option", state.pop("backend_name", "auto"))
        super().__setstate__(state)
        self._kernel, self._teacher_kernel = None, None
        self.layouts, self._scalar_buffers, self._shards = {}, {}, {}
        self._attach()

    @property
    def kernel(self) -> ModuleType:
        """The kernel module: from a kernel folder, else the cache, else generated now (first use)."""
        if torch.compiler.is_compiling():
            return _kernel_of(self.head_id)
        if self._kernel is None:
            self._kernel = _kernel_of(self.head_id)
        return self._kernel

    def kernel_for(self, teacher_grad: bool) -> ModuleType:
        """The kernel module of a call: ``kernel``, or where the call's teacher logits require grad
        (``Call.teacher_grad``), the variant that also writes their gradient."""
        if not teacher_grad:
            return self.kernel
        if self._teacher_kernel is None:
            self._teacher_kernel = _teacher_kernel_of(self)
        return self._teacher_kernel

    @property
    def softcap(self) -> float | None:
        """Fixed at construction: the kernel is built with or without the softcap."""
        return self._softcap

    # ---- the pipeline, for explain() and generation --------------------------------------------
    def lowered(self, *, teacher_grad: bool = False) -> Lowered:
        return lower(self._bound, teacher_grad=teacher_grad)

    def plan(self, *, teacher_grad: bool = False) -> Plan:
        """``teacher_grad``: the plan of the variant that also writes dL/dteacher_logits."""
        return plan(self.lowered(teacher_grad=teacher_grad), softcap=self.softcap is not None)

    def source(self, backend: backends.Backend | None = None, *, teacher_grad: bool = False) -> KernelSource:
        """The head's kernel file as ``backend`` (None: the head's) renders it (``teacher_grad``:
        its variant for teacher logits that require grad)."""
        p, backend = self.plan(teacher_grad=teacher_grad), backend or self.backend
        return backend.render(p, self.teacher_key if teacher_grad else self.key, header(self._bound, p),
                              _load.codegen_version(backend),
                              normalize={t.name: kernel_normalize(t) for t in self.loss_terms})

    def explain(self) -> str:
        """Formulas, reductions, the derived gradient, the reads and the kernel file serving it."""
        p = self.plan()
        return "\n".join([
            "terms:", *[f"  {'metric' if m else 'loss  '} {n} = {f}" for n, f, m in self._bound],
            str(p.lowered), "numerics (forms that can be 0/0 where the formulas are finite):",
            *["  " + line for line in numerics_report(p.lowered) or ["none"]],
            "plan:", *["  " + line for line in str(p).splitlines()],
            self.backend.describe_config(p), self.backend.describe_costs(p),
            f"kernel: {_load.module_path(self.key, self.backend)}"])

    # ---- calls ----------------------------------------------------------------------------------
    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None, **inputs: Any) -> HeadOutput:
        # (a plain tensor is no DTensor, and a head without tensor weights has no learnable one:
        # the default call skips both look-ups)
        if type(logits) is not torch.Tensor and distributed.is_dtensor(logits):
            return distributed.forward(self, logits, labels, inputs)
        learnable = self._learnable_weights() if self.tensor_scalars else ()
        call = check_call(self, self.kernel.SPEC, logits, labels, inputs)
        run = autograd.compiled if torch.compiler.is_compiling() else autograd.eager
        teacher = inputs["teacher_logits"] if call.teacher_grad else None
        return self._output(*run(self, logits, call, teacher), call, learnable)

    def linear(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None = None, *,
               bias: torch.Tensor | None = None, teacher_hidden: torch.Tensor | None = None,
               teacher_weight: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
               chunk_rows: int | None = None, **inputs: Any) -> HeadOutput:
        """The head on ``hidden @ weight.T + bias`` without ever holding those logits whole."""
        if any(distributed.is_dtensor(t) for t in (hidden, weight, teacher_weight)):
            return distributed.linear(self, hidden, weight, labels, bias, teacher_hidden, teacher_weight,
                                      teacher_bias, chunk_rows, inputs)
        from . import linear
        learnable = self._learnable_weights()
        return self._output(*linear.run(self, hidden, weight, labels, bias, teacher_hidden,
                                        teacher_weight, teacher_bias, chunk_rows, inputs), learnable)

    def _learnable_weights(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """The loss terms whose weight is a tensor that requires grad (in grad mode), with it. A
        tensor parameter inside a formula that requires grad is refused, naming it: the kernel
        derives no gradient for a parameter, and a silent zero would never train it."""
        if not self.tensor_scalars or not torch.is_grad_enabled():
            return ()
        learnable = []
        for name, value in self.scalars.items():
            if is_tensor(value) and value.requires_grad:
                if name not in self._weight_terms:
                    raise ValueError(
                        f"{self._scalar_labels[name]} is a tensor that requires grad, but a parameter inside a "
                        "formula gets no gradient (only a term's weight does): pass it .detach(), or "
                        "make the learnable factor a term's weight")
                learnable.append((self._weight_terms[name], value))
        return tuple(learnable)

    def _output(self, loss: torch.Tensor, values: torch.Tensor, rows: dict[str, torch.Tensor], call: Call,
                learnable: tuple[tuple[str, torch.Tensor], ...] = ()) -> HeadOutput:
        # the kernel's OUTPUTS: the terms, then the metrics, each a tensor of its own to autograd
        # (not a view: in-place ops on it work), sharing the workspace's memory (no device work)
        per_output = [v.detach() for v in values.unbind(0)]
        for i, divisor in call.value_divisors:
            per_output[i] = per_output[i] / divisor
        n = len(self.loss_terms)
        terms = dict(zip(self._names[:n], per_output[:n]))
        # A weight that requires grad: loss = sum_k w_k * term_k, so d loss / d w_k is term k's value
        # (its rows under reduction="none"), the value the kernel reports. It joins the loss as
        # (w_k - w_k.detach()) * term_k: zero, so the value is the kernel's, with that derivative
        # (docs/decisions.md). Scalar (or [rows]) torch ops, only for such heads.
        for name, w in learnable:
            value = rows[name].detach() if call.reduction == "none" else terms[name]
            loss = loss + (w - w.detach()).float() * value
        return HeadOutput(loss, terms, dict(zip(self._names[n:], per_output[n:])), rows)

    # ---- what the runtime asks of a head -------------------------------------------------------
    def launches(self, *, sharded: bool, grad: bool, split: bool, exchange: bool = False,
                 deferred: bool = False, teacher_grad: bool = False) -> tuple[Launch, ...]:
        """The plan's launches; ``deferred``: the gradient as a launch of its own, last, after a
        forward that keeps the stats it needs (reduction="none": backward runs it);
        ``teacher_grad``: of the kernel that writes the teacher's gradient too."""
        spec = self.kernel_for(teacher_grad).SPEC
        seq = launch_sequence(has_exact=spec.has_exact, segments=bool(spec.segments), sharded=sharded,
                              grad=grad and not deferred, split=split, exchange=exchange)
        if grad and deferred:
            seq = (*seq[:-1], dataclasses.replace(seq[-1], store_stats=True), Launch(grad=True))
        return seq

    def scalar_buffer(self, device: torch.device) -> torch.Tensor:
        """The kernel's runtime scalars (its SCALARS: weights, runtime parameters) as fp32 on
        ``device``: numbers written once, 0-dim tensors copied in on the device at each call
        (``refresh_scalars``), so that a schedule updating one in place needs no new head."""
        entry = self._scalar_buffers.get(device)
        if entry is None:
            names = self.kernel.SPEC.scalars
            missing = [n for n in names if n not in self.scalars]
            if missing:
                raise TypeError(f"the kernel reads scalars {missing} that the head does not hold")
            for name in names:
                value = self.scalars[name]
                if is_tensor(value) and value.device != device:
                    raise ValueError(f"{self._scalar_labels[name]} is a tensor on {value.device}, but the logits are "
                                     f"on {device}: a tensor weight or parameter must be on the logits' device")
            values = [self.scalars[n] for n in names]
            buf = torch.tensor([0.0 if is_tensor(v) else float(v) for v in values], dtype=torch.float32,
                               device=device)
            copies = [(buf.select(0, i), v.detach()) for i, v in enumerate(values) if is_tensor(v)]
            entry = self._scalar_buffers[device] = (buf, copies)
            self.refresh_scalars(device)
        return entry[0]

    def refresh_scalars(self, device: torch.device) -> None:
        """The tensor weights' and parameters' current values into the device's scalar buffer: one
        device copy each, no host sync (capturable in a CUDA graph)."""
        entry = self._scalar_buffers.get(device)
        if entry is None:
            self.scalar_buffer(device)
            return
        for slot, value in entry[1]:
            slot.copy_(value)

    def shard_columns(self, group: Any, width: int, device: torch.device) -> tuple[int, int]:
        """Under vocab parallelism over ``group``: (this rank's first vocabulary column, the
        vocabulary's size), from every rank's shard width (any widths: 61 columns as 31 + 30). The
        widths are exchanged at the head's first call with this width, then kept: every rank of the
        group makes that first call together, as it makes every call of the head."""
        if group is None:
            return 0, width
        if torch.compiler.is_compiling():
            return _shard_columns_of(self.head_id, collectives.group_name(group), width, str(device))
        return self._kept_shard_columns(group, width, device)

    def _kept_shard_columns(self, group: Any, width: int, device: torch.device) -> tuple[int, int]:
        key = (group, width, device)
        columns = self._shards.get(key)
        if columns is None:
            columns = self._shards[key] = collectives.shard_columns(group, width, device)
        return columns

    def keep_scalars(self, call: Call) -> None:
        """For a call whose backward launches again (reduction="none"): a device copy of the scalars
        its forward read, which ``restore_scalars`` puts back before that launch. The scalar buffer
        is the head's, and a later call refreshes it from tensors a schedule may have changed since;
        each backward computes with its own forward's values. (Numbers never change: no copy.)"""
        if self.tensor_scalars:
            call.scalars = self.scalar_buffer(call.device).clone()

    def restore_scalars(self, call: Call) -> None:
        if call.scalars is not None:
            self.scalar_buffer(call.device).copy_(call.scalars)

    def terms_reading(self, input_name: str) -> str:
        """The names of the head's terms that read ``input_name``, for error messages."""
        reads = {
            "labels": lambda f: f.has(S.target_logit, S.label),
            "teacher_logits": lambda f: f.has(S.teacher_logit) or any(a.args[1] != 0 for a in f.atoms(S.LSE)),
            "teacher_topk_ids": lambda f: f.has(S.topk_sum),
            # (a batch quantile alone reads no segments: the call makes them one)
            "segment_ids": lambda f: f.has(S.segment_count) or any(
                not isinstance(m, S.row_quantile) for m in f.atoms(S.segment_mean))}.get(
                input_name, lambda f: f.has(S.token(input_name)) or f.has(S.vector(input_name)))
        return ", ".join(n for n, f, _ in self._bound if reads(f))

