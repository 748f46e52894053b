"""The engine on a virtual clock: the real scheduler and block manager, no model (lesson 13).

`simulate` is `LLMEngine`'s loop with the forward replaced by a number: a discrete-event loop
over request arrivals and steps. At each step boundary the requests that have arrived by then
join the scheduler (`Scheduler.add`, as `add_request` does); the real `Scheduler` plans the step
over the real `BlockManager` (built by engine/build.py from the same knobs, so policies such as
`scheduling_policy="priority"` come with it); the step's duration comes from a `StepCostModel`
fitted to measured steps of the real engine (cost_model.py); then `advance` does what the
engine does after a forward: the scheduled tokens are computed and their full blocks published,
every sequence that reached its last token "samples" a placeholder token, and one that reached
`max_tokens` (EOS is ignored) or `max_model_len` finishes and frees its blocks. While nothing is
queued the clock jumps to the next arrival.

With the same arrivals at the same step boundaries the plans are the real engine's, step for
step (tests/test_simulator.py checks it against stories260K); the clock is as good as the cost
model (benchmarks/experiments/serving_load/simulator_validation.py measures how good). Because a step costs microseconds
of Python instead of a forward, a learner sweeps request rates over thousands of requests in
seconds: that is how lesson 13 finds the latency knee and moves it with paged memory.

The sampled tokens are placeholders, so the prefix cache can only ever hit prompt blocks and a
sequence's own blocks (after a preemption): a simulation of requests that share generated text
would differ from the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import numpy as np

from minipaged.engine.build import build_block_manager, build_scheduler
from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.sampling import SamplingParams
from minipaged.simulator.cost_model import StepCostModel


@dataclass
class SimRequest:
    request_id: str
    arrival: float  # seconds from the start
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0


@dataclass
class RequestTimes:
    """One request's life on a clock (virtual or measured), in seconds from the start."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    first_token: Optional[float] = None
    finished: Optional[float] = None
    arrival_step: Optional[int] = None  # the first step it could be scheduled in
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def normalized_latency(self) -> float:
        """The vLLM paper's metric: end-to-end latency per output token (s/token)."""
        return self.e2e / self.output_len

    @property
    def tpot(self) -> float:
        return (self.finished - self.first_token) / max(self.output_len - 1, 1)


@dataclass
class SimStep:
    step: int
    start: float
    duration: float
    scheduled: list[tuple[str, int, int]]  # (request id, prefill tokens, decode tokens)
    preempted: list[str]
    finished: list[str]
    num_running: int
    num_waiting: int
    num_blocks_used: int


@dataclass
class SimResult:
    requests: list[RequestTimes]  # in arrival order
    steps: list[SimStep] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def duration(self) -> float:
        return max(r.finished for r in self.requests) if self.requests else 0.0

    def summary(self) -> dict:
        return summarize(self.requests, self.duration)


def summarize(requests: Seq[RequestTimes], duration: float) -> dict:
    """Means and percentiles of TTFT, TPOT, end-to-end and normalized latency, throughput."""
    def stats(name, xs, scale=1e3, unit="ms"):
        a = np.asarray(xs, dtype=float) * scale
        return {f"mean_{name}_{unit}": float(a.mean()), f"median_{name}_{unit}": float(np.median(a)),
                f"p90_{name}_{unit}": float(np.percentile(a, 90)),
                f"p99_{name}_{unit}": float(np.percentile(a, 99))}
    out = {"completed": len(requests), "duration": duration,
           "request_throughput": len(requests) / duration if duration else 0.0,
           "output_throughput": sum(r.output_len for r in requests) / duration if duration else 0.0}
    out.update(stats("ttft", [r.ttft for r in requests]))
    out.update(stats("tpot", [r.tpot for r in requests if r.output_len > 1] or [0.0]))
    out.update(stats("e2el", [r.e2e for r in requests]))
    out.update(stats("normalized_latency", [r.normalized_latency for r in requests], 1.0, "s"))
    return out


