"""The kernel interface, declared once: each argument of a head's kernels one typed record (``Arg``:
its name, its role, and what the runtime passes for it), each kernel's ``Signature`` (``signatures``),
the file's contract (``FileSpec``, the constants a kernel file records; ``KernelSpec``, derived from a
plan by ``kernel_spec``, with what the renderers alone read), the check that a rendered file's kernels
take their declared interface (``check_interface``), the flag slots, and a kernel file's seal.

The names the interface makes from the head's own (``token_arg``, ``vector_arg``, ``offset_arg``,
``weight_name``) are made here only: emit, the renderers (and, through their context, the
templates), load and the runtime use them by these functions or by the records' ``name``, and the
launcher passes each argument by its record's ``value``, never by reading a name apart.

A compiler stage: pure Python over sympy. The runtime imports this module, not emit, for the interface.
"""
from __future__ import annotations

import ast
import builtins
import enum
import hashlib
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import sympy as sp

from . import symbols as S
from .stable import compensated_sums
from .plan import Plan


class Role(enum.Enum):
    """Where an argument stands in a kernel's signature, and so when the runtime binds it."""

    ARG = "args"              # each launch's own: bound at every launch (Launcher)
    FIXED = "fixed"           # the same at every launch of a head on one vocab shard: bound once a layout
    CONSTEXPR = "constexprs"  # compile-time: bound once a layout, by its name (a launch's phases, the tiles)


class Value(enum.Enum):
    """What the runtime passes for an argument (``Arg.value``). The launcher takes each from the
    call, the launch or the layout (launch.py)."""

    # the call's: the same at every launch of one call
    LABELS = enum.auto()
    MASK = enum.auto()
    TOKEN = enum.auto()          # the per-row token ``Arg.item``
    VECTOR = enum.auto()         # the per-class vector ``Arg.item``
    TOPK_IDS = enum.auto()
    TOPK_LOGPROBS = enum.auto()
    TOPK_STRIDE = enum.auto()
    TOPK_COUNT = enum.auto()
    SEGMENT_IDS = enum.auto()
    N_SEG = enum.auto()
    WORKSPACE = enum.auto()
    OFFSET = enum.auto()         # the workspace's offset of region ``Arg.item``
    DIVISOR = enum.auto()
    FLAGS = enum.auto()
    N_ROWS = enum.auto()
    # the launch's: its logits (a chunk of the call's rows), their gradient, the exchange
    LOGITS = enum.auto()
    LOGITS_STRIDE = enum.auto()
    GRAD = enum.auto()           # the gradient's buffer (the logits where the launch writes none)
    GRAD_STRIDE = enum.auto()
    TEACHER = enum.auto()
    TEACHER_STRIDE = enum.auto()
    TEACHER_GRAD = enum.auto()   # dL/dteacher_logits' buffer (the teacher's logits where none)
    TEACHER_GRAD_STRIDE = enum.auto()
    GATHERED = enum.auto()
    PEERS = enum.auto()
    EPOCH = enum.auto()
    UP_LOSS = enum.auto()
    UP_ROWS = enum.auto()
    ROW_OFFSET = enum.auto()
    LAUNCH_ROWS = enum.auto()    # the launch's rows (its logits'), where a kernel loops over them
    # the layout's (``Role.FIXED``)
    WORLD = enum.auto()
    SCALARS = enum.auto()
    LOGIT_SCALE = enum.auto()
    SOFTCAP = enum.auto()
    VOCAB = enum.auto()          # the vocabulary this rank holds
    VOCAB_START = enum.auto()
    N_VOCAB = enum.auto()
    IGNORE_INDEX = enum.auto()


class Region(enum.StrEnum):
    """The workspace's regions after its fixed slots, in the order launch.py lays them out; each
    passed to the kernels as its offset (``offset_arg``)."""

    SEG_SUMS = "seg_sums"
    ROWS = "rows"
    LOSS_ROWS = "loss_rows"
    STATS = "stats"
    EXACT = "exact"
    SEG_COEFS = "seg_coefs"


