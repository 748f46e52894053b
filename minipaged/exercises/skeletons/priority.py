"""Stage 13, `priority` (lesson 13): the priority policy's order and its preemption rule.

Write `priority_key` and `PriorityScheduling.can_displace` of minipaged/priority/scheduling.py.
While the grader runs, your functions replace the real ones, and the scheduler built with
`scheduling_policy="priority"` (and the engine and the simulator on top of it) runs on yours.
Grade them with

    minipaged exercise check priority

vLLM's rule: lower `priority` runs first, ties broken by arrival. The mixin keeps the waiting
and the running queue sorted by your key (`bisect.insort(queue, seq, key=priority_key)`), so
admission takes the first waiting sequence and the core's preemption takes the last running
one. When the first waiting sequence does not fit, the mixin's `admit` asks `can_displace`
whether preempting that last running one would help, and if so preempts it and tries again.

Needs from stages 5 and 6 (admission, scheduler): `admit` places a waiting sequence when it
fits (seats, budget, blocks); `_preempt_last` gives the last running sequence's blocks back.

What you can use:

    seq.priority, seq.arrival_time, seq.seq_id     the request's priority, arrival, creation order
    seq.num_tokens                                 its prompt (and output) tokens
    self.running                                   running sequences in your key's order
    self.enable_chunked_prefill                    False: a prompt runs whole or not at all
    self.block_manager.get_computed_blocks(seq)    (cached blocks, tokens found in the cache)

Two traps the graders know about: two requests of the same priority must never preempt each
other (they would take turns forever), and a prompt held back by the token budget gains nothing
from a preemption.
"""
from __future__ import annotations

from minipaged.engine.sequence import Sequence


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Sort key of the priority policy: lower runs first. The request's `priority`, then its
    arrival time, then `seq_id` (which grows in the order sequences were created)."""
    raise NotImplementedError("exercise: write priority_key")


def can_displace(self, seq: Sequence, budget: int) -> bool:
    """Would preempting the last running sequence help the waiting `seq`? Only if that one
    is of a strictly lower priority, and `seq` is not held back by the token budget (a
    whole prompt longer than it, without chunked prefill)."""
    # No running sequence, or the last one (the least urgent) is not strictly less urgent than
    # seq: no. Without chunked prefill, seq's uncached tokens must fit the budget. Else: yes.
    raise NotImplementedError("exercise: write PriorityScheduling.can_displace")
