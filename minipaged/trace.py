"""The engine's diary: one `StepRecord` per `LLMEngine.step()`.

Lessons 01 and 03 draw block tables, batch-composition Gantt charts and KV utilisation over time
from these records, so every picture shows what the real scheduler and block manager did.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from minipaged.block_manager import BlockUsage


@dataclass
class ScheduledEntry:
    request_id: str
    seq_id: int
    num_prefill_tokens: int  # prompt / chunk / recompute tokens computed this step
    num_decode_tokens: int  # 1 for a decode step, else 0
    num_computed_before: int  # tokens already in the cache before this step


@dataclass
class StepRecord:
    step: int
    start_time: float  # seconds since the engine started
    duration: float
    scheduled: list[ScheduledEntry]
    preempted: list[str]  # request ids preempted (by recompute) while planning this step
    finished: list[str]
    num_waiting: int  # after the step
    num_running: int
    num_blocks_used: int
    num_blocks_free: int  # empty blocks
    num_blocks_cached: int  # unreferenced blocks still holding a reusable prefix
    num_batched_tokens: int
    usage: Optional[BlockUsage] = None  # full accounting, when record_block_tables is on
    block_tables: Optional[dict[str, list[int]]] = field(default=None, repr=False)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_prefill_tokens for e in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_decode_tokens for e in self.scheduled)


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
    }
