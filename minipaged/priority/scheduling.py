"""Priority scheduling in the scheduler (lesson 13, `scheduling_policy="priority"`).

vLLM's rule: every request carries an integer `priority`, *lower runs first*, ties broken by
arrival (`priority_key`). `PriorityScheduling` is a mixin over the `Scheduler`
(engine/scheduler.py), composed in once when the engine is built (engine/build.py). It changes
the order of the two queues and adds one kind of preemption:

* waiting: kept in `priority_key` order, so admission takes the most urgent request first; a
  preempted request goes back to its place in that order, not to the front (vLLM V1's
  `PriorityRequestQueue`);
* running: kept in the same order, so the core's "preempt the last running sequence" takes the
  least urgent, latest arrival (vLLM V1: `max(running, key=(priority, arrival_time))`) when a
  running sequence needs a block the cache does not have;
* admission: a waiting request that finds no seat (`max_num_seqs`) or no blocks preempts running
  requests of a *strictly* lower priority (the least urgent first) until it fits. vLLM V0's
  priority scheduler did this (`_schedule_priority_preemption`); vLLM V1 preempts only under the
  running queue's pressure. The strict comparison keeps equal priorities from preempting each
  other back and forth: among equals the order stays first come, first served.

Preemption is by recompute (config.py refuses `preemption_mode="swap"` with this policy: a
swapped-out victim comes back before any waiting request, which would undo the preemption).

Build it yourself (lesson 13): `minipaged exercise start priority` hands you `priority_key` and
`PriorityScheduling.can_displace` to write; `minipaged exercise check priority` grades them.
"""
from __future__ import annotations

from bisect import insort
from typing import Optional

from minipaged.engine.scheduler import SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Sort key of the priority policy: lower runs first. The request's `priority`, then its
    arrival time, then `seq_id` (which grows in the order sequences were created)."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


class PriorityScheduling:
    """Mixin over `Scheduler`: both queues in `priority_key` order; a more urgent waiting
    request preempts less urgent running ones when it does not fit."""

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=priority_key)

    def enter_running(self, seq: Sequence) -> None:
        super().enter_running(seq)  # appended last ...
        self.running.pop()
        insort(self.running, seq, key=priority_key)  # ... moved to its place

    def preempt(self, seqs: list[Sequence], out: SchedulerOutput,
                pending: dict[int, int]) -> None:
        super().preempt(seqs, out, pending)  # recompute: to the front of the waiting queue ...
        for s in seqs:  # ... then to their place in priority order
            self.waiting.remove(s)
            insort(self.waiting, s, key=priority_key)

    def admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> Optional[int]:
        """Admit the first waiting `seq` as the core does; if it does not fit, preempt the least
        urgent running sequence (`_preempt_last`) while that one is of a strictly lower priority
        and room is what `seq` lacks, trying again after each. A sequence preempted in this very
        step is not admitted back in it (nor, the queue being in order, anything less urgent)."""
        if seq in out.preempted:
            return None
        n = super().admit(seq, out, budget)
        while n is None and self.can_displace(seq, budget):
            self._preempt_last(out)  # its tokens planned this step are not given to `seq`
            n = super().admit(seq, out, budget)
        return n

    def can_displace(self, seq: Sequence, budget: int) -> bool:
        """Would preempting the last running sequence help the waiting `seq`? Only if that one
        is of a strictly lower priority, and `seq` is not held back by the token budget (a
        whole prompt longer than it, without chunked prefill)."""
        if not self.running or self.running[-1].priority <= seq.priority:
            return False
        if not self.enable_chunked_prefill:
            _, num_cached = self.block_manager.get_computed_blocks(seq)
            return seq.num_tokens - num_cached <= budget
        return True
