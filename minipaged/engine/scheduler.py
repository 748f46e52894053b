"""Continuous batching: which sequences run in the next step, and how many tokens each.

Lesson 03 replays this file's decisions as a Gantt chart. Scheduling is per *iteration* (Orca):
every step is planned anew, so a finished sequence's seat is refilled at once. Each step fills a
token budget (`max_num_batched_tokens`) with at most `max_num_seqs` sequences:

1. running sequences that are decoding (1 token each), oldest first;
2. running sequences in the middle of a chunked prefill (as many tokens as the budget has);
3. waiting sequences, in arrival order, while budget, seats and blocks last (with chunked
   prefill a long prompt is split across steps, so prefill and decode share a step).

Before promising tokens it asks the `BlockManager` for room. When the cache is full the most
recently admitted running sequence is *preempted* (recompute, vLLM's default): it gives up its
blocks and goes back to the front of the waiting queue, to prefill everything again later.

The seams: later capabilities override `num_tokens_to_compute`, `can_admit`, `admit`,
`has_seats`, `gang`, `preempt` and the queues' bookkeeping from their own folders, composed once
at build (engine/build.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

from minipaged.engine.block_manager import BlockManager
from minipaged.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step (a prefill chunk, or 1 for decode)
    is_prefill: bool  # more than the newest token (prompt, chunk, or recompute)
    samples: bool  # this step reaches the sequence's last known token, so it samples the next
    num_cached_tokens: int = 0  # admitted this step: tokens served from the prefix cache
    # Its block table as the step leaves it: the worker never asks the block manager.
    block_table: list[int] = field(default_factory=list)
    # Guessed tokens it verifies after the newest token (in num_new_tokens; lesson 10).
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Preemption to a CPU pool (lesson 06): (gpu, cpu) blocks to copy out, (cpu, gpu) back in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)  # (also in preempted)
    swapped_in: list[Sequence] = field(default_factory=list)

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

    def seqs(self) -> Iterator[Sequence]:
        yield from self.waiting
        yield from self.running

    # --- the policy (the seams) -------------------------------------------------------------
    def num_tokens_to_compute(self, seq: Sequence) -> int:
        """Tokens of a running `seq` whose K/V are not in the cache yet (a step loop that runs
        ahead of the host counts one more: the token being sampled)."""
        return seq.num_uncomputed_tokens

    def can_admit(self, seq: Sequence) -> bool:
        """May the waiting `seq` start now? If not, it keeps its place and later ones may go."""
        return True

    def has_seats(self, seqs: list[Sequence]) -> bool:
        """Room in the batch (`max_num_seqs`) for `seqs` to join the running sequences."""
        return len(self.running) + len(seqs) <= self.max_num_seqs

    def gang(self, seq: Sequence) -> list[Sequence]:
        """The running sequences preempted together with `seq`: just itself."""
        return [seq]

    def enter_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)

    # --- the step plan ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.block_manager.drop_uncomputed_blocks()  # (published for a step that raised)
        # 1 + 2: running sequences, decodes first, then unfinished prefill chunks (may preempt).
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        # 3: admit waiting sequences (not in a step that had to preempt: memory is short).
        if not out.preempted:
            self._admit_waiting(out, budget)
        for s in out.scheduled:
            s.block_table = self.block_manager.block_tables[s.seq.seq_id]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Steps 1 and 2: decodes, then prefill chunks, in `running` order until the budget is
        spent; returns the budget left. A sequence the cache has no room for preempts the last
        admitted (`_preempt_last`) until it fits, or until it was the victim itself."""
        bm = self.block_manager
        decodes: list[Sequence] = []
        chunks: list[Sequence] = []
        for seq in self.running:
            (chunks if seq.is_prefill else decodes).append(seq)
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            uncomputed = self.num_tokens_to_compute(seq)
            n = min(uncomputed, budget)
            if n == 0:
                continue  # nothing to run this step (held back by a policy)
            while not bm.can_append(seq, n):
                budget += self._preempt_last(out)  # the victim may already have been scheduled
                if seq.status is not SequenceStatus.RUNNING:
                    break  # it preempted itself (or its own gang)
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # Keep the n that can_append approved: budget returned by a victim must not grow it.
            out.blocks_to_copy += bm.append_slots(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, uncomputed > 1, n == uncomputed))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Step 3: admit waiting sequences in arrival order while budget, seats and blocks last
        (a prompt longer than the budget is split with chunked prefill); returns the budget left."""
        skipped: list[Sequence] = []  # held back by `can_admit`; they keep their place
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self.can_admit(seq):
                skipped.append(self.waiting.popleft())
                continue
            n = self.admit(seq, out, budget)
            if n is None:
                break
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Optional[int]:
        """Admit `seq`, the first waiting sequence, with its cached prefix and as many tokens as
        the budget holds; returns how many, or None if it does not fit (seats, blocks)."""
        bm = self.block_manager
        if not self.has_seats([seq]):
            return None
        computed_blocks, num_cached = bm.get_computed_blocks(seq)
        n = seq.num_tokens - num_cached
        if n > budget:
            if not self.enable_chunked_prefill:
                return None
            n = budget
        if not bm.can_allocate(seq, computed_blocks, n):
            return None
        self.waiting.popleft()
        bm.allocate(seq, computed_blocks, n)
        self.enter_running(seq)
        out.scheduled.append(ScheduledSeq(seq, n, True,
                                          seq.num_computed_tokens + n == seq.num_tokens,
                                          num_cached))
        return n

    def _preempt_last(self, out: SchedulerOutput) -> int:
        """Preempt the most recently admitted running sequence (with its `gang`); returns the
        tokens they give back to this step's budget."""
        victims = self.gang(self.running[-1])
        for s in victims:
            self.leave_running(s)
            s.num_preemptions += 1
        self.num_preemptions += 1
        # Undo what this step already planned for them (decodes ahead of us in the loop) ...
        ids = {s.seq_id for s in victims}
        returned = sum(s.num_new_tokens for s in out.scheduled if s.seq.seq_id in ids)
        if returned:
            out.scheduled = [s for s in out.scheduled if s.seq.seq_id not in ids]
        # ... including copy-on-writes not done yet: their source still holds the data.
        blocks = {b for s in victims for b in self.block_manager.block_tables[s.seq_id]}
        pending = {dst: src for src, dst in out.blocks_to_copy if dst in blocks}
        if pending:
            out.blocks_to_copy = [c for c in out.blocks_to_copy if c[1] not in pending]
        self.preempt(victims, out, pending)
        out.preempted += victims
        return returned

    def preempt(self, seqs: list[Sequence], out: SchedulerOutput, pending: dict[int, int]) -> None:
        """The preemption mode, recompute: free their blocks, back to the front of the waiting
        queue. (`pending`: the copy-on-writes just dropped from `out`, dst -> src block.)"""
        for s in seqs:
            self.block_manager.free(s)
            s.status = SequenceStatus.WAITING
            s.recompute_until = max(s.recompute_until, s.num_computed_tokens)
            s.num_computed_tokens = 0
        self.waiting.extendleft(reversed(seqs))

    # --- after the step ---------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark finished and give its blocks back (called by the engine)."""
        if seq.status is SequenceStatus.RUNNING:
            self.leave_running(seq)
        elif seq in self.waiting:  # (a request held outside the queue is not)
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)