@dataclass(frozen=True)
class Arg:
    """One argument of a head's kernels: its name in the kernel's signature, its ``role``, and what
    the runtime passes for it (``value``, with ``item`` the token, vector or region it is of; a
    constexpr has no value of its own: the layout binds it by its name)."""

    name: str
    role: Role
    value: Value | None = None
    item: str = ""


def _arg(name: str, value: Value) -> Arg:
    return Arg(name, Role.ARG, value)


def _fixed(name: str, value: Value) -> Arg:
    return Arg(name, Role.FIXED, value)


def token_arg(name: str) -> Arg:
    """The pointer to the per-row token ``name`` (``S.token(name)``, the value the kernel loads from it)."""
    return Arg(f"{S.token(name).name}_ptr", Role.ARG, Value.TOKEN, name)


def vector_arg(name: str) -> Arg:
    """The pointer to the per-class vector ``name`` (``S.vector(name)``, the value the kernel loads from it)."""
    return Arg(f"{S.vector(name).name}_ptr", Role.ARG, Value.VECTOR, name)


def offset_arg(region: Region) -> Arg:
    """The workspace's offset of ``region``."""
    return Arg(f"off_{region}", Role.ARG, Value.OFFSET, region)


def weight_name(term: str) -> str:
    """The runtime scalar of loss term ``term``'s weight (one of a kernel file's SCALARS)."""
    return f"weight_{term}"


X_PTR, X_STRIDE = _arg("x_ptr", Value.LOGITS), _arg("x_stride", Value.LOGITS_STRIDE)
GRAD_PTR, GRAD_STRIDE = _arg("grad_ptr", Value.GRAD), _arg("grad_stride", Value.GRAD_STRIDE)
Y_PTR, MASK_PTR = _arg("y_ptr", Value.LABELS), _arg("mask_ptr", Value.MASK)
T_PTR, T_STRIDE = _arg("t_ptr", Value.TEACHER), _arg("t_stride", Value.TEACHER_STRIDE)
TGRAD_PTR, TGRAD_STRIDE = _arg("tgrad_ptr", Value.TEACHER_GRAD), _arg("tgrad_stride", Value.TEACHER_GRAD_STRIDE)
TOPK = (_arg("topk_id_ptr", Value.TOPK_IDS), _arg("topk_lp_ptr", Value.TOPK_LOGPROBS),
        _arg("topk_stride", Value.TOPK_STRIDE), _arg("K", Value.TOPK_COUNT))
SEG_PTR, N_SEG = _arg("seg_ptr", Value.SEGMENT_IDS), _arg("n_seg", Value.N_SEG)
WS_PTR = _arg("ws_ptr", Value.WORKSPACE)
GATHERED_PTR, PEERS_PTR, EPOCH = (_arg("gathered_ptr", Value.GATHERED), _arg("peers_ptr", Value.PEERS),
                                  _arg("epoch", Value.EPOCH))
DIV_PTR, FLAG_PTR = _arg("div_ptr", Value.DIVISOR), _arg("flag_ptr", Value.FLAGS)
UP_LOSS_PTR, UP_ROWS_PTR = _arg("up_loss_ptr", Value.UP_LOSS), _arg("up_rows_ptr", Value.UP_ROWS)
ROW_OFFSET, N_ROWS = _arg("row_offset", Value.ROW_OFFSET), _arg("n_rows", Value.N_ROWS)
N_LAUNCH = _arg("n_launch", Value.LAUNCH_ROWS)
OFF = {region: offset_arg(region) for region in Region}

WORLD, SCALARS_PTR = _fixed("world", Value.WORLD), _fixed("scalars_ptr", Value.SCALARS)
LOGIT_SCALE, SOFTCAP = _fixed("logit_scale", Value.LOGIT_SCALE), _fixed("softcap", Value.SOFTCAP)
V, VOCAB_START, N_VOCAB = _fixed("V", Value.VOCAB), _fixed("vocab_start", Value.VOCAB_START), \
    _fixed("n_vocab", Value.N_VOCAB)
IGNORE_INDEX = _fixed("ignore_index", Value.IGNORE_INDEX)

