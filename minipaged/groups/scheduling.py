"""Requests of several sequences in the scheduler: n > 1 samples and beam search (lesson 06).

`GroupScheduling` is a mixin over the `Scheduler` (engine/scheduler.py), composed in once when
the engine is built (engine/build.py). It changes three seams:

* seats (`has_seats`): a group's prompt reserves a seat for every sequence it will fork into
  (`num_reserved_seats`), so the forks always find room; the first `fork` turns them into
  running sequences.
* gangs (`gang`): samples are independent once forked and are preempted one at a time (a
  victim's shared prompt blocks stay with its siblings). Beams are not: a beam-search step needs
  the logits of every live beam, so a preemption takes all running beams of the group ...
* admission (`admit`): ... and they come back all at once (the vLLM paper's gang scheduling).

Sequences of one group share blocks (`BlockManager.fork`, copy-on-write); readmitted beams may
hit the same cached blocks, which `can_allocate_all` / `allocate_all` count and claim once.
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.block_allocator import Block
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.scheduler import ScheduledSeq, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.groups.group import SequenceGroup

Plan = tuple[Sequence, list[Block], int]  # (seq, its cached prefix blocks, tokens to allocate)


def can_allocate_all(bm: BlockManager, plans: list[Plan]) -> bool:
    """`can_allocate` for several sequences at once: a cached block that two of them hit is
    taken from the free queue only once."""
    needed, revived = 0, set()
    for _, blocks, n in plans:
        needed += bm.num_blocks_for(len(blocks) * bm.block_size + n) - len(blocks)
        revived.update(b.block_id for b in blocks if b.ref_count == 0)
    return needed + len(revived) <= bm.allocator.num_free_blocks


def allocate_all(bm: BlockManager, plans: list[Plan]) -> None:
    """`allocate` each plan. Every cached block is claimed before any fresh one is taken: a
    fresh block for one sequence must not evict a cached block another one is about to reuse.
    Nothing is published: the caller schedules part of the tokens and publishes those
    (`cache_blocks`)."""
    pinned = [b for _, blocks, _ in plans for b in blocks]
    for b in pinned:
        bm.allocator.incref(b)
    for seq, blocks, n in plans:
        bm.allocate(seq, blocks, n, publish=False)
    for b in pinned:
        bm.allocator.decref(b)


def seats(seq: Sequence) -> int:
    """Seats in the batch: a group's prompt holds one for every sample or beam it becomes."""
    g = seq.group
    return 1 if g is None or g.forked else g.size


class GroupScheduling:
    """Mixin over `Scheduler`: seats reserved for forks, beams preempted and readmitted as one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_reserved_seats = 0  # seats held for the sequences admitted prompts fork into

    def has_seats(self, seqs: list[Sequence]) -> bool:
        return (len(self.running) + self.num_reserved_seats + sum(map(seats, seqs))
                <= self.max_num_seqs)

    def enter_running(self, seq: Sequence) -> None:
        super().enter_running(seq)
        if seq.group is not None:
            self.num_reserved_seats += seats(seq) - 1

    def leave_running(self, seq: Sequence) -> None:
        super().leave_running(seq)
        if seq.group is not None:
            self.num_reserved_seats -= seats(seq) - 1

    def gang(self, seq: Sequence) -> list[Sequence]:
        """A beam: every running beam of its group; anything else alone."""
        if seq.group is not None and seq.group.lockstep:
            return [s for s in seq.group.seqs if s.status is SequenceStatus.RUNNING]
        return [seq]

    def admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Optional[int]:
        group = seq.group
        if group is not None and group.lockstep and group.forked:
            return self._admit_beams(group, out, budget)
        return super().admit(seq, out, budget)

    def _admit_beams(self, group: SequenceGroup, out: SchedulerOutput,
                     budget: int) -> Optional[int]:
        """Readmit every waiting beam of a group at once, or none; returns the tokens scheduled.

        All of them get blocks for all their tokens now (a beam-search step needs every beam),
        then as many tokens as the budget holds; the rest are prefill chunks of later steps.
        """
        bm = self.block_manager
        members = [s for s in group.seqs if s.status is SequenceStatus.WAITING]
        if not self.has_seats(members):
            return None
        plans = []
        for s in members:
            blocks, num_cached = bm.get_computed_blocks(s)
            plans.append((s, blocks, s.num_tokens - num_cached))
        if not can_allocate_all(bm, plans):
            return None
        allocate_all(bm, plans)
        used = 0
        for s, blocks, n_all in plans:
            self.waiting.remove(s)
            self.enter_running(s)
            n = min(n_all, budget - used)
            if n > 0:
                bm.cache_blocks(s, s.num_computed_tokens + n)  # what this step fills
                out.scheduled.append(ScheduledSeq(s, n, True, n == n_all,
                                                  len(blocks) * bm.block_size))
                used += n
        return used

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
