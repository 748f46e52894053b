"""Replaying an engine trace: what each request did at each step (lessons 02 and 03).

`request_timeline` turns a list of `StepRecord`s into one `RequestState` per request and step
(the Gantt charts' colours); `tokens_in_cache` gives each request's cached tokens at a step.
"""
from __future__ import annotations

import enum
from typing import Optional, Sequence

from minipaged.engine.trace import StepRecord


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