# the per-launch and fixed arguments a kernel may take besides its tokens' and vectors' (``resolve``)
_STANDARD = (X_PTR, X_STRIDE, GRAD_PTR, GRAD_STRIDE, Y_PTR, MASK_PTR, T_PTR, T_STRIDE, TGRAD_PTR, TGRAD_STRIDE,
             *TOPK, SEG_PTR, N_SEG, WS_PTR, GATHERED_PTR, PEERS_PTR, EPOCH, DIV_PTR, FLAG_PTR, UP_LOSS_PTR,
             UP_ROWS_PTR, ROW_OFFSET, N_ROWS, N_LAUNCH, *OFF.values(), WORLD, SCALARS_PTR, LOGIT_SCALE, SOFTCAP, V,
             VOCAB_START, N_VOCAB, IGNORE_INDEX)
# The head kernel's integer arguments that change between calls (Triton compiles no variant for
# each of their values), in the order its files list them.
VARYING = (ROW_OFFSET, N_ROWS, N_LAUNCH, EPOCH, OFF[Region.ROWS], OFF[Region.LOSS_ROWS], OFF[Region.STATS],
           OFF[Region.EXACT], VOCAB_START, N_VOCAB, N_SEG, OFF[Region.SEG_SUMS], OFF[Region.SEG_COEFS])


def _constexprs(*names: str) -> tuple[Arg, ...]:
    return tuple(Arg(n, Role.CONSTEXPR) for n in names)


@dataclass(frozen=True)
class Signature:
    """One jitted kernel's interface, the single declaration of its arguments: the template writes
    the kernel's signature from it, the generated file records its names (``ARGS``, ``FIXED``,
    ``CONSTEXPRS``) and the launcher passes each argument by its record (``resolve``)."""

    name: str                  # the jitted function
    params: tuple[Arg, ...]    # in signature order: each launch's own, the fixed ones, the constexprs
    varying: tuple[Arg, ...] = ()  # integer arguments that change between calls: no variant each
    kind: str = "head_loss"    # which of a file's kernels: head_loss, segments, slices

    def _of(self, role: Role) -> tuple[str, ...]:
        return tuple(a.name for a in self.params if a.role is role)

    @property
    def args(self) -> tuple[str, ...]:
        return self._of(Role.ARG)

    @property
    def fixed(self) -> tuple[str, ...]:
        return self._of(Role.FIXED)

    @property
    def constexprs(self) -> tuple[str, ...]:
        return self._of(Role.CONSTEXPR)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.params)

    @property
    def unspecialized(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.varying)


