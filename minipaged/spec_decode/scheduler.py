"""The scheduler with speculative decoding: a decode with proposals runs 1 + k tokens (lesson 10).

A running sequence whose newest token is its only uncomputed one normally runs 1 token. With
proposals (`seq.spec_token_ids`, set before the step is planned) it runs that token and its k
proposals as one short query against its cache: the path a prefill chunk takes (a cached
prefix, `cu_seqlens_q`), so nothing new is needed in attention. The scheduler's own rules do the
rest: the 1 + k tokens come out of the step's token budget, and `can_append(seq, 1 + k)`
reserves their slots up front (preempting as it would for a long chunk).

After the plan, each entry's proposals are cut to what the budget gave it (a budget of 3 for
k = 4 verifies 2 proposals) and copied onto the `ScheduledSeq`, where the model runner reads
them; a sequence that was not scheduled (preempted, no budget) forgets its proposals.
"""
from __future__ import annotations

from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import Sequence


class SpecDecodeScheduler(Scheduler):
    def num_tokens_to_compute(self, seq: Sequence) -> int:
        """A decode with proposals: its newest token plus the k proposals."""
        n = seq.num_uncomputed_tokens
        return n + len(seq.spec_token_ids) if n == 1 else n

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        scheduled = set()
        for s in out.scheduled:
            seq = s.seq
            scheduled.add(seq.seq_id)
            if not seq.spec_token_ids:
                continue
            # A decode with proposals: its newest token, then what the budget left of them
            # (maybe none). Either way a decode, and it samples.
            num_spec = s.num_new_tokens - seq.num_uncomputed_tokens
            seq.spec_token_ids = seq.spec_token_ids[:num_spec]
            s.spec_token_ids = seq.spec_token_ids
            s.is_prefill = False
            s.samples = True
        for seq in self.running + out.preempted:
            if seq.seq_id not in scheduled:
                seq.spec_token_ids = []
        return out
