"""Exercise `scheduler` (lesson 03): the token-budget loop over running sequences, with preemption.

Write `Scheduler._schedule_running`, steps 1 and 2 of every `Scheduler.schedule()` call in
minipaged/engine/scheduler.py. It takes `self`, a real `Scheduler`; while the grader runs, your
function replaces the real method, and the rest of the step (admitting waiting requests) and the
whole engine run on top of it. Grade it with

    minipaged exercise check scheduler

What you can use:

    self.running                  running sequences in admission order (the last: preempted first)
    self.block_manager            `can_append(seq, n)`, `append_slots(seq, n)` (copy-on-write pairs)
    self.num_tokens_to_compute(seq)   tokens of seq whose K/V are not in the cache yet
    self._preempt_last(out)       preempts the most recently admitted running sequence (with the
                                  sequences it must leave with, `gang`); returns the tokens they
                                  had been planned in `out`
    seq.is_prefill                True while a sequence has more than its newest token to compute
    seq.status                    SequenceStatus.RUNNING until something preempts it
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
    """Steps 1 and 2: plan the running sequences' tokens; returns the budget left.

    Decodes first (1 token each), then unfinished prefill chunks (as many tokens as they have
    left and the budget holds), each in `self.running` order, until the budget is spent. A
    sequence the cache has no room for (`can_append`) preempts the most recently admitted
    running sequence (`_preempt_last`, which may return budget a victim had been planned
    for) until it fits, or until it was the victim itself. Each plan goes to `out.scheduled`
    and its copy-on-write pairs (`append_slots`) to `out.blocks_to_copy`.
    """
    # For each sequence: n = min(tokens to compute, budget) (skip it when n is 0); while the
    # block manager cannot append n, preempt; if it is still running, append its slots, add a
    # ScheduledSeq, and take n from the budget.
    raise NotImplementedError("exercise: write Scheduler._schedule_running")