def signatures(plan: Plan, key: str, reads_scalars: bool, per_sequence: tuple[str, ...] = (),
               row_terms: bool = True) -> dict[str, Signature]:
    """The interface of each kernel of a head's file, in signature order. ``reads_scalars``: whether
    the head's kernel reads runtime scalars (the segment kernel always does: its terms' weights);
    ``per_sequence``: the segment terms normalised by sequence (which take no divisor); ``row_terms``:
    whether the head has loss terms reduced over rows (which take per-row upstream gradients, on the
    loss and on their rows; a row term of segment statistics takes the one on the loss)."""
    lw = plan.lowered
    segments = [seg.name for seg in lw.segments]
    by_rows = any(seg.rows for seg in lw.segments)   # row terms of segment statistics
    args = [X_PTR, X_STRIDE, GRAD_PTR, GRAD_STRIDE, Y_PTR, MASK_PTR]
    if lw.uses_teacher:
        args += [T_PTR, T_STRIDE]
    if lw.teacher_grad:     # (the variant for teacher logits that require grad: their gradient)
        args += [TGRAD_PTR, TGRAD_STRIDE]
    args += [token_arg(tok) for tok in lw.tokens]
    args += [vector_arg(vec) for vec in lw.vectors]
    if lw.uses_topk:
        args += TOPK
    if segments:
        args += [SEG_PTR, N_SEG, OFF[Region.SEG_SUMS], OFF[Region.SEG_COEFS]]
    args += [WS_PTR, OFF[Region.ROWS], OFF[Region.LOSS_ROWS], OFF[Region.STATS],
             *([OFF[Region.EXACT]] if plan.exact else []), GATHERED_PTR, PEERS_PTR, EPOCH, DIV_PTR, FLAG_PTR,
             *([UP_LOSS_PTR] if row_terms or by_rows else []), *([UP_ROWS_PTR] if row_terms else []),
             ROW_OFFSET, N_ROWS]
    fixed = [WORLD, *([SCALARS_PTR] if reads_scalars else []), LOGIT_SCALE, SOFTCAP, V, VOCAB_START, N_VOCAB,
             IGNORE_INDEX]
    constexprs = _constexprs("SUM", "PER_ROW", "STATS", "EXCHANGE", "MERGE", "EXACT", "STORE_STATS", "ROWS", "GRAD",
                             "BLOCK_V", "BLOCK_K", "BLOCK_R")
    varying = tuple(a for a in VARYING if a in args + fixed)
    out = {"head_loss": Signature(f"head_loss_{key}", (*args, *fixed, *constexprs), varying)}
    if holds_row_slices(plan):
        # the row-slices kernel (templates/gluon/_slices.j2): the head kernel's interface but the
        # vocab shards' exchange (``gathered_ptr`` its own buffer), with the launch's rows (which its
        # programs take in turn), the logits' scale a constexpr (a head's, fixed: at 1 its multiply an
        # element, 4 a column of its sweeps, is folded away), and the programs a row (G), the chunks
        # of BLOCK_V columns a program holds (N_CHUNKS) and the rows whose slices it holds at once (NBUF)
        own = [a for a in (*args, *SLICES_ARGS, *fixed) if a not in SLICES_DROPPED]
        out["slices"] = Signature(f"head_loss_slices_{key}", (*own, *constexprs, *_constexprs(*SLICES_CONSTEXPRS)),
                                  tuple(a for a in varying if a in own), "slices")
    if segments:
        seg_args = (WS_PTR, OFF[Region.SEG_SUMS], OFF[Region.SEG_COEFS], N_SEG,
                    *((DIV_PTR,) if set(segments) - set(per_sequence) else ()),
                    *((SEG_PTR, OFF[Region.ROWS], OFF[Region.LOSS_ROWS], N_ROWS) if by_rows else ()))
        # (PER_ROW: reduction="none", where a row term of batch quantiles adds its rows to the per-row loss)
        out["segments"] = Signature(f"segments_{key}", (*seg_args, SCALARS_PTR,
                                                         *_constexprs("SUM", *(("PER_ROW",) if by_rows else ()),
                                                                      "BLOCK_S")),
                                    (N_SEG, OFF[Region.SEG_SUMS], OFF[Region.SEG_COEFS],
                                     *((OFF[Region.ROWS], OFF[Region.LOSS_ROWS], N_ROWS) if by_rows else ())),
                                    "segments")
    return out


# The row-slices kernel's interface against the head kernel's: what it drops, what it adds
SLICES_DROPPED = (PEERS_PTR, EPOCH, WORLD, LOGIT_SCALE)
SLICES_ARGS = (N_LAUNCH,)
SLICES_CONSTEXPRS = ("logit_scale", "G", "N_CHUNKS", "NBUF")


