"""Value checks on the device, without a host sync.

The kernel checks every row's label (and segment id) itself. A bad one makes that row's values and
gradient NaN, so the call's loss is NaN, and the kernel writes the bad value into the head's flag
buffer: ``[bad label, bad segment id]``, each slot ``NONE`` until a bad value comes (one 8-byte
store, so a reader never sees half of one). On a GPU the buffer is pinned host memory that the
kernel writes across the bus: no copy a call. On the CPU the host reads it right after the call and
raises at once; on a GPU each call reads it first and raises for what earlier calls found.

In a training step the previous call finished long ago, so an error comes at the next call. When
the host runs more than one call ahead of the GPU (a tight loop of head calls), a call does not
wait for the previous one: that would leave the GPU idle while the host prepares each call
(measured: 16% at 8192 x 128256). Once its kernels are queued, a call waits for the call two before
it if that one is still running, so an error comes at the latest two calls later, and the GPU keeps
two calls of work while the host prepares the next. Inside a CUDA graph capture nothing is waited
for: a replayed call still makes the loss NaN and writes the buffer, which the next call made outside
the graph reads.
"""
from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass, field

import torch

NONE = -(2 ** 63)   # a slot that holds no bad value


@dataclass
class _Flags:
    buffer: torch.Tensor                 # int64 [2], written by the kernel
    pending: deque = field(default_factory=deque)  # events of calls maybe still running, oldest first
    free: list = field(default_factory=list)       # events to reuse
    vocab: int = 0                       # what the recorded call checked against, for the message
    num_segments: int = 0

    def __post_init__(self) -> None:
        # the buffer's two slots read and written as host memory: no torch op a call
        self.slots = (ctypes.c_int64 * 2).from_address(self.buffer.data_ptr())


class DeviceChecks:
    """A head's flag buffer on each device, and the deferred check."""

    def __init__(self, ignore_index: int) -> None:
        self.ignore_index = ignore_index
        self._flags: dict[torch.device, _Flags] = {}

    def before(self, device: torch.device) -> torch.Tensor:
        """The flag buffer for this call's kernels; raises for a bad value that an earlier call has
        written by now (a read of host memory: nothing waits here)."""
        f = self._flags.get(device)
        if f is None:
            f = self._flags[device] = _Flags(torch.full((2,), NONE, dtype=torch.int64,
                                                        pin_memory=device.type == "cuda"))
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self._raise_if_set(f, "an earlier call of this head")
        return f.buffer

    def after(self, device: torch.device, vocab: int, num_segments: int) -> None:
        """Once the call's kernels are queued: raise now (CPU); on a GPU, mark the call's end and, if
        the call two before it is still running, wait for that one and raise for what it found.
        (Waiting after this call's launches, not before them, leaves the GPU two calls of work
        while the host prepares the next.)"""
        f = self._flags[device]
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
        label, seg = f.slots
        if label == NONE and seg == NONE:
            return
        f.slots[0] = f.slots[1] = NONE
        if label != NONE:
            raise ValueError(f"labels: values must be in [0, {f.vocab}) or ignore_index="
                             f"{self.ignore_index}; found {label} in {when} (its loss is NaN)")
        raise ValueError(f"segment_ids of valid rows must be in [0, num_segments={f.num_segments}); "
                         f"found {seg} in {when} (its loss is NaN)")
