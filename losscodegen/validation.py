"""Value checks on the device, without a host sync.

The kernel checks every row's label (and segment id) itself. A bad one makes that row's values and
gradient NaN, so the call's loss is NaN, and is recorded in a small flag buffer of the head:
``[label_flag, label, segment_flag, segment_id]``. On the CPU the host reads the flag right after
the call and raises at once. On a GPU, reading it would wait for the kernel, so the call ends with a
non-blocking copy of the flag into pinned memory and an event; the head's next call reads that copy
(by then long written) and raises. If the GPU has not yet finished the previous call, the next one
waits for it, so an error is never reported later than the next call. Inside a CUDA graph capture
nothing is copied: a replayed call still makes the loss NaN, and the flag is read by the next call
made outside the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Flags:
    device: torch.Tensor                 # int64 [4], written by the kernel
    host: torch.Tensor | None            # pinned copy (GPU only)
    event: torch.cuda.Event | None
    pending: bool = False                # a copy of a finished call's flag is on its way
    vocab: int = 0                       # what the recorded call checked against, for the message
    num_segments: int = 0


class DeviceChecks:
    """A head's flag buffer on each device, and the deferred check."""

    def __init__(self) -> None:
        self._flags: dict[torch.device, _Flags] = {}

    def before(self, device: torch.device) -> torch.Tensor:
        """The flag buffer for this call's kernels; raises for a bad value of the previous call."""
        f = self._flags.get(device)
        if f is None:
            cuda = device.type == "cuda"
            f = self._flags[device] = _Flags(
                torch.zeros(4, dtype=torch.int64, device=device),
                torch.zeros(4, dtype=torch.int64, pin_memory=True) if cuda else None,
                torch.cuda.Event() if cuda else None)
        elif f.pending and not torch.cuda.is_current_stream_capturing():
            if not f.event.query():
                f.event.synchronize()
            f.pending = False
            self._raise_if_set(f, f.host, "an earlier call of this head")
        return f.device

    def after(self, device: torch.device, vocab: int, num_segments: int) -> None:
        """Once the call's kernels are queued: raise now (CPU), or start the copy (GPU)."""
        f = self._flags[device]
        f.vocab, f.num_segments = vocab, num_segments
        if f.host is None:
            self._raise_if_set(f, f.device, "this call")
        elif not torch.cuda.is_current_stream_capturing():
            f.host.copy_(f.device, non_blocking=True)
            f.event.record()
            f.pending = True

    @staticmethod
    def _raise_if_set(f: _Flags, flag: torch.Tensor, when: str) -> None:
        label_bad, label, seg_bad, seg = flag.tolist()
        if not (label_bad or seg_bad):
            return
        f.device.zero_()
        if f.host is not None:
            f.host.zero_()
        if label_bad:
            raise ValueError(f"labels: values must be in [0, {f.vocab}) or ignore_index; found {label} "
                             f"in {when} (its loss is NaN)")
        raise ValueError(f"segment_ids of valid rows must be in [0, num_segments={f.num_segments}); "
                         f"found {seg} in {when} (its loss is NaN)")