def slices_interface(spec: FileSpec) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The row-slices kernel's (ARGS, FIXED, CONSTEXPRS) names, from its file's head kernel's, as
    ``signatures`` declares it."""
    dropped = {a.name for a in SLICES_DROPPED}
    return (tuple(n for n in (*spec.args, *(a.name for a in SLICES_ARGS)) if n not in dropped),
            tuple(n for n in spec.fixed if n not in dropped), (*spec.constexprs, *SLICES_CONSTEXPRS))


def holds_row_slices(plan: Plan) -> bool:
    """Whether a head's file has the row-slices kernel (issue 47: each row's slices held in shared
    memory, read from HBM once): every head whose row is the whole of its work. Not one with
    segment statistics (a row adds into its segment: once a row, not once a slice), top-k entries
    (their ids index the whole row), a teacher that takes a gradient (the teacher's gradient
    kernel has none), the row's argmax (Gluon's argmax needs a layout the phases do not give) or a
    compensated normaliser sum (``stable.compensated_sums``: its lanes and programs would be added
    up uncompensated, rounding away the rest of a confident row's mass that it keeps)."""
    lw = plan.lowered
    return not (lw.segments or lw.uses_topk or lw.teacher_grad or lw.uses_argmax or compensated_sums(lw))


def resolve(names: tuple[str, ...], tokens: tuple[str, ...], vectors: tuple[str, ...], kernel: str) -> tuple[Arg, ...]:
    """The records of the per-launch or fixed arguments ``names`` (a kernel file's ARGS or FIXED,
    as ``load`` read them) of a head whose kernels read ``tokens`` and ``vectors``: each record made
    as ``signatures`` makes it, and matched by its name. A name no record has fails, naming it."""
    known = {a.name: a for a in (*_STANDARD, *map(token_arg, tokens), *map(vector_arg, vectors))}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TypeError(f"{kernel} takes an argument {unknown[0]!r} that launch.py does not know how to pass "
                        "(no interface.Arg of the head's has that name)")
    return tuple(known[n] for n in names)


def _recorded(constant: str, *, only_with: str = "") -> Any:
    """A field of ``FileSpec``: written as the module constant ``constant``; ``only_with``: the field
    whose value decides whether the file writes it at all (the segment kernel's interface)."""
    return field(metadata={"constant": constant, "only_with": only_with})


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise TypeError(f"a list of names, not {value!r}")
    return tuple(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"True or False, not {value!r}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string, not {value!r}")
    return value


def _pairs(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError(f"a dict of names, not {value!r}")
    return tuple(value.items())


def _state(value: Any) -> tuple[str, int, int]:
    if not (isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], str)
            and all(isinstance(n, int) for n in value[1:])):
        raise TypeError(f"(streams, running sums, exact sums), not {value!r}")
    return value


def _quantiles(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], float) for p in value):
        raise TypeError(f"a list of (name, q) pairs, not {value!r}")
    return tuple(value)


# how a constant's value is read back into its field, by the field's type
_READERS: dict[str, Callable[[Any], Any]] = {
    "str": _text, "bool": _flag, "tuple[str, ...]": _names, "tuple[tuple[str, str], ...]": _pairs,
    "tuple[str, int, int]": _state, "tuple[tuple[str, float], ...]": _quantiles}


