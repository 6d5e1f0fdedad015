"""Value checks on the device, without a host sync.

The kernel checks every valid row's label, segment id and teacher top-k ids itself. A bad one makes
that row's values and gradient NaN, so the call's loss is NaN, and the kernel writes the bad value
into the flag buffer: one slot a kind of bad value (``interface.FLAG_SLOTS``), each holding its clear value
(``CLEAR``) until a bad value comes (one 8-byte store, so a reader never sees half of one). A slot's
clear value is one the kernel never writes there, so every bad value is seen, -2**63 too. On a GPU
the buffer is pinned host memory that the kernel writes across the bus: no copy a call. On the CPU
the host reads it right after the call and raises at once; on a GPU each call reads it first and
raises for what earlier calls found.

In a training step the previous call finished long ago, so an error comes at the next call. When
the host runs more than one call ahead of the GPU (a tight loop of head calls), a call does not
wait for the previous one: that would leave the GPU idle while the host prepares each call
(measured: 16% at 8192 x 128256). Once its kernels are queued, a call waits for the call two before
it if that one is still running, so an error comes at the latest two calls later, and the GPU keeps
two calls of work while the host prepares the next. Inside a CUDA graph capture nothing is waited
for: a replayed call still makes the loss NaN and writes the buffer (the capturing thread's), which
that thread's next call made outside the graph reads.

Each thread has its own flag buffers (one a device): a call's bad value is reported to the thread
that made the call, never to another thread calling the same head at the same time.
"""
from __future__ import annotations

import ctypes
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from .interface import FLAG_SLOTS

# Each slot's value while it holds no bad value: one the kernel never writes there. 0 is a label and a
# top-k id in range (V >= 1), and a segment id in range wherever there is a segment (num_segments=0
# is the one call with none: inputs.check_rows makes its ids negative). A repeated top-k id may be any
# id, but one out of range also fills the "topk_id" slot, which is read first: -2**63 is only ever
# read there after an out-of-range id was reported.
CLEAR = {"label": 0, "segment_id": 0, "topk_id": 0, "topk_repeated": -(2 ** 63)}
_CLEAR = [CLEAR[slot] for slot in FLAG_SLOTS]


@dataclass
class _Flags:
    buffer: torch.Tensor                 # int64 [len(FLAG_SLOTS)], written by the kernel
    pending: deque = field(default_factory=deque)  # events of calls maybe still running, oldest first
    free: list = field(default_factory=list)       # events to reuse
    vocab: int = 0                       # what the recorded call checked against, for the message
    num_segments: int = 0

    def __post_init__(self) -> None:
        # the buffer's slots read and written as host memory: no torch op a call
        self.slots = (ctypes.c_int64 * len(FLAG_SLOTS)).from_address(self.buffer.data_ptr())


class DeviceChecks:
    """A head's flag buffers, one a thread and device, and the deferred check."""

    def __init__(self, ignore_index: int) -> None:
        self.ignore_index = ignore_index
        self._local = threading.local()    # .flags: this thread's {device: _Flags}

    def _flags(self, device: torch.device) -> _Flags:
        try:
            return self._local.flags[device]
        except AttributeError:
            self._local.flags = {}
        except KeyError:
            pass
        f = self._local.flags[device] = _Flags(torch.tensor(_CLEAR, dtype=torch.int64,
                                                            pin_memory=device.type == "cuda"))
        return f

    def before(self, device: torch.device) -> torch.Tensor:
        """This thread's flag buffer for this call's kernels; raises for a bad value that an earlier
        call has written by now (a read of host memory: nothing waits here)."""
        f = self._flags(device)
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self._raise_if_set(f, "an earlier call of this head")
        return f.buffer

    def after(self, device: torch.device, vocab: int, num_segments: int) -> None:
        """Once the call's kernels are queued: raise now (CPU); on a GPU, mark the call's end and, if
        the call two before it is still running, wait for that one and raise for what it found.
        (Waiting after this call's launches, not before them, leaves the GPU two calls of work
        while the host prepares the next.)"""
        f = self._flags(device)
        f.vocab, f.num_segments = vocab, num_segments
        if device.type != "cuda":
            self._raise_if_set(f, "this call")
        elif not torch.cuda.is_current_stream_capturing():
            event = f.free.pop() if f.free else torch.cuda.Event()
            event.record()
            f.pending.append(event)
            if len(f.pending) > 2:
                f.pending[0].synchronize()
                f.free.append(f.pending.popleft())
                self._raise_if_set(f, "an earlier call of this head")

    def _raise_if_set(self, f: _Flags, when: str) -> None:
        found = f.slots[:]     # (one read of host memory a call: keep the clean case cheap)
        if found == _CLEAR:
            return
        f.slots[:] = _CLEAR
        found = dict(zip(FLAG_SLOTS, found))
        label, seg, topk, repeated = (found[s] for s in ("label", "segment_id", "topk_id", "topk_repeated"))
        if label != CLEAR["label"]:
            raise ValueError(f"labels: values must be in [0, {f.vocab}) or ignore_index="
                             f"{self.ignore_index}; found {label} in {when} (its loss is NaN)")
        if seg != CLEAR["segment_id"]:
            if f.num_segments == 0:   # (the value says nothing: a given 0's ids were made negative)
                raise ValueError(f"segment_ids of valid rows must be in [0, num_segments), and num_segments was "
                                 f"0 (given, or the largest id of a valid row plus one): a valid row has no "
                                 f"segment in {when} (its loss is NaN)")
            # (a negative id: ids that only group rows are compacted, and num_segments is not the user's)
            bound = "be non-negative" if seg < 0 else f"be in [0, num_segments={f.num_segments})"
            raise ValueError(f"segment_ids of valid rows must {bound}; found {seg} in {when} (its loss is NaN)")
        if topk != CLEAR["topk_id"]:
            raise ValueError(f"teacher_topk_ids of valid rows must be in [0, {f.vocab}); found {topk} "
                             f"in {when} (its loss is NaN)")
        raise ValueError(f"teacher_topk_ids must not repeat an id within a valid row; found {repeated} "
                         f"twice in a row in {when} (its loss is NaN)")
