"""Launch configurations: ``(BLOCK_V, num_warps, split)`` for a call. The runtime's choice, not the
compiler's: a generated kernel takes its tile as constexprs, and nothing here is hashed into it.

The best tile depends on what a program keeps and loads per element (its file's ``SPEC.state``: the
streams of the first read, its running sums, the sums of an exact read), on the vocabulary a rank
holds and on the width of the logits; ``split`` runs a call's reads as separate launches (stats,
exact, rows and gradient) when that is faster than one launch holding them all. Where a
configuration comes from, in order:

1. the user's measurements (``$LOSSCODEGEN_CACHE/tiles.json``, written by
   ``python -m losscodegen tune``: tune.py) and the table measured on an H100 and an H200
   that ships with the package (``tiles.json``), keyed by GPU, state, vocabulary bucket and width;
2. otherwise the rule (``rule``: the best of the H100 sweep at 128256 for the nearest state).
Nothing is measured inside a user's call, unless the user asks for it: with
``LOSSCODEGEN_TUNE=first-use``, a call on a GPU whose tile neither table has is measured once, as
``python -m losscodegen tune`` would, and kept in the user's table (the backend's ``config``).

Whatever its source, a tile is ``fit`` to the device's warp: a block holds at most 1024 threads on
every NVIDIA and AMD GPU, and the table and the rule were measured with warps of 32 threads. On an
AMD GPU (a wavefront of 64 threads on CDNA: MI300's gfx942, MI355's gfx950) 32 warps would be a
block of 2048 threads, which no launch accepts: there the warps are halved, so that the block has
the 1024 threads the rule measured, each loading the same elements of the same tile. On an NVIDIA
GPU without an entry (Blackwell's sm_100 and sm_120 among them) the rule's tiles launch as they are:
1024 threads at most, and at most 256 B of shared memory a block for every manifest kernel, against
the 99 KB of sm_120's (``python -m losscodegen build``: portable.py). Their speed there is not measured.

A vocab-parallel call takes ``SHARDED``, by the streams of its first read (measuring would time
collectives, whose ranks must run in step). Small tiles win there for every state (many rows in
flight hide the exchange's latency): on 2 H200s at 8192 x 128256, CE 0.785 ms at (4096, 8) against
1.149 at (32768, 32). With a teacher stream, 4 warps beat 8 on 2 and on 4 H200s (the FKL mix 1.29
against 1.40 ms on 2, 0.77 against 0.90 on 4; JSD 1.92 against 2.11, 1.04 against 1.13); with the
logits alone, 8 beat 4 (CE 0.775 against 0.804 on 2, 0.497 against 0.512 on 4).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from ... import load
from ...interface import FileSpec
from ...plan import pow2


SHARDED = {"x": (4096, 8), "xt": (4096, 4)}   # by the first read's streams
MAX_THREADS = 1024      # a block's threads: the most any NVIDIA or AMD GPU launches
SHIPPED = Path(__file__).resolve().parent / "tiles.json"


@dataclass(frozen=True)
class Config:
    """``maxnreg``: a cap on each thread's registers (ptxas's), where a table entry was measured
    faster with it. ptxas's own count moves with code far from the loops: a change to the gradient
    read alone took GRPO + entropy + clip from 80 registers to 102 under Triton 3.6 (2 programs of 8
    warps on a multiprocessor instead of 3, warps active 37% -> 25%, 2% slower on an H200), and 80
    gives the 3 back with no spill. A kernel that spills much under a cap runs without it after its
    first launch (dispatch.SPILL_LIMIT)."""
    block_v: int
    num_warps: int
    split: bool = False
    maxnreg: int | None = None
    kernel = "head_loss"     # the file's kernel it launches (interface.Signature.kind)

    def launch(self, V: int, element_size: int) -> dict:
        """Kernel options for a vocabulary of V (per rank) and logits of ``element_size`` bytes: the
        tile keeps its bytes for wider logits, and shrinks with its warps to a small vocabulary."""
        block_v = self.block_v * 2 // max(element_size, 2)
        block = min(pow2(V), block_v)
        options = dict(BLOCK_V=block, num_warps=max(4, self.num_warps * block // block_v))
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def __repr__(self) -> str:
        # (explain() prints a tile: the cap only where an entry has one)
        cap = "" if self.maxnreg is None else f", maxnreg={self.maxnreg}"
        return f"Config(block_v={self.block_v}, num_warps={self.num_warps}, split={self.split}{cap})"

    def entry(self) -> list:
        """The table's form: [block_v, num_warps, split], and the register cap where there is one."""
        return [self.block_v, self.num_warps, self.split] + ([self.maxnreg] if self.maxnreg is not None else [])


