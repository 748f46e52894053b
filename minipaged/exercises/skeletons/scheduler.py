"""Stage 6, `scheduler` (lesson 03): the running set, with recompute preemption.

Write `Scheduler._schedule_running` (steps 1 and 2 of every `Scheduler.schedule()` call in
minipaged/engine/scheduler.py), `Scheduler._preempt_last`, `Scheduler.preempt` and
`Scheduler.finish`. Each takes
`self`, a real `Scheduler`; while the grader runs, yours replace the real methods, and the rest of
the step (admitting waiting requests) and the whole engine run on top of them. Grade them with

    minipaged exercise check scheduler

Needs from stage 2 (block_manager), as `self.block_manager`: `can_append(seq, n)`,
`append_slots(seq, n)` (copy-on-write pairs), `free(seq)`, `block_tables`. What else you can use:

    self.running                  running sequences in admission order (the last: preempted first)
    self.waiting                  the waiting deque; a preempted sequence goes back to its front
    self.num_tokens_to_compute(seq)   tokens of seq whose K/V are not in the cache yet
    self.gang(seq)                the running sequences preempted together with seq (beams)
    self.leave_running(seq)       takes seq out of self.running
    self.num_preemptions          preemptions so far (one per gang)
    seq.is_prefill                True while a sequence has more than its newest token to compute
    seq.status                    SequenceStatus.RUNNING until something preempts it
    seq.num_preemptions, seq.recompute_until    per-sequence counts the trace reads
    ScheduledSeq(seq, num_new_tokens, is_prefill, samples)
                                  one plan; `samples` is True when this step computes the last
                                  uncomputed token (then the engine samples the next one)

Two traps the tests know about: a sequence may be preempted by a later one in the same loop
(skip it), and when a victim hands budget back, keep the token count that `can_append` approved.
A sequence with nothing to compute this step (0 tokens) is skipped.
"""
from __future__ import annotations

from minipaged.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput  # noqa: F401
from minipaged.engine.sequence import Sequence, SequenceStatus  # noqa: F401


def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
    """Steps 1 and 2: decodes, then prefill chunks, in `running` order until the budget is
    spent; returns the budget left. A sequence the cache has no room for preempts the last
    admitted (`_preempt_last`) until it fits, or until it was the victim itself.

    Decodes take 1 token each, unfinished prefill chunks as many tokens as they have left and
    the budget holds. `can_append` says whether the cache has room; `_preempt_last` may return
    budget a victim had been planned for. Each plan goes to `out.scheduled` and its
    copy-on-write pairs (`append_slots`) to `out.blocks_to_copy`.
    """
    # For each sequence: n = min(tokens to compute, budget) (skip it when n is 0); while the
    # block manager cannot append n, preempt; if it is still running, append its slots, add a
    # ScheduledSeq, and take n from the budget.
    raise NotImplementedError("exercise: write Scheduler._schedule_running")


def _preempt_last(self, out: SchedulerOutput) -> int:
    """Preempt the most recently admitted running sequence (with its `gang`); returns the
    tokens they give back to this step's budget."""
    # The victims leave the running set (count their preemptions); what this step already
    # planned for them leaves `out.scheduled` (their tokens go back to the budget), and so do
    # copy-on-writes into their blocks (as {dst: src}, `pending`); then `self.preempt(victims,
    # out, pending)`, and they join `out.preempted`.
    raise NotImplementedError("exercise: write Scheduler._preempt_last")


def preempt(self, seqs: list[Sequence], out: SchedulerOutput, pending: dict[int, int]) -> None:
    """The preemption mode, recompute: free their blocks, back to the front of the waiting
    queue. (`pending`: the copy-on-writes just dropped from `out`, dst -> src block.)"""
    # Keep their order at the front of the queue. A recomputed sequence starts from 0 computed
    # tokens; recompute_until remembers how far it had got (the trace draws the recompute).
    raise NotImplementedError("exercise: write Scheduler.preempt")


def finish(self, seq: Sequence, status: SequenceStatus) -> None:
    """Mark finished and give its blocks back (called by the engine)."""
    # A running sequence leaves the running set; a waiting one (aborted before it ran, maybe)
    # leaves the queue if it is there. Then its status, and its blocks.
    raise NotImplementedError("exercise: write Scheduler.finish")
