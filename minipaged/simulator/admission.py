"""The systems the vLLM paper measures paging against, as admission policies (lesson 13).

Before paging, a serving system gave each request one *contiguous* region of KV memory for its
whole life, reserved when it was admitted (the paper's Orca variants, lesson 01 counts their
waste):

    max      max_model_len slots: the output length is unknown, plan for the worst (Orca (Max))
    pow2     the next power of two of the request's true length (Orca (Pow2))
    oracle   exactly its true length, prompt + output - 1 (Orca (Oracle): knows the future)

`ReservationAdmission` puts that rule in front of the real scheduler: a waiting request is
admitted, first come first served, only when a first-fit `ContiguousAllocator` over the same
number of KV slots finds a hole for its region; the region is freed when it finishes. Because a
region covers everything the request will ever write, a reserved request never runs out of
memory (the block manager underneath is given headroom for its rounding and never preempts);
everything else (iteration-level scheduling, the token budget, chunked prefill) is the paged
engine's, so the comparison isolates the memory policy, as the paper's does.

`StaticBatching` is request-level batching (the paper's FasterTransformer): a batch of requests
starts together and no request joins until every one of them has finished; its memory is
reserved at `max_model_len` per request. (FasterTransformer also computes padding rows for the
finished members of a batch; here they cost nothing, so static batching is if anything
favoured.)

Both are scheduler mixins for `simulate(..., base=...)` (clock.py), composed like the engine's
own policies (`engine/build.py: compose`).
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.build import compose
from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus

RESERVATIONS = ("max", "pow2", "oracle")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def reservation(strategy: str, kv_len: int, max_model_len: int) -> int:
    """Slots a contiguous strategy reserves for a request that writes `kv_len` K/V entries
    over its life (prompt + output - 1)."""
    if strategy == "max":
        return max_model_len
    if strategy == "pow2":
        return min(next_pow2(kv_len), max_model_len)
    if strategy == "oracle":
        return kv_len
    raise ValueError(f"unknown contiguous strategy {strategy!r}; choose from {RESERVATIONS}")


class ContiguousAllocator:
    """First-fit allocation of contiguous regions in a linear array of `capacity` slots."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.regions: dict[int, tuple[int, int]] = {}  # owner -> (start, size)

    def holes(self) -> list[tuple[int, int]]:
        """Free (start, size) runs, in address order."""
        out, pos = [], 0
        for start, size in sorted(self.regions.values()):
            if start > pos:
                out.append((pos, start - pos))
            pos = start + size
        if pos < self.capacity:
            out.append((pos, self.capacity - pos))
        return out

    @property
    def free_slots(self) -> int:
        return self.capacity - sum(size for _, size in self.regions.values())

    @property
    def largest_hole(self) -> int:
        return max((size for _, size in self.holes()), default=0)

    def allocate(self, owner: int, size: int) -> Optional[int]:
        """Start of the first hole that fits `size`, or None."""
        for start, hole in self.holes():
            if hole >= size:
                self.regions[owner] = (start, size)
                return start
        return None

    def free(self, owner: int) -> None:
        del self.regions[owner]


class ReservationAdmission:
    """Mixin over `Scheduler`: admit only with a contiguous region reserved (see above)."""

    def __init__(self, *args, reservation: str, kv_capacity: int, max_model_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        if reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {reservation!r}")
        self.reservation = reservation
        self.max_model_len = max_model_len
        self.allocator = ContiguousAllocator(kv_capacity)

    def region_size(self, seq: Sequence) -> int:
        kv_len = seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1
        return reservation(self.reservation, kv_len, self.max_model_len)

    def admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Optional[int]:
        """First come, first served: the head waits (and so does everyone behind it) until a
        hole fits its region."""
        new = seq.seq_id not in self.allocator.regions
        if new and self.allocator.allocate(seq.seq_id, self.region_size(seq)) is None:
            return None
        n = super().admit(seq, out, budget)
        if n is None and new:
            self.allocator.free(seq.seq_id)
        return n

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        super().finish(seq, status)
        self.allocator.regions.pop(seq.seq_id, None)


class StaticBatching(ReservationAdmission):
    """Mixin over `Scheduler`: a new batch starts only when the last one has finished."""

    def __init__(self, *args, kv_capacity: int, max_model_len: int, **kwargs):
        super().__init__(*args, reservation="max", kv_capacity=kv_capacity,
                         max_model_len=max_model_len, **kwargs)
        self.batch_open = True  # requests may join until the batch's first decode step

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            self.batch_open = True
        out = super().schedule()
        if self.running and all(not s.is_prefill for s in out.scheduled):
            self.batch_open = False  # the batch is decoding: closed until it has drained
        return out

    def admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Optional[int]:
        return super().admit(seq, out, budget) if self.batch_open else None


def scheduler_base(system: str) -> tuple[type, dict]:
    """(scheduler class, what it needs besides the engine's knobs as names) of a system:
    "paged" (minipaged), "orca-max" / "orca-pow2" / "orca-oracle", "static"."""
    if system == "paged":
        return Scheduler, {}
    if system == "static":
        return compose(Scheduler, (StaticBatching,)), {"kv_capacity", "max_model_len"}
    if system.startswith("orca-") and system[5:] in RESERVATIONS:
        return compose(Scheduler, (ReservationAdmission,)), {"kv_capacity", "max_model_len",
                                                               "reservation"}
    raise ValueError(f"unknown system {system!r}; choose from paged, static, "
                     + ", ".join(f"orca-{r}" for r in RESERVATIONS))
