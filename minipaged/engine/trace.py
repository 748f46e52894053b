"""The engine's diary: one `StepRecord` per `LLMEngine.step()`.

Lessons 01 and 03 draw block tables, batch-composition Gantt charts and KV utilisation over time
from these records, so every picture shows what the real scheduler and block manager did.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from minipaged.engine.block_manager import BlockUsage


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


# --- replaying a trace (lessons 02 and 03: Gantt charts, block tables at step t) ------------
class RequestState(enum.IntEnum):
    """What one request did in one step, as the Gantt charts colour it."""

    ABSENT = 0  # not arrived yet, or finished
    WAITING = 1  # queued, never scheduled yet
    PREFILL = 2  # computed a prompt chunk (or a recompute after preemption) this step
    DECODE = 3  # computed its newest token this step
    PREEMPTED = 4  # lost its blocks this step (recompute preemption)
    REQUEUED = 5  # waiting again after a preemption
    STALLED = 6  # admitted but not scheduled this step (the token budget ran out)
    PADDING = 7  # static batching only: a finished or shorter row that is still computed


def trace_request_ids(trace: Sequence[StepRecord]) -> list[str]:
    """Request ids in the order they were first scheduled (or preempted)."""
    seen: dict[str, None] = {}
    for r in trace:
        for e in r.scheduled:
            seen.setdefault(e.request_id, None)
        for rid in r.preempted:
            seen.setdefault(rid, None)
    return list(seen)


def request_timeline(trace: Sequence[StepRecord], request_ids: Optional[Sequence[str]] = None,
                     arrival_steps: Optional[dict[str, int]] = None) -> list[list[RequestState]]:
    """`states[i][t]`: what request `request_ids[i]` did in `trace[t]`.

    Requests arrive at the first step of the trace unless `arrival_steps` (trace positions) says
    otherwise, which is how `LLM.generate` queues an offline batch.
    """
    ids = list(request_ids) if request_ids is not None else trace_request_ids(trace)
    arrival = arrival_steps or {}
    row = {rid: i for i, rid in enumerate(ids)}
    states = [[RequestState.ABSENT] * len(trace) for _ in ids]
    status = {rid: RequestState.ABSENT for rid in ids}  # state carried between steps
    for t, rec in enumerate(trace):
        for rid in ids:
            if status[rid] is RequestState.ABSENT and arrival.get(rid, 0) == t:
                status[rid] = RequestState.WAITING
        scheduled = {e.request_id: e for e in rec.scheduled}
        for rid in ids:
            i, s = row[rid], status[rid]
            if rid in rec.preempted:
                states[i][t] = RequestState.PREEMPTED
                status[rid] = RequestState.REQUEUED
            elif rid in scheduled:
                e = scheduled[rid]
                states[i][t] = RequestState.PREFILL if e.num_prefill_tokens else RequestState.DECODE
                status[rid] = RequestState.STALLED  # running: idle in a step that skips it
            elif s is RequestState.STALLED or s in (RequestState.WAITING, RequestState.REQUEUED):
                states[i][t] = s
            if rid in rec.finished:
                status[rid] = RequestState.ABSENT
    return states


def tokens_in_cache(trace: Sequence[StepRecord], position: int) -> dict[str, int]:
    """Tokens each running request has in the KV cache after `trace[position]`.

    Together with `StepRecord.block_tables` this says how full each request's last block is.
    """
    tokens: dict[str, int] = {}

    def drop(rid: str) -> None:  # the request, or every sample / beam of it
        for key in [k for k in tokens if k == rid or k.startswith(rid + "/")]:
            del tokens[key]

    for rec in trace[:position + 1]:
        for rid in rec.preempted:
            drop(rid)
        for e in rec.scheduled:
            tokens[e.key] = (e.num_computed_before + e.num_prefill_tokens
                             + e.num_decode_tokens)
        for rid in rec.finished:
            drop(rid)
    return tokens