@dataclass(frozen=True)
class FileSpec:
    """What the runtime reads of a head's kernel file, whatever its backend: each field one constant
    of the file (named in the field's ``constant``), which both backends' templates write
    (``templates/_spec_constants.j2``, from a ``KernelSpec``), and which ``load`` reads back into
    this, the module's ``SPEC`` (``FileSpec.read``). The runtime reads these fields, never a
    constant by its name."""

    key: str = _recorded("KEY")                         # the head's key: its kernels are head_loss_<key>, segments_<key>
    outputs: tuple[str, ...] = _recorded("OUTPUTS")     # the terms, then the metrics
    row_values: tuple[str, ...] = _recorded("ROW_VALUES")  # row terms, metrics, segment terms' row quantities
    columns: tuple[str, ...] = _recorded("COLUMNS")     # the first read's packed per-row stats
    exact: tuple[str, ...] = _recorded("EXACT")         # the exact read's sums
    tokens: tuple[str, ...] = _recorded("TOKENS")       # per-row inputs (S.token), each passed as its token_arg
    vectors: tuple[str, ...] = _recorded("VECTORS")     # per-class [V] inputs (S.vector), each passed as its vector_arg
    uses_labels: bool = _recorded("USES_LABELS")        # which inputs its kernels read
    uses_teacher: bool = _recorded("USES_TEACHER")
    uses_topk: bool = _recorded("USES_TOPK")
    row_loss_terms: tuple[str, ...] = _recorded("ROW_LOSS_TERMS")  # loss terms reduced over rows (the others are segment terms)
    normalize: tuple[tuple[str, str], ...] = _recorded("NORMALIZE")  # each output's: tokens, sequence, sum or mean
    scalars: tuple[str, ...] = _recorded("SCALARS")     # the fp32 runtime scalars: each loss term's weight, then parameters
    segments: tuple[str, ...] = _recorded("SEGMENTS")   # segment terms
    segment_means: tuple[str, ...] = _recorded("SEGMENT_MEANS")  # the row values whose per-segment sums they read, in order
    segment_row_terms: tuple[str, ...] = _recorded("SEGMENT_ROW_TERMS")  # the segment terms that are row terms of segment statistics
    segment_sorted: tuple[str, ...] = _recorded("SEGMENT_SORTED")  # the segment means that are sorted sums (S.segment_sorted)
    # those that are batch quantiles (S.row_quantile), each with its q
    segment_quantiles: tuple[tuple[str, float], ...] = _recorded("SEGMENT_QUANTILES")
    state: tuple[str, int, int] = _recorded("STATE")    # what decides the tile: Plan.state
    # each kernel's interface (interface.signatures): each launch's arguments, the fixed ones, the constexprs
    args: tuple[str, ...] = _recorded("ARGS")
    fixed: tuple[str, ...] = _recorded("FIXED")
    constexprs: tuple[str, ...] = _recorded("CONSTEXPRS")
    segment_args: tuple[str, ...] = _recorded("SEGMENT_ARGS", only_with="segments")
    segment_fixed: tuple[str, ...] = _recorded("SEGMENT_FIXED", only_with="segments")
    segment_constexprs: tuple[str, ...] = _recorded("SEGMENT_CONSTEXPRS", only_with="segments")

    @property
    def normalization(self) -> dict[str, str]:
        return dict(self.normalize)

    @property
    def teacher_grad(self) -> bool:
        """Whether the head's kernel writes dL/dteacher_logits (its variant for teacher logits that
        require grad, whose interface takes the gradient's pointer)."""
        return TGRAD_PTR.name in self.args

    @property
    def has_exact(self) -> bool:
        """Whether a launch after the first read's merge computes sums (the exact read's, or top-k
        sums of the final normalisers): plan.launch_sequence's ``has_exact``."""
        return bool(self.exact)

    @property
    def slots(self) -> dict[str, int]:
        """The workspace's fixed slots after each output's value: the loss, the valid-row count, the
        finished-row count; ``fixed``: where the regions given per call start."""
        n = len(self.outputs)
        return dict(loss=n, count=n + 1, done=n + 2, fixed=n + 3)

    @property
    def segment_raw(self) -> tuple[str, ...]:
        """The segment statistics the segment step writes as they are read (sorted sums, quantiles),
        not as sums that the count divides."""
        return self.segment_sorted + tuple(name for name, _ in self.segment_quantiles)

    @classmethod
    def read(cls, module: Any) -> FileSpec:
        """The contract a kernel module's constants record. A constant missing (or written where its
        ``only_with`` field is empty), of the wrong type, or disagreeing with what the others imply
        (``DERIVED_CONSTANTS``) is a ValueError naming it."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            const, only_with = f.metadata["constant"], f.metadata["only_with"]
            written = not only_with or bool(values[only_with])
            if not written:
                if hasattr(module, const):
                    raise ValueError(f"the constant {const} is written, with no {only_with.upper()}")
                values[f.name] = ()
                continue
            if not hasattr(module, const):
                raise ValueError(f"no constant {const} (FileSpec.{f.name}): the file is not one this "
                                 "version of losscodegen writes")
            try:
                values[f.name] = _READERS[f.type](getattr(module, const))
            except TypeError as e:
                raise ValueError(f"the constant {const} (FileSpec.{f.name}) is not {e}") from None
        spec = cls(**values)
        for const, derive in DERIVED_CONSTANTS.items():
            if getattr(module, const, None) != derive(spec):
                raise ValueError(f"the constant {const} is {getattr(module, const, 'missing')!r}, where "
                                 f"the file's other constants make it {derive(spec)!r}")
        return spec


# The constants a file writes that follow from its FileSpec's fields: checked when it is read.
DERIVED_CONSTANTS: dict[str, Callable[[FileSpec], Any]] = {
    "HAS_EXACT": lambda s: s.has_exact, "LOSS": lambda s: s.slots["loss"], "COUNT": lambda s: s.slots["count"],
    "DONE": lambda s: s.slots["done"], "FIXED_SLOTS": lambda s: s.slots["fixed"]}


@dataclass(frozen=True)
class KernelSpec(FileSpec):
    """A head's kernel file's contract (``FileSpec``, what it records), derived from its plan once,
    here, for every backend, with what the renderers alone read: each renderer takes the file's
    contract from it, and its template writes the ``FileSpec`` part as the file's constants. Two
    backends' files of one head agree on all of it by construction."""

    head_scalars: tuple[str, ...] = ()     # the scalars the head's kernel reads
    segment_scalars: tuple[str, ...] = ()  # those the segment kernel reads
    signatures: tuple[Signature, ...] = ()  # the head's kernel, then the segment or row-slices kernel if any

    @property
    def sigs(self) -> dict[str, Signature]:
        """``interface.signatures``' form: by kernel kind (``head_loss``, ``segments``, ``slices``)."""
        return {sig.kind: sig for sig in self.signatures}

    @property
    def recorded(self) -> FileSpec:
        """What the file records of it: what ``FileSpec.read`` gives back from the file."""
        return FileSpec(**{f.name: getattr(self, f.name) for f in fields(FileSpec)})


