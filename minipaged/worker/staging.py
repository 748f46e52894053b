"""Pinned host buffers a step's small inputs are written into, then copied in one go (lesson 08).

Each step the GPU runner builds a few small arrays on the host (token ids, positions, slots,
block tables, lengths) and sends them to the GPU. A copy that must not make the host wait for
the kernels already queued has to come from pinned (page-locked) memory, and pinning a fresh
buffer per array every step costs host time, which sets the pace of a one-stream decode step
(lesson 08; benchmarks/experiments/decode_step/host_ab_h200.json).

`StepStaging` keeps a few pinned buffers and hands them out in turn. `stage(parts)` lays the
parts out in the next buffer, each starting at a multiple of `ALIGN_BYTES` (Triton compiles a
kernel variant per pointer alignment it sees, so the parts keep one alignment step after step),
and returns numpy views to write into; `Staged.to_device()` sends the used bytes in one copy and
returns the parts as views of one device buffer. Before a buffer is written again, the host
waits for the copy that last read it (an event recorded after that copy). The copy was queued
`num_slots` steps earlier, so the wait is normally already over.

On the CPU nothing is pinned and `to_device()` returns copies, so no step's tensors share
memory with a later step's buffer.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

ALIGN_BYTES = 256  # each part starts at a multiple of this many bytes (32 int64s, 64 int32s)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class Staged:
    """One step's parts in a staging buffer: `host` (numpy views to fill), then `to_device()`."""

    def __init__(self, staging: "StepStaging", slot: int, host: list[np.ndarray],
                 spans: list[tuple[int, int, torch.dtype]], nbytes: int):
        self.staging, self.slot, self.host = staging, slot, host
        self.spans, self.nbytes = spans, nbytes  # [(start byte, bytes, dtype)], bytes used

    def to_device(self) -> list[torch.Tensor]:
        """The parts on the staging's device, as laid out on the host (1-D, their dtypes)."""
        data = self.staging.upload(self.slot, self.nbytes)  # (nbytes,) uint8
        return [data[start:start + n].view(dtype) for start, n, dtype in self.spans]


class StepStaging:
    def __init__(self, device: torch.device, num_slots: int = 4):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: list[Optional[torch.Tensor]] = [None] * num_slots  # (capacity,) uint8
        self.copied: list[Optional[torch.cuda.Event]] = [None] * num_slots  # last copy from each
        self.next_slot = 0

    def _next_buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot and its buffer, at least `nbytes` long, once nothing copies from it."""
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.buffers)
        buffer = self.buffers[slot]
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the copy that last used this buffer is done
        if buffer is None or buffer.numel() < nbytes:  # grows to the largest step seen
            size = max(_aligned(max(nbytes, 1)), 2 * (0 if buffer is None else buffer.numel()))
            buffer = self.buffers[slot] = torch.empty(size, dtype=torch.uint8,
                                                      pin_memory=self.pinned)
        return slot, buffer

    def stage(self, parts: list[tuple[torch.dtype, int]]) -> Staged:
        """Room for `parts` [(dtype, number of elements)] in the next buffer; `Staged.host`
        holds their numpy views (contents undefined: the caller writes every element it sends)."""
        spans, total = [], 0
        for dtype, n in parts:
            nbytes = dtype.itemsize * n
            spans.append((total, nbytes, dtype))
            total += _aligned(nbytes)
        slot, buffer = self._next_buffer(total)
        host = [buffer[start:start + nbytes].view(dtype).numpy() for start, nbytes, dtype in spans]
        return Staged(self, slot, host, spans, total)

    def upload(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of buffer `slot` on the device, (nbytes,) uint8."""
        source = self.buffers[slot][:nbytes]
        if not self.pinned:
            return source.clone()
        data = source.to(self.device, non_blocking=True)
        event = self.copied[slot] or torch.cuda.Event()
        event.record()  # once it completes, the buffer may be written again
        self.copied[slot] = event
        return data
