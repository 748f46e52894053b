"""Continuous batching: which sequences run in the next step, and how many tokens each.

Lesson 03 replays this file's decisions as a Gantt chart. Scheduling is per *iteration* (Orca):
every step is planned anew, so a finished sequence's seat is refilled at once instead of waiting
for the slowest member of a static batch.

Each step fills a token budget (`max_num_batched_tokens`) with at most `max_num_seqs` sequences:

1. running sequences that are decoding (1 token each), oldest first;
2. running sequences still in the middle of a chunked prefill (as many tokens as the budget has);
3. waiting sequences, in arrival order, while budget, seats and blocks last. With chunked
   prefill a long prompt is split across steps, so prefill and decode share a step. A waiting
   sequence may hit full blocks that an earlier one computes in this very step (they are
   published when their slots are allocated, block_manager.py); it still runs, and takes from
   the budget, every token after its hit.

Before promising any tokens it asks the `BlockManager` for room. When the cache is full a running
sequence is *preempted*: the most recently admitted one gives up all its blocks. By recompute
(vLLM's default) it goes back to the front of the waiting queue; when readmitted it prefills its
prompt and everything it had generated (prefix-cache hits can make that cheap). By swap
(`preemption_mode="swap"`, lesson 06) its blocks are copied to a CPU pool and it waits in
`swapped`; swapped sequences come back (copied to fresh GPU blocks) before any new request is
admitted. If the CPU pool is full it falls back to recompute.

Sequence groups (n > 1 samples, beam search; see `sequence.SequenceGroup`): a group's prompt
reserves a seat for every sequence it will fork into. Samples are independent once forked and
are preempted one at a time (a victim's shared prompt blocks stay with its siblings). Beams are
not: a beam-search step needs the logits of every live beam, so a preemption takes all running
beams of the group, and they come back all at once (the vLLM paper's gang scheduling).

Build it yourself (lesson 03): `minipaged exercise start scheduler` hands you `_schedule_running`
(steps 1 and 2, preemption included) to write; `minipaged exercise check scheduler` grades it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minipaged.engine.block_manager import BlockManager
from minipaged.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step (a prefill chunk, or 1 for decode)
    is_prefill: bool  # more than the newest token (prompt, chunk, or recompute)
    samples: bool  # this step reaches the sequence's last known token, so it samples the next
    num_cached_tokens: int = 0  # admitted this step: tokens served from the prefix cache
    # Its block table (logical block i -> physical block id) as the step leaves it: what the
    # worker needs to find the cache slots, so it never asks the block manager.
    block_table: list[int] = field(default_factory=list)
    # Speculative decoding: the proposals this step verifies after the newest token (its
    # num_new_tokens counts them); empty for every other sequence (spec_decode/scheduler.py).
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Swap preemption: (gpu, cpu) blocks to copy out, (cpu, gpu) blocks to copy back in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)  # the preempted ones that swapped
    swapped_in: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", max_loras: int = 0):
        self.block_manager = block_manager
        # enable_lora: the most distinct adapters among running sequences (their weight slots);
        # a waiting request whose adapter would be one too many waits (0: no adapters)
        self.max_loras = max_loras
        self.preemption_mode = preemption_mode
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.swapped: deque[list[Sequence]] = deque()  # swapped-out groups, oldest first
        self.num_preemptions = 0
        # Seats held for the sequences admitted group prompts will fork into (see `_seats`).
        self.num_reserved_seats = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Seats in the batch: a group's prompt holds one for every sample or beam it becomes."""
        g = seq.group
        return 1 if g is None or g.forked else g.size

    def _enter_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.group is not None:
            self.num_reserved_seats += self._seats(seq) - 1

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.group is not None:
            self.num_reserved_seats -= self._seats(seq) - 1

    def _has_seats(self, n: int) -> bool:
        return len(self.running) + self.num_reserved_seats + n <= self.max_num_seqs

    def num_tokens_to_compute(self, seq: Sequence) -> int:
        """Tokens of a running `seq` whose K/V are not in the cache yet (async scheduling counts
        one more: the token the GPU is sampling, see `worker/async_scheduling.py`)."""
        return seq.num_uncomputed_tokens

    # --- the step plan ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # Blocks published for a step whose forward raised must not be hit as computed.
        self.block_manager.drop_uncomputed_blocks()
        # 1 + 2: running sequences, decodes first, then unfinished prefill chunks (may preempt).
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        # 3: swapped-out groups come back first, oldest first (not in a step that had to preempt).
        if self.swapped and not out.preempted:
            budget = self._swap_in(out, budget)
        # 4: admit waiting sequences (not in a step that had to preempt: memory is short; not
        #    while a swapped-out group waits to come back: first come, first served).
        if not out.preempted and not self.swapped:
            self._admit_waiting(out, budget)
        for s in out.scheduled:
            s.block_table = self.block_manager.block_tables[s.seq.seq_id]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Steps 1 and 2: plan the running sequences' tokens; returns the budget left.

        Decodes first (1 token each), then unfinished prefill chunks (as many tokens as they have
        left and the budget holds), each in `self.running` order, until the budget is spent. A
        sequence the cache has no room for (`can_append`) preempts the most recently admitted
        running sequence (`_preempt_last`, which may return budget a victim had been planned
        for) until it fits, or until it was the victim itself. Each plan goes to `out.scheduled`
        and its copy-on-write pairs (`append_slots`) to `out.blocks_to_copy`.
        """
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
                continue  # a beam whose logits wait for its siblings' (beam_search.py)
            while not bm.can_append(seq, n):
                budget += self._preempt_last(out)  # the victim may already have been scheduled
                if seq.status is not SequenceStatus.RUNNING:
                    break  # it preempted itself (or its own group)
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # Keep the n that can_append approved: budget returned by a victim must not grow it.
            out.blocks_to_copy += bm.append_slots(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, uncomputed > 1, n == uncomputed))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Step 4: admit waiting sequences in arrival order while budget, seats and blocks last
        (a prompt longer than the budget is split with chunked prefill); returns the budget left."""
        bm = self.block_manager
        skipped: list[Sequence] = []  # waiting for a LoRA slot; they keep their place
        loras = self._running_loras()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._lora_fits(seq, loras):
                skipped.append(self.waiting.popleft())
                continue
            group = seq.group
            if group is not None and group.lockstep and group.forked:
                used = self._admit_beams(group, out, budget)
                if used is None:
                    break
                loras.add(seq.lora_int_id)
                budget -= used
                continue
            if not self._has_seats(1 if group is None else self._seats(seq)):
                break
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
            self._enter_running(seq)
            loras.add(seq.lora_int_id)
            out.scheduled.append(ScheduledSeq(seq, n, True,
                                              seq.num_computed_tokens + n == seq.num_tokens,
                                              num_cached))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _running_loras(self) -> set[int]:
        return {s.lora_int_id for s in self.running} if self.max_loras else set()

    def _lora_fits(self, seq: Sequence, loras: set[int]) -> bool:
        """Its adapter is already running, or one more adapter still has a slot (vLLM: a request
        over max_loras waits, the ones behind it may go). `loras`: the running ids (0: none)."""
        lora_id = seq.lora_int_id
        return not lora_id or lora_id in loras or len(loras - {0}) < self.max_loras

    def _admit_beams(self, group, out: SchedulerOutput, budget: int):
        """Readmit every waiting beam of a group at once, or none; returns the tokens scheduled.

        All of them get blocks for all their tokens now (a beam-search step needs every beam),
        then as many tokens as the budget holds; the rest are prefill chunks of later steps.
        """
        bm = self.block_manager
        members = [s for s in group.seqs if s.status is SequenceStatus.WAITING]
        if not self._has_seats(len(members)):
            return None
        plans = []
        for s in members:
            blocks, num_cached = bm.get_computed_blocks(s)
            plans.append((s, blocks, s.num_tokens - num_cached))
        if not bm.can_allocate_group(plans):
            return None
        bm.allocate_group(plans)
        used = 0
        for s, blocks, n_all in plans:
            self.waiting.remove(s)
            self._enter_running(s)
            n = min(n_all, budget - used)
            if n > 0:
                bm.cache_blocks(s, s.num_computed_tokens + n)  # what this step fills
                out.scheduled.append(ScheduledSeq(s, n, True, n == n_all,
                                                  len(blocks) * bm.block_size))
                used += n
        return used

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped-out groups back while seats and blocks last; schedule their tokens."""
        bm = self.block_manager
        while self.swapped:
            seqs = self.swapped[0]
            if not self._lora_fits(seqs[0], self._running_loras()):
                break
            if not self._has_seats(sum(self._seats(s) for s in seqs)):
                break
            # Their blocks, plus room for this step's tokens (a new block or a copy-on-write each).
            room = sum(bm.num_blocks_for(s.num_tokens) - len(bm.cpu_block_tables[s.seq_id]) + 1
                       for s in seqs)
            if bm.num_swap_in_blocks(seqs) + room > bm.num_free_blocks:
                if not self.running:  # it cannot come back even to an empty cache: recompute
                    self.swapped.popleft()
                    self._requeue(seqs)
                    out.preempted += seqs
                    continue
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += bm.swap_in(seqs)
            out.swapped_in += seqs
            for s in seqs:
                self._enter_running(s)
                n = min(s.num_uncomputed_tokens, budget)
                if n == 0:
                    continue  # out of budget this step, or a beam already holding its logits
                out.blocks_to_copy += bm.append_slots(s, n)
                out.scheduled.append(ScheduledSeq(s, n, s.is_prefill,
                                                  s.num_computed_tokens + n == s.num_tokens))
                budget -= n
        return budget

    def _preempt_last(self, out: SchedulerOutput) -> int:
        """Preempt the most recently admitted running sequence (a beam: with all running beams of
        its group); returns the tokens they give back to this step's budget."""
        bm = self.block_manager
        victim = self.running[-1]
        if victim.group is not None and victim.group.lockstep:
            victims = [s for s in victim.group.seqs if s.status is SequenceStatus.RUNNING]
        else:
            victims = [victim]
        for s in victims:
            self._leave_running(s)
        self.num_preemptions += 1
        # Undo what this step already planned for them (decodes ahead of us in the loop) ...
        ids = {s.seq_id for s in victims}
        returned = sum(s.num_new_tokens for s in out.scheduled if s.seq.seq_id in ids)
        if returned:
            out.scheduled = [s for s in out.scheduled if s.seq.seq_id not in ids]
        # ... including copy-on-writes not done yet: their source still holds the data.
        blocks = {b for s in victims for b in bm.block_tables[s.seq_id]}
        pending = {dst: src for src, dst in out.blocks_to_copy if dst in blocks}
        if pending:
            out.blocks_to_copy = [c for c in out.blocks_to_copy if c[1] not in pending]
        if self.preemption_mode == "swap" and bm.can_swap_out(victims):
            out.blocks_to_swap_out += [(pending.get(g, g), c) for g, c in bm.swap_out(victims)]
            for s in victims:
                s.status = SequenceStatus.SWAPPED
                s.num_preemptions += 1
            self.swapped.appendleft(victims)
            out.swapped_out += victims
        else:  # recompute
            for s in victims:
                s.num_preemptions += 1
            self._requeue(victims)
        out.preempted += victims
        return returned

    def _requeue(self, seqs: list[Sequence]) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue."""
        for s in seqs:
            self.block_manager.free(s)
            s.status = SequenceStatus.WAITING
            s.recompute_until = max(s.recompute_until, s.num_computed_tokens)
            s.num_computed_tokens = 0
        self.waiting.extendleft(reversed(seqs))

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """`children` share the running `parent`'s blocks and run right after it (n > 1, beams).
        The first fork of a group turns the seats its prompt reserved into real sequences."""
        group = parent.group
        if not group.forked:
            self.num_reserved_seats -= group.size - 1
            group.forked = True
        if children:
            i = self.running.index(parent)
            for child in children:
                self.block_manager.fork(parent, child)
                child.status = SequenceStatus.RUNNING
            self.running[i + 1:i + 1] = children

    # --- after the step ---------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark finished and give its blocks back (called by the engine)."""
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            for seqs in self.swapped:
                if seq in seqs:
                    seqs.remove(seq)
                    if not seqs:
                        self.swapped.remove(seqs)
                    break
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = status
        self.block_manager.free(seq)