def kernel_spec(plan: Plan, key: str, normalize: dict[str, str] | None = None) -> KernelSpec:
    """The contract of a plan's kernel file. ``normalize``: each loss term's normalisation ("tokens"
    where not given; a "sequence" term is a segment term); metrics are means over the valid rows."""
    lw = plan.lowered
    segments = tuple(seg.name for seg in lw.segments)
    loss_terms = [w.name[len("w_"):] for w in lw.weights]
    row_loss_terms = tuple(n for n in loss_terms if n not in segments)
    norm = {n: (dict(normalize or {}).get(n, "tokens") if n in loss_terms else "mean") for n in lw.outputs}
    head_exprs = ([a.body for a in lw.accumulators] + [e for _, e in lw.grad_coefs + lw.row_values]
                  + [lw.grad_vocab, lw.grad_topk, lw.grad_teacher])
    seg_exprs = [e for seg in lw.segments for e in (seg.formula, *seg.dformula)]

    def names(exprs: list[sp.Expr]) -> set[str]:
        return {s.name for e in exprs for s in e.free_symbols}
    scalars = tuple(map(weight_name, loss_terms)) + tuple(sorted(
        n for n in names(head_exprs + seg_exprs) if n.startswith(S.RUNTIME_PREFIX)))
    segment_row_terms = tuple(seg.name for seg in lw.segments if seg.rows)
    # (a row term of segment statistics has its direct path in the head's gradient, its weight with it)
    head_scalars = tuple(n for n in scalars if n in names(head_exprs)
                         | set(map(weight_name, row_loss_terms + segment_row_terms)))
    sigs = signatures(plan, key, bool(head_scalars), tuple(n for n in segments if norm[n] == "sequence"),
                      bool(row_loss_terms))
    head_sig, seg_sig = sigs["head_loss"], sigs.get("segments", Signature("", ()))
    return KernelSpec(
        key=key, outputs=tuple(lw.outputs), row_values=tuple(n for n, _ in lw.row_values),
        columns=tuple(c.name for c in plan.columns), exact=tuple(plan.exact), tokens=tuple(lw.tokens),
        vectors=tuple(lw.vectors), uses_labels=lw.uses_labels, uses_teacher=lw.uses_teacher,
        uses_topk=lw.uses_topk, row_loss_terms=row_loss_terms, normalize=tuple(norm.items()), scalars=scalars,
        segments=segments, segment_means=tuple(U.name for seg in lw.segments for U in seg.means),
        segment_row_terms=segment_row_terms, state=plan.state,
        args=head_sig.args, fixed=head_sig.fixed, constexprs=head_sig.constexprs,
        segment_args=seg_sig.args, segment_fixed=seg_sig.fixed, segment_constexprs=seg_sig.constexprs,
        head_scalars=head_scalars,
        segment_scalars=tuple(n for n in scalars if n in names(seg_exprs) | set(map(weight_name, segments))),
        signatures=tuple(sigs.values()),
        segment_sorted=tuple(U.name for seg in lw.segments for U in seg.sorted),
        segment_quantiles=tuple((U.name, q) for seg in lw.segments for U, q in seg.quantiles))