def advance(sched: Scheduler, out: SchedulerOutput, max_model_len: int,
            placeholder: int = 0) -> tuple[list[Sequence], list[Sequence]]:
    """The engine's work after a forward, without one (update_computed, then sample_and_process
    with a placeholder token): returns (the sequences that sampled, those that finished)."""
    bm = sched.block_manager
    sampling = [s.seq for s in out.scheduled if s.samples]  # decided when the step was planned
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        bm.cache_full_blocks(s.seq)
    finished = []
    for seq in sampling:
        seq.append_token(placeholder)
        if (seq.num_output_tokens >= seq.sampling_params.max_tokens
                or seq.num_tokens >= max_model_len):
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
            finished.append(seq)
    return sampling, finished


def build(*, num_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
          max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
          enable_prefix_caching: bool = True, scheduling_policy: str = "fcfs",
          base: type[Scheduler] = Scheduler,
          scheduler_kwargs: Optional[dict] = None) -> Scheduler:
    """A scheduler over a fresh block manager, composed as engine/build.py composes the
    engine's (`base` and `scheduler_kwargs`: another scheduler class and its keywords, e.g. an
    admission policy of admission.py)."""
    bm = build_block_manager(num_blocks, block_size, enable_prefix_caching)
    return build_scheduler(bm, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           enable_chunked_prefill=enable_chunked_prefill,
                           scheduling_policy=scheduling_policy, base=base,
                           **(scheduler_kwargs or {}))


def simulate(requests: Seq[SimRequest], cost: StepCostModel, *, max_model_len: int,
             record_steps: bool = True, max_steps: int = 10_000_000, **knobs) -> SimResult:
    """Serve `requests` on the virtual clock (see the docstring). `knobs`: `build`'s."""
    sched = build(**knobs)
    reqs = sorted(requests, key=lambda r: r.arrival)
    times = {r.request_id: RequestTimes(r.request_id, r.arrival, len(r.prompt_token_ids),
                                        r.max_tokens) for r in reqs}
    seqs: dict[str, Sequence] = {}
    for r in reqs:
        if len(r.prompt_token_ids) + r.max_tokens > max_model_len:
            raise ValueError(f"request {r.request_id}: {len(r.prompt_token_ids)} prompt + "
                             f"{r.max_tokens} output tokens exceed max_model_len={max_model_len}")
    result = SimResult([times[r.request_id] for r in reqs])
    clock, nxt, step = 0.0, 0, 0
    while nxt < len(reqs) or sched.has_unfinished():
        if not sched.has_unfinished():
            clock = max(clock, reqs[nxt].arrival)  # idle: jump to the next arrival
        while nxt < len(reqs) and reqs[nxt].arrival <= clock:
            r = reqs[nxt]
            seq = Sequence(r.request_id, list(r.prompt_token_ids),
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                          temperature=0.0),
                           arrival_time=r.arrival, priority=r.priority)
            seqs[r.request_id] = seq
            times[r.request_id].arrival_step = step
            sched.add(seq)
            nxt += 1
        out = sched.schedule()
        if out.is_empty and not out.preempted:
            raise RuntimeError("the scheduler made no progress: a request cannot fit the cache")
        dt = cost.step_time(out)
        sampled, finished = advance(sched, out, max_model_len)
        clock += dt
        for seq in sampled:
            t = times[seq.request_id]
            if t.first_token is None:
                t.first_token = clock
        for seq in finished:
            times[seq.request_id].finished = clock
            times[seq.request_id].num_preemptions = seq.num_preemptions
        if record_steps:
            result.steps.append(SimStep(
                step, clock - dt, dt,
                [(s.seq.request_id, s.num_new_tokens if s.is_prefill else 0,
                  0 if s.is_prefill else s.num_new_tokens) for s in out.scheduled],
                list(dict.fromkeys(s.request_id for s in out.preempted)),
                [s.request_id for s in finished], len(sched.running), len(sched.waiting),
                sched.block_manager.num_blocks - sched.block_manager.num_free_blocks))
        step += 1
        if step > max_steps:
            raise RuntimeError(f"no end after {max_steps} steps")
    result.num_preemptions = sched.num_preemptions
    return result


def requests_from_workload(workload, offsets: Seq[float],
                           priorities: Optional[Seq[int]] = None) -> list[SimRequest]:
    """`SimRequest`s from a `minipaged.benchmark.throughput.Workload` and arrival offsets."""
    prios = priorities or [0] * len(offsets)
    return [SimRequest(str(i), t, list(p), m, prio) for i, (p, m, t, prio)
            in enumerate(zip(workload.prompts, workload.max_tokens, offsets, prios))]
