"""Stage 5, `admission` (lesson 03): the waiting queue, and what lets a request in.

Write `Scheduler.schedule` and step 3 of it, `Scheduler._admit_waiting` and `Scheduler.admit`
(minipaged/engine/scheduler.py). Each takes `self`, a real `Scheduler`; while the grader runs,
yours replace the real methods, so every step of the engine is planned by your `schedule` and
every request enters through your `admit`. Grade them with

    minipaged exercise check admission

Needs from stage 2 (block_manager), as `self.block_manager`: `get_computed_blocks(seq)` (the
cached prefix: blocks, tokens), `can_allocate(seq, blocks, n)`, `allocate(seq, blocks, n)`,
`block_tables`, and `drop_uncomputed_blocks()` (call it as a pass starts). Steps 1 and 2, the
running sequences, are `self._schedule_running(out, budget)` (stage 6 writes it; it returns
the budget left and may preempt).

What else you can use:

    self.waiting                  a deque of waiting sequences, oldest first
    self.max_num_batched_tokens   the step's token budget
    self.enable_chunked_prefill   may a prompt longer than the budget run in parts?
    self.can_admit(seq)           a policy may hold a sequence back (it keeps its place)
    self.has_seats([seq])         room for it under max_num_seqs
    self.enter_running(seq)       it joins self.running
    ScheduledSeq(seq, num_new_tokens, is_prefill, samples, num_cached_tokens)
                                  one plan; a newly admitted sequence is a prefill, and samples
                                  when this step reaches its last token
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput  # noqa: F401
from minipaged.engine.sequence import Sequence


def schedule(self) -> SchedulerOutput:
    # A fresh SchedulerOutput; drop what a forward that raised had published; steps 1 + 2
    # (_schedule_running) with the whole budget; step 3 with what is left, but not in a step
    # that had to preempt (memory is short); then give every ScheduledSeq its block table
    # (self.block_manager.block_tables[seq_id]).
    raise NotImplementedError("exercise: write Scheduler.schedule")


def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
    """Step 3: admit waiting sequences in arrival order while budget, seats and blocks last
    (a prompt longer than the budget is split with chunked prefill); returns the budget left."""
    # Look at the front of the queue; one that can_admit refuses is set aside and goes back to
    # the front, in order, at the end; stop at the first that admit cannot take.
    raise NotImplementedError("exercise: write Scheduler._admit_waiting")


def admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Optional[int]:
    """Admit `seq`, the first waiting sequence, with its cached prefix and as many tokens as
    the budget holds; returns how many, or None if it does not fit (seats, blocks)."""
    # Seats first; then the cached prefix; the tokens past it, cut to the budget (only with
    # chunked prefill: else it does not fit); blocks; then it leaves the queue, gets its
    # table, runs, and its ScheduledSeq records the tokens served from the cache.
    raise NotImplementedError("exercise: write Scheduler.admit")
