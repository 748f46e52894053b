"""Swap preemption in the scheduler (lesson 06, `preemption_mode="swap"`).

`SwapPreemption` is a mixin over the `Scheduler` (engine/scheduler.py), composed in once when the
engine is built (engine/build.py). It changes one seam, the preemption mode: a victim's blocks
are copied to the CPU pool (`SwapBlockManager`, block_manager.py here) and it waits in
`swapped`; if the CPU pool is full it falls back to recompute. Swapped-out gangs come back
(copied to fresh GPU blocks) before any waiting request is admitted, oldest first.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from minipaged.engine.scheduler import ScheduledSeq, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus


class SwapPreemption:
    """Mixin over `Scheduler`: preempt by swapping out to the CPU pool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.swapped: deque[list[Sequence]] = deque()  # swapped-out gangs, oldest first

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.swapped)

    def seqs(self) -> Iterator[Sequence]:
        yield from super().seqs()
        for seqs in self.swapped:
            yield from seqs

    def preempt(self, victims: list[Sequence], out: SchedulerOutput,
                pending: dict[int, int]) -> None:
        bm = self.block_manager
        if not bm.can_swap_out(victims):
            return super().preempt(victims, out, pending)  # recompute
        # A copy-on-write dropped from the step: its source block still holds the data.
        out.blocks_to_swap_out += [(pending.get(g, g), c) for g, c in bm.swap_out(victims)]
        for s in victims:
            s.status = SequenceStatus.SWAPPED
        self.swapped.appendleft(victims)
        out.swapped_out += victims

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Swapped-out gangs come back first; waiting ones are admitted only once none is left
        (first come, first served), and not in a step that gave one up to recompute."""
        if self.swapped:
            budget = self._swap_in(out, budget)
        if self.swapped or out.preempted:
            return budget
        return super()._admit_waiting(out, budget)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped-out gangs back while seats and blocks last; schedule their tokens."""
        bm = self.block_manager
        while self.swapped:
            seqs = self.swapped[0]
            if not self.can_admit(seqs[0]) or not self.has_seats(seqs):
                break
            # Their blocks, plus room for this step's tokens (a new block or a copy-on-write each).
            room = sum(bm.num_blocks_for(s.num_tokens) - len(bm.cpu_block_tables[s.seq_id]) + 1
                       for s in seqs)
            if bm.num_swap_in_blocks(seqs) + room > bm.num_free_blocks:
                if not self.running:  # it cannot come back even to an empty cache: recompute
                    self.swapped.popleft()
                    super().preempt(seqs, out, {})
                    out.preempted += seqs
                    continue
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += bm.swap_in(seqs)
            out.swapped_in += seqs
            for s in seqs:
                self.enter_running(s)
                n = min(s.num_uncomputed_tokens, budget)
                if n == 0:
                    continue  # out of budget this step, or a beam already holding its logits
                out.blocks_to_copy += bm.append_slots(s, n)
                out.scheduled.append(ScheduledSeq(s, n, s.is_prefill,
                                                  s.num_computed_tokens + n == s.num_tokens))
                budget -= n
        return budget

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.SWAPPED:
            for seqs in self.swapped:
                if seq in seqs:
                    seqs.remove(seq)
                    if not seqs:
                        self.swapped.remove(seqs)
                    break
        super().finish(seq, status)