def check_interface(text: str, sigs: dict[str, Signature]) -> None:
    """Refuse a rendered kernel file whose kernels disagree with their declared interface: a kernel
    whose parameters are not the declaration's, or that reads a name it neither takes, assigns, nor
    finds in the file or the builtins (a template that renamed or dropped an argument). Raised here,
    when the file is generated, not when a launch first compiles it."""
    tree = ast.parse(text)
    module_names = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            module_names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module_names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            module_names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for sig in sigs.values():
        fn = functions.get(sig.name)
        if fn is None:
            raise ValueError(f"the template wrote no kernel {sig.name}")
        params = tuple(a.arg for a in fn.args.args)
        if params != sig.names:
            raise ValueError(f"{sig.name}: the template's parameters {params} are not its declared "
                             f"interface {sig.names} (interface.signatures)")
        known = module_names | set(params) | {n.id for n in ast.walk(fn)
                                              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        unknown = sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                         - known)
        if unknown:
            raise ValueError(f"{sig.name} reads {unknown}, which is no argument of its declared interface "
                             f"(interface.signatures) and nothing it assigns")
        unused = sorted(set(sig.args + sig.fixed) - {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)})
        if unused:
            raise ValueError(f"{sig.name}: declared arguments {unused} are never read by the template")
        out_of_scope = _read_out_of_scope(fn, module_names | set(params))
        if out_of_scope:
            raise ValueError(f"{sig.name} reads {out_of_scope} where no assignment reaches (a value "
                             "computed inside a loop is gone after it, in Triton's compiler; its "
                             "interpreter, which runs the loop as Python, would not say so)")


def _read_out_of_scope(fn: ast.FunctionDef, known: set[str]) -> list[str]:
    """The names (with their line) a kernel reads where, in Triton's scoping, nothing defines them:
    a name first assigned inside a loop does not outlive the loop. (The branches of an ``if`` are
    taken as both defining what either does: most conditions are constexprs.)"""
    found: list[str] = []

    def read(node: ast.AST, defined: set[str]) -> None:
        found.extend(f"{n.id} (line {n.lineno})" for n in ast.walk(node)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in defined)

    def stored(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

    def block(stmts: list[ast.stmt], defined: set[str]) -> set[str]:
        for st in stmts:
            if isinstance(st, (ast.For, ast.While)):
                read(st.iter if isinstance(st, ast.For) else st.test, defined)
                block(st.body, defined | (stored(st.target) if isinstance(st, ast.For) else set()))
            elif isinstance(st, ast.If):
                read(st.test, defined)
                defined = defined | block(st.body, set(defined)) | block(st.orelse, set(defined))
            elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                if st.value is not None:
                    read(st.value, defined)
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name) and st.target.id not in defined:
                    found.append(f"{st.target.id} (line {st.lineno})")
                for t in targets:   # (a subscript or attribute target reads its base)
                    if not isinstance(t, ast.Name):
                        read(t, defined)
                defined = defined | set().union(*(stored(t) for t in targets))
            else:
                read(st, defined)
        return defined

    block(fn.body, set(known))
    return sorted(set(found))


# The kernel's flag buffer: one slot a kind of bad value, in this order (validation.py reads them).
FLAG_SLOTS = ("label", "segment_id", "topk_id", "topk_repeated")
_TEXT_HASH = re.compile(rb'\nTEXT_HASH = "([0-9a-f]{64})"\n\Z')


def seal(text: str) -> str:
    """A kernel file's text ending with the sha256 of everything before that line: a loader tells a
    damaged file (truncated, edited, not text) from an intact one before running it."""
    text = text if text.endswith("\n") else text + "\n"
    text += "# TEXT_HASH: the sha256 of this file up to its last line (a file that does not match is never used)\n"
    return f'{text}TEXT_HASH = "{hashlib.sha256(text.encode()).hexdigest()}"\n'


def intact(data: bytes) -> bool:
    """Whether a kernel file's bytes match the hash ``seal`` wrote at their end."""
    found = _TEXT_HASH.search(data)
    return found is not None and hashlib.sha256(data[:found.start() + 1]).hexdigest() == found.group(1).decode()


