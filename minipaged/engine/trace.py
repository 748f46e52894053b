"""The engine's diary: one `StepRecord` per `LLMEngine.step()`.

Lessons 01 and 03 draw block tables, batch-composition Gantt charts and KV utilisation over time
from these records, so every picture shows what the real scheduler and block manager did.
`step_record` builds one from the step's SchedulerOutput and the engine's state after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from minipaged.engine.block_usage import BlockUsage, block_usage, blocks_saved_by_sharing


# Reading a trace back (request timelines, tokens in the cache at step t) is the lessons' work:
# minipaged/lessons/timeline.py.


class ScheduledEntry(NamedTuple):
    """One sequence's share of a step. A tuple of plain values: Python's garbage collector stops
    tracking such tuples, so a trace of a long run (a 256-sequence batch adds 256 of these per
    step) costs the engine's collections nothing (see `engine.freeze_gc_heap`)."""

    request_id: str
    seq_id: int
    num_prefill_tokens: int  # prompt / chunk / recompute tokens computed this step
    num_decode_tokens: int  # 1 for a decode step, else 0
    num_computed_before: int  # tokens already in the cache before this step
    num_cached_tokens: int = 0  # admitted this step: tokens served from the prefix cache
    name: str = ""  # "request_id/index" for a sample or beam of a group (n > 1, beam search)

    @property
    def key(self) -> str:
        """The sequence's name in `StepRecord.block_tables`."""
        return self.name or self.request_id


@dataclass
class StepRecord:
    step: int
    start_time: float  # seconds since the engine started
    duration: float
    scheduled: list[ScheduledEntry]
    preempted: list[str]  # request ids preempted (recompute or swap) while planning this step
    finished: list[str]
    num_waiting: int  # after the step
    num_running: int
    num_blocks_used: int
    num_blocks_free: int  # empty blocks
    num_blocks_cached: int  # unreferenced blocks still holding a reusable prefix
    num_batched_tokens: int
    usage: Optional[BlockUsage] = None  # full accounting, when record_block_tables is on
    block_tables: Optional[dict[str, list[int]]] = field(default=None, repr=False)
    # Sharing and preemption (lesson 06).
    num_blocks_saved_by_sharing: int = 0  # table entries minus blocks in use (fork, prefix hits)
    num_cow_copies: int = 0  # blocks copied on write before this step's forward
    num_prefix_query_tokens: int = 0  # tokens of the sequences admitted this step ...
    num_prefix_hit_tokens: int = 0  # ... and how many of them the prefix cache served
    swapped_out: list[str] = field(default_factory=list)  # preempted by swap (also in preempted)
    swapped_in: list[str] = field(default_factory=list)
    num_swapped_bytes: int = 0  # K/V bytes copied to and from the CPU pool this step
    num_recomputed_tokens: int = 0  # prefill tokens whose K/V a recompute preemption had dropped
    # Async scheduling (lesson 08): seconds this step's host work waited for the previous step's
    # tokens. Near 0: the host is the bottleneck; a large share of `duration`: the GPU is.
    wait_time: float = 0.0
    # Speculative decoding (lesson 10): sequences that verified a proposal at position i, and
    # how many of them accepted it (acceptance per position = accepted[i] / drafts[i]).
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_prefill_tokens for e in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_decode_tokens for e in self.scheduled)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of this step's admitted tokens found in the prefix cache."""
        q = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0


def summarize(trace: list[StepRecord]) -> dict:
    """A few totals over a trace (printed by the demo and the lessons)."""
    if not trace:
        return {"steps": 0}
    return {
        "steps": len(trace),
        "prefill_tokens": sum(r.num_prefill_tokens for r in trace),
        "decode_tokens": sum(r.num_decode_tokens for r in trace),
        "preemptions": sum(len(r.preempted) for r in trace),
        "max_blocks_used": max(r.num_blocks_used for r in trace),
        "max_running": max(r.num_running for r in trace),
        "prefix_hit_tokens": sum(r.num_prefix_hit_tokens for r in trace),
        "recomputed_tokens": sum(r.num_recomputed_tokens for r in trace),
        "swapped_bytes": sum(r.num_swapped_bytes for r in trace),
    }


class StepTimes(NamedTuple):
    """A step's index and clock, as the engine counts them (passed to `step_record`)."""

    step: int
    start_time: float  # seconds since the engine started
    duration: float
    wait_time: float  # the step's wait for the GPU's tokens (async scheduling)


def step_record(engine, sched, finished: list[str], times: StepTimes,
                num_prefix_query_tokens: int, num_prefix_hit_tokens: int) -> StepRecord:
    """The StepRecord of the step `engine` (an LLMEngine) just ran from `sched` (its
    SchedulerOutput): what ran, what the block manager holds now, what moved."""
    bm = engine.block_manager
    grouped = bool(engine.groups)  # name the samples and beams of groups ("request_id/index")
    entries = [ScheduledEntry(s.seq.request_id, s.seq.seq_id,
                              s.num_new_tokens if s.is_prefill else 0,
                              0 if s.is_prefill else s.num_new_tokens,
                              s.seq.num_computed_tokens - s.num_new_tokens,
                              s.num_cached_tokens, s.seq.name if grouped else "")
               for s in sched.scheduled]
    cached = bm.allocator.num_cached_free
    record = StepRecord(
        step=times.step, start_time=times.start_time, duration=times.duration, scheduled=entries,
        preempted=list(dict.fromkeys(s.request_id for s in sched.preempted)), finished=finished,
        num_waiting=len(engine.scheduler.waiting), num_running=len(engine.scheduler.running),
        num_blocks_used=bm.num_blocks - bm.num_free_blocks,
        num_blocks_free=bm.num_free_blocks - cached, num_blocks_cached=cached,
        num_batched_tokens=sched.num_batched_tokens,
        num_blocks_saved_by_sharing=blocks_saved_by_sharing(bm),
        num_cow_copies=len(sched.blocks_to_copy),
        num_prefix_query_tokens=num_prefix_query_tokens,
        num_prefix_hit_tokens=num_prefix_hit_tokens, wait_time=times.wait_time)
    if sched.swapped_out or sched.swapped_in:
        record.swapped_out = list(dict.fromkeys(s.request_id for s in sched.swapped_out))
        record.swapped_in = list(dict.fromkeys(s.request_id for s in sched.swapped_in))
        record.num_swapped_bytes = engine.block_bytes * (len(sched.blocks_to_swap_out)
                                                       + len(sched.blocks_to_swap_in))
    if engine.scheduler.num_preemptions:  # prefill work that a recompute preemption caused
        record.num_recomputed_tokens = sum(
            max(0, min(s.seq.num_computed_tokens, s.seq.recompute_until)
                - (s.seq.num_computed_tokens - s.num_new_tokens))
            for s in sched.scheduled if s.seq.recompute_until)
    if engine.config.record_block_tables:
        record.usage = block_usage(bm)
        record.block_tables = {s.name: list(bm.block_tables[s.seq_id])
                               for s in engine.scheduler.running}
    return record