@dataclass(frozen=True)
class Slices:
    """The row-slices kernel (issue 47; templates/gluon/_slices.j2): a row split over G programs of
    ``columns`` columns each (a power of 2, for 2-byte logits), each slice held in shared memory in
    ``nbuf`` buffers (``nbuf - 1`` rows' copies in flight), ``num_warps`` warps; every program resident
    at once (a cooperative launch), in groups of G. ``fallback``: the tile of a call it does not
    serve (a launch a read, the gradient in backward)."""
    columns: int
    num_warps: int
    nbuf: int = 2
    copy_bytes: int = 16    # a thread's columns of a chunk (and of a copy), in bytes of the widest logits
    fallback: Config = Config(4096, 8)
    split = False
    kernel = "slices"

    def launch(self, V: int, element_size: int) -> dict:
        """The constexprs and options for V columns a rank: BLOCK_V a chunk of 16 bytes a thread (of
        the widest logits), G programs a row, N_CHUNKS chunks a slice (Gluon's shapes: powers of 2)."""
        # (2 columns a thread at least: a copy of a 2-byte stream beside a 4-byte one is 4 bytes, the least
        # an asynchronous copy moves)
        block_v = max(self.copy_bytes // element_size, 2) * 32 * self.num_warps
        # slices of at most ``columns`` (a power of 2 of whole chunks), as few as cover the row; G of them,
        # every one holding some of it
        width = max(pow2(-(-V // -(-V // self.columns))), block_v)
        G = -(-V // width)
        return dict(BLOCK_V=block_v, G=G, N_CHUNKS=width // block_v, NBUF=self.nbuf, num_warps=self.num_warps,
                    launch_cooperative_grid=True)

    def __repr__(self) -> str:
        small = "" if self.copy_bytes == 16 else f", copy_bytes={self.copy_bytes}"
        return f"Slices(columns={self.columns}, num_warps={self.num_warps}, nbuf={self.nbuf}{small})"

    def entry(self) -> list:
        """The table's form: ["slices", columns, num_warps, nbuf, copy_bytes]."""
        return ["slices", self.columns, self.num_warps, self.nbuf, self.copy_bytes]


def of_entry(entry: list) -> Config | Slices:
    """A table entry (``entry()``'s form) as its configuration."""
    return Slices(*entry[1:]) if entry[0] == "slices" else Config(*entry)


def key(device: torch.device, spec: FileSpec, V: int, element_size: int) -> str:
    streams, online, exact = spec.state
    bucket = max(pow2(V), 4096)
    return f"{torch.cuda.get_device_name(device)}|{streams}/{online}/{exact}|{bucket}|{element_size}"


class _Table:
    """The shipped table and the user's measurements (which win), read once."""

    def __init__(self) -> None:
        self._entries: dict[str, list] | None = None

    def _path(self) -> Path:
        return load.cache_dir() / "tiles.json"

    def get(self, name: str) -> Config | None:
        if self._entries is None:
            self._entries = {}
            for path in (SHIPPED, self._path()):
                if path.exists():
                    self._entries.update(json.loads(path.read_text()))
        entry = self._entries.get(name)
        return None if entry is None else of_entry(entry)

    def put(self, name: str, config: Config | Slices) -> None:
        self.get(name)
        self._entries[name] = config.entry()
        path = self._path()
        mine = json.loads(path.read_text()) if path.exists() else {}
        mine[name] = self._entries[name]
        load.write_atomic(path, json.dumps(mine, indent=1, sort_keys=True) + "\n")


TABLE = _Table()


def rule(state: tuple[str, int, int]) -> Config:
    """(BLOCK_V, num_warps) for a large vocabulary of 2-byte logits, as measured best on an H100 at
    128256 (docs/performance.md; ``Config.launch`` keeps the tile's bytes for wider inputs). The
    per-element state decides: registers run out first for a pass that also streams the teacher,
    then for one that keeps several running sums."""
    streams, online, _ = state
    if "t" in streams:
        return Config(4096, 8)
    return Config(32768, 32) if online <= 1 else Config(16384, 16)


def choose(head, k: ModuleType, V: int, dtype: torch.dtype, device: torch.device, *,
           sharded: bool = False) -> Config | Slices:
    """The configuration for a call of ``head`` over V vocabulary columns a rank of ``dtype`` logits:
    ``head.tile_override`` (set while ``python -m losscodegen tune`` measures), else as the
    module's doc says. The row-slices kernel only where a measurement chose it, on a GPU whose
    Triton has Gluon (its fallback the rule's tile)."""
    if head.tile_override is not None:
        config = head.tile_override
    elif sharded:
        config = Config(*SHARDED[k.SPEC.state[0]])
    else:
        config = measured(k, V, dtype, device) or rule(k.SPEC.state)
    if isinstance(config, Slices):
        return replace(config, fallback=fit(rule(k.SPEC.state), lanes(device)))
    return fit(config, lanes(device))


def measured(k: ModuleType, V: int, dtype: torch.dtype, device: torch.device) -> Config | Slices | None:
    """The tables' entry for a call on a GPU (the user's measurements, else the shipped ones), or None."""
    if device.type != "cuda":
        return None
    return TABLE.get(key(device, k.SPEC, V, dtype.itemsize))


def lanes(device: torch.device) -> int:
    """Threads in a warp of ``device`` (a wavefront on AMD: 64 on CDNA); 32 off a GPU (Triton's
    interpreter)."""
    if device.type != "cuda":
        return 32
    return getattr(torch.cuda.get_device_properties(device), "warp_size", 32)


def fit(config: Config, lanes: int) -> Config:
    """``config`` with no more warps than a block of ``MAX_THREADS`` holds, for warps of ``lanes``
    threads; the tile's width kept (16 wavefronts of 64 are the 1024 threads of 32 warps of 32, each
    loading the same elements)."""
    most = MAX_THREADS // lanes
    return config if config.num_warps <= most else replace(config, num_warps=most)
