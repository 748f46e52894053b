"""The same arrival trace through the real engine, for comparison with the simulator (lesson 13).

* `replay_by_steps` adds each request before the step the simulator added it in (its
  `RequestTimes.arrival_step`): the real `LLMEngine` then faces exactly the simulator's
  decisions, and its trace must be the simulator's step for step (tests/test_simulator.py).
* `replay` adds each request when its arrival time has come and steps the engine as fast as it
  goes (an offline `LLMEngine` in this process, no server): the measurement the simulator's
  clock is judged against (benchmarks/experiments/serving_load/simulator_validation.py). A request that arrives during a
  step joins before the next one, in both, and its TTFT counts that wait. Its clock is the wall
  clock (`clock="wall"`), or this process's CPU time (`"cpu"`, the default): each step and each
  `add_request` advance it by the CPU time they took, and an idle engine jumps to the next
  arrival. On a machine shared with other work the wall clock measures the neighbours too; the
  CPU clock measures what the engine itself spent, as if it had a core to itself.

Both return `RequestTimes` in seconds from the start, like `simulate`'s.
"""
from __future__ import annotations

import time
from typing import Sequence as Seq

from minipaged.sampling import SamplingParams
from minipaged.simulator.clock import RequestTimes, SimRequest

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _add(engine, r: SimRequest, arrival_time: float):
    return engine.add_request(r.request_id, list(r.prompt_token_ids),
                              SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                             temperature=0.0),
                              arrival_time=arrival_time, priority=r.priority)


def _times(r: SimRequest, seq, t0: float, arrival_step: int) -> RequestTimes:
    return RequestTimes(r.request_id, r.arrival, len(r.prompt_token_ids), r.max_tokens,
                        seq.first_token_time - t0, seq.finished_time - t0, arrival_step,
                        seq.num_preemptions)


def replay_by_steps(engine, requests: Seq[SimRequest],
                    arrival_steps: dict[str, int]) -> list[RequestTimes]:
    """Step `engine`, adding each request right before step `arrival_steps[id]`."""
    by_step: dict[int, list[SimRequest]] = {}
    for r in requests:
        by_step.setdefault(arrival_steps[r.request_id], []).append(r)
    t0, step, seqs = time.time(), 0, {}
    while True:
        for r in by_step.pop(step, []):
            seqs[r.request_id] = (r, _add(engine, r, t0 + r.arrival))
        if not by_step and not engine.has_unfinished_requests():
            break
        engine.step()
        step += 1
    return [_times(r, seq, t0, arrival_steps[r.request_id]) for r, seq in seqs.values()]


def replay(engine, requests: Seq[SimRequest], clock: str = "cpu"
           ) -> tuple[list[RequestTimes], list[float]]:
    """Serve `requests` as they arrive (see the docstring); (their times in arrival order, each
    step's seconds on `clock`). A request's first token and its end are stamped at the end of
    the step that produced them, as the simulator stamps them."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {tuple(CLOCKS)}, got {clock!r}")
    tick = CLOCKS[clock]
    reqs = sorted(requests, key=lambda r: r.arrival)
    live: dict[str, tuple[SimRequest, object, RequestTimes]] = {}
    done: list[RequestTimes] = []
    step_seconds: list[float] = []
    now, nxt, step = 0.0, 0, 0
    while nxt < len(reqs) or live:
        if not live:  # idle until the next arrival: wait for it (wall) or jump to it (cpu)
            if clock == "wall":
                time.sleep(max(0.0, reqs[nxt].arrival - now))
            now = max(now, reqs[nxt].arrival)
        t = tick()
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            times = RequestTimes(r.request_id, r.arrival, len(r.prompt_token_ids), r.max_tokens,
                                 arrival_step=step)
            live[r.request_id] = (r, _add(engine, r, 0.0), times)
            nxt += 1
        engine.step()
        dt = tick() - t
        now += dt
        step_seconds.append(dt)
        step += 1
        for rid, (r, seq, times) in list(live.items()):  # stamped off the clock
            if times.first_token is None and seq.num_output_tokens:
                times.first_token = now
            if seq.is_finished:
                times.finished, times.num_preemptions = now, seq.num_preemptions
                done.append(times)
                del live[rid]
    return sorted(done, key=lambda t: t.arrival), step_seconds
