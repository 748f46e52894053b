"""The engine on a virtual clock (minipaged/simulator/): the simulator's plans are the real
engine's, step for step, on the same arrival trace (stories260K, preemption and chunked prefill
forced, both scheduling policies); its clock follows the cost model exactly; the cost model's
fit recovers known coefficients. (How close its times come to measured ones is a benchmark:
benchmarks/experiments/serving_load/simulator_validation.py.)"""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from minipaged import LLM
from minipaged.benchmark.serving import arrival_offsets
from minipaged.benchmark.throughput import make_workload
from minipaged.engine.trace import ScheduledEntry
from minipaged.simulator import SimRequest, StepCostModel, requests_from_workload, simulate
from minipaged.simulator.cost_model import FEATURES, features, nnls, synthetic
from minipaged.simulator.replay import replay_by_steps

KNOBS = dict(num_blocks=40, block_size=8, max_num_seqs=6, max_num_batched_tokens=48)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_plans_match_the_real_engine_step_for_step(policy):
    wl = make_workload("cpu", 512, num_requests=20, seed=3, bos=1)
    wl.max_tokens = [m // 3 + 4 for m in wl.max_tokens]  # keep the run short
    rng = random.Random(5)
    prios = [rng.randint(0, 2) for _ in wl.prompts] if policy == "priority" else None
    reqs = requests_from_workload(wl, arrival_offsets(20, 150.0, seed=4), prios)
    sim = simulate(reqs, synthetic(1.0, 10, seq_us=20, ctx_ns=2), max_model_len=256,
                   scheduling_policy=policy, **KNOBS)
    assert sim.num_preemptions > 0, "the trace should force preemption"
    assert any(p and d for p, d in [(any(e[1] for e in s.scheduled), any(e[2] for e in s.scheduled))
                                    for s in sim.steps]), "prefill and decode should share steps"
    llm = LLM("stories260K", device="cpu", max_model_len=256, scheduling_policy=policy, **KNOBS)
    real = replay_by_steps(llm.engine, reqs, {r.request_id: r.arrival_step for r in sim.requests})
    trace = list(llm.engine.trace)
    assert len(trace) == len(sim.steps)
    for rec, st in zip(trace, sim.steps):
        assert [(e.request_id, e.num_prefill_tokens, e.num_decode_tokens)
                for e in rec.scheduled] == st.scheduled, f"step {rec.step}"
        assert rec.preempted == st.preempted and sorted(rec.finished) == sorted(st.finished)
        assert (rec.num_running, rec.num_waiting, rec.num_blocks_used) == (
            st.num_running, st.num_waiting, st.num_blocks_used)
    by_id = {r.request_id: r for r in sim.requests}
    for r in real:
        s = by_id[r.request_id]
        assert r.output_len == s.output_len and r.num_preemptions == s.num_preemptions


def test_the_clock_is_the_cost_model():
    """One request alone, arriving at 5 s: its first token comes after one prefill step, the
    next ones one decode step apart; idle time before it is skipped, not stepped."""
    cost = synthetic(step_ms=2.0, token_us=100.0, seq_us=50.0, ctx_ns=1000.0, prefill_step_ms=1.0)
    req = SimRequest("a", 5.0, list(range(3, 13)), max_tokens=4)
    res = simulate([req], cost, max_model_len=64, num_blocks=8, block_size=4)
    t = res.requests[0]
    assert len(res.steps) == 4 and t.arrival_step == 0
    prefill = 0.002 + 0.001 + 50e-6 + 10 * 100e-6
    decodes = [0.002 + 50e-6 + 100e-6 + (10 + k) * 1e-6 for k in range(1, 4)]  # context 11-13
    assert t.ttft == pytest.approx(prefill)
    assert t.e2e == pytest.approx(prefill + sum(decodes))
    assert t.normalized_latency == pytest.approx(t.e2e / 4)
    assert res.steps[0].start == pytest.approx(5.0)


def test_a_request_too_long_for_max_model_len_is_refused():
    with pytest.raises(ValueError, match="exceed max_model_len=16"):
        simulate([SimRequest("a", 0.0, [3] * 10, 10)], synthetic(1, 1), max_model_len=16,
                 num_blocks=8)


def test_fit_recovers_known_coefficients_and_refuses_negative_costs():
    rng = np.random.default_rng(0)
    true = {"step": 2e-3, "prefill_step": 1e-3, "seqs": 4e-6, "tokens": 30e-6,
            "decode_context": 2e-8, "prefill_attention": 5e-6}
    records = []
    for _ in range(300):
        entries = [ScheduledEntry("r", 0, 0, 1, int(rng.integers(10, 400)))
                   for _ in range(int(rng.integers(0, 30)))]
        entries += [ScheduledEntry("p", 0, int(rng.integers(1, 256)), 0, int(rng.integers(0, 200)))
                    for _ in range(int(rng.integers(0, 3)))]
        if not entries:
            continue
        f = features((e.num_prefill_tokens, e.num_decode_tokens, e.num_computed_before)
                     for e in entries)
        duration = sum(true[k] * v for k, v in zip(FEATURES, f)) * (1 + rng.normal(0, 0.0005))
        records.append(SimpleNamespace(scheduled=entries, duration=duration))
    model = StepCostModel.fit(records, source="synthetic")
    for k in FEATURES:
        assert model.coefficients[k] == pytest.approx(true[k], rel=0.05), k
    assert all(v >= 0 for v in model.coefficients.values())
    assert model.fit_stats["r2"] > 0.99
    again = StepCostModel.from_dict(model.to_dict())
    assert again.coefficients == model.coefficients
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    assert (nnls(a, np.array([2.0, 1.0, 0.0])) >= 0).all()  # the slope would be -1
    with pytest.raises(ValueError, match="at least as many"):
        StepCostModel.fit(records[:3])


# --- the paper's comparison: admission policies and the knee ---------------------------------
def _reserved_runs(system, reqs, capacity=4096, max_model_len=512):
    from minipaged.simulator.sweep import system_knobs
    return simulate(reqs, synthetic(10.0, 100.0), max_model_len=max_model_len,
                    **system_knobs(system, capacity, max_model_len, max_num_seqs=64))


def _sharegpt_like(n=60, rate=50.0, max_model_len=512):
    wl = make_workload("sharegpt", 32000, num_requests=n, seed=2, max_model_len=max_model_len)
    return requests_from_workload(wl, arrival_offsets(n, rate, seed=2))


@pytest.mark.parametrize("system, per_request", [
    ("orca-oracle", lambda r: len(r.prompt_token_ids) + r.max_tokens - 1),
    ("orca-max", lambda r: 512)])
def test_reservations_bound_what_runs_and_never_preempt(system, per_request):
    reqs = _sharegpt_like()
    res = _reserved_runs(system, reqs)
    by_id = {r.request_id: r for r in reqs}
    assert res.num_preemptions == 0 and all(t.finished is not None for t in res.requests)
    first, last = {}, {}  # a request holds its region from its first step to its last
    for st in res.steps:
        for rid, _, _ in st.scheduled:
            first.setdefault(rid, st.step)
            last[rid] = st.step
    held = [sum(per_request(by_id[rid]) for rid in first if first[rid] <= st.step <= last[rid])
            for st in res.steps]
    peak = max(held)
    assert peak <= 4096
    paged = _reserved_runs("paged", reqs)
    assert max(s.num_running for s in res.steps) <= max(s.num_running for s in paged.steps)
    if system == "orca-max":
        assert max(s.num_running for s in res.steps) <= 4096 // 512


def test_static_batching_admits_nobody_while_a_batch_decodes():
    reqs = _sharegpt_like(n=40, rate=20.0)
    res = _reserved_runs("static", reqs)
    running = set()
    closed = False
    for st in res.steps:
        started = {e[0] for e in st.scheduled} - running
        if closed:
            assert not started, f"step {st.step}: {started} joined a running batch"
        running |= started
        running -= set(st.finished)
        if not running:
            closed = False
        elif st.scheduled and all(e[2] for e in st.scheduled):  # the batch decodes: closed
            closed = True
    assert all(t.finished is not None for t in res.requests)


def test_capacity_rate_interpolates_the_crossing():
    from minipaged.simulator.sweep import capacity_rate
    pts = [{"request_rate": r, "mean_normalized_latency_s": v}
           for r, v in [(1.0, 0.1), (2.0, 0.2), (4.0, 1.0)]]
    assert capacity_rate(pts, 0.6) == pytest.approx(2.0 * 2 ** 0.5)  # halfway in log rate
    assert capacity_rate(pts, 5.0) is None and capacity_rate(pts, 0.05) is None


@pytest.mark.timeout(300)
def test_paper_order_paged_sustains_the_highest_rate():
    """On the A100-like costs and a small ShareGPT-like trace the paper's order holds: paged >=
    Orca (Oracle) >= (Pow2) >= (Max) > static batching, each capacity found."""
    from minipaged.lessons.serving_load import a100_opt13b_cost
    from minipaged.simulator.sweep import SYSTEMS, paper_curves
    wl = make_workload("sharegpt", 32000, num_requests=120, seed=0, max_model_len=2048)
    res = paper_curves(wl, a100_opt13b_cost(), kv_capacity=14_600, max_model_len=2048,
                       fractions=(0.1, 0.5, 0.85, 1.15, 1.6))
    caps = [res["systems"][s]["capacity_rate"] for s in SYSTEMS]
    assert all(c is not None for c in caps), caps
    assert caps == sorted(caps, reverse=True) and caps[0] > 1.2 * caps[1] and caps[-1] < caps[-2]
