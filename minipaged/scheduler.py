"""Continuous batching: which sequences run in the next step, and how many tokens each.

Lesson 03 replays this file's decisions as a Gantt chart. Scheduling is per *iteration* (Orca):
every step is planned anew, so a finished sequence's seat is refilled at once instead of waiting
for the slowest member of a static batch.

Each step fills a token budget (`max_num_batched_tokens`) with at most `max_num_seqs` sequences:

1. running sequences that are decoding (1 token each), oldest first;
2. running sequences still in the middle of a chunked prefill (as many tokens as the budget has);
3. waiting sequences, in arrival order, while budget, seats and blocks last. With chunked
   prefill a long prompt is split across steps, so prefill and decode share a step.

Before promising any tokens it asks the `BlockManager` for room. When the cache is full a running
sequence is *preempted* by recompute (vLLM's default): the most recently admitted one gives up
all its blocks and goes back to the front of the waiting queue; when readmitted it prefills its
prompt and everything it had generated (prefix-cache hits can make that cheap).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minipaged.block_manager import BlockManager
from minipaged.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step (a prefill chunk, or 1 for decode)
    is_prefill: bool  # more than the newest token (prompt, chunk, or recompute)
    samples: bool  # this step reaches the sequence's last known token, so it samples the next


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step plan ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1 + 2: running sequences, decodes first, then unfinished prefill chunks.
        decodes = [s for s in self.running if not s.is_prefill]
        chunks = [s for s in self.running if s.is_prefill]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_append(seq, n):
                victim, returned = self._preempt_last(out)
                budget += returned  # the victim may already have been scheduled this step
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # Keep the n that can_append approved: budget returned by a victim must not grow it.
            out.blocks_to_copy += bm.append_slots(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, seq.is_prefill,
                                              seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n

        # 3: admit waiting sequences (not in a step that had to preempt: memory is short).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed_blocks, num_cached = bm.get_computed_blocks(seq)
            n = seq.num_tokens - num_cached
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if not bm.can_allocate(seq, computed_blocks, n):
                break
            self.waiting.popleft()
            bm.allocate(seq, computed_blocks, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, True, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
        return out

    def _preempt_last(self, out: SchedulerOutput) -> tuple[Sequence, int]:
        """Preempt the most recently admitted running sequence; returns it and the tokens it
        gives back to this step's budget."""
        victim = self.running.pop()
        self.block_manager.free(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        # If it was already scheduled this step (a decode ahead of us in the loop), undo that.
        for i, s in enumerate(out.scheduled):
            if s.seq is victim:
                out.scheduled.pop(i)
                return victim, s.num_new_tokens
        return victim, 0

    # --- after the step ---------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark finished and give its blocks back (called by the engine)."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
