"""Priority scheduling (minipaged/priority/, lesson 13): vLLM's `scheduling_policy="priority"`.

The scheduler-level tests drive the real `Scheduler` + `BlockManager` (no model) with the
engine's post-step rule (`tests.test_scheduler.step`'s, without its FCFS-only checks); the
engine-level ones run stories260K. Lower `priority` runs first, ties by arrival; a more urgent
waiting request preempts strictly less urgent running ones. These tests grade stage 13 of the
build track, `priority` (minipaged/exercises/skeletons/priority.py).
"""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged import LLM, SamplingParams
from minipaged.config import EngineConfig
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.block_usage import check_invariants
from minipaged.engine.build import build_scheduler
from minipaged.engine.processor import RequestError
from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.priority import PriorityScheduling, priority_key


def make_seq(prompt_len: int, name: str, max_tokens: int, priority: int = 0,
             arrival: float = 0.0) -> Sequence:
    return Sequence(request_id=name, prompt_token_ids=[(7 * len(name) + i) % 50 + 3
                                                       for i in range(prompt_len)],
                    sampling_params=SamplingParams(max_tokens=max_tokens),
                    arrival_time=arrival, priority=priority)


def make_scheduler(policy: str = "priority", num_blocks: int = 16, block_size: int = 4,
                   max_num_seqs: int = 8, budget: int = 64, chunked: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return build_scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           enable_chunked_prefill=chunked, scheduling_policy=policy)


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """One engine step without a model; returns the plan and the requests it finished."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    finished = []
    samples = [s.samples for s in out.scheduled]
    for s, sampled in zip(out.scheduled, samples):
        assert s.seq.status is SequenceStatus.RUNNING and s.seq in sched.running
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(s.seq)
        if sampled:
            s.seq.append_token(1)
            if s.seq.num_output_tokens >= s.seq.sampling_params.max_tokens:
                sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(s.seq.request_id)
    for victim in out.preempted:
        assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
        assert victim.seq_id not in sched.block_manager.block_tables
    check_invariants(sched.block_manager, [s.seq_id for s in sched.running])
    return out, finished


def run(sched: Scheduler, later: dict[int, list[Sequence]] | None = None,
        max_steps: int = 2000) -> list[str]:
    """Step until done, adding `later[i]` before step i; the requests in finishing order."""
    later = later or {}
    order: list[str] = []
    for i in range(max_steps):
        for seq in later.get(i, []):
            sched.add(seq)
        if not sched.has_unfinished() and i > max(later, default=0):
            break
        order += step(sched)[1]
    assert not sched.has_unfinished(), "did not finish"
    return order


def full_cache_run(policy: str) -> list[str]:
    """Four low-priority requests fill the cache (16 blocks of 4: 12 prompt tokens and a first
    decode each); a high-priority one arrives then."""
    sched = make_scheduler(policy)
    lows = [make_seq(12, f"low{i}", max_tokens=8, priority=1, arrival=i) for i in range(4)]
    for s in lows:
        sched.add(s)
    step(sched)
    step(sched)
    assert len(sched.running) == 4 and sched.block_manager.num_free_blocks == 0
    high = make_seq(8, "high", max_tokens=4, priority=0, arrival=10)
    return run(sched, {0: [high]})


# --- the order ------------------------------------------------------------------------------
def test_priority_key_is_priority_then_arrival_then_creation():
    a = make_seq(4, "a", 4, priority=1, arrival=0.0)
    b = make_seq(4, "b", 4, priority=0, arrival=5.0)
    c = make_seq(4, "c", 4, priority=0, arrival=5.0)
    d = make_seq(4, "d", 4, priority=-3, arrival=9.0)
    assert sorted([a, b, c, d], key=priority_key) == [d, b, c, a]
    assert priority_key(b) < priority_key(c)  # same priority and arrival: created first


def test_waiting_queue_is_kept_in_priority_order():
    sched = make_scheduler()
    seqs = [make_seq(4, n, 4, priority=p, arrival=t)
            for n, p, t in [("a", 2, 0), ("b", 0, 1), ("c", 2, 2), ("d", 1, 3), ("e", 0, 4)]]
    for s in seqs:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["b", "e", "d", "a", "c"]
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["b", "e", "d", "a", "c"]
    assert [s.request_id for s in sched.running] == ["b", "e", "d", "a", "c"]


def test_later_high_priority_request_finishes_before_earlier_low_priority_ones():
    """Under a full cache: with priorities it preempts its way in and finishes first; first
    come, first served it finishes last."""
    order = full_cache_run("priority")
    assert order[0] == "high", order
    fcfs = full_cache_run("fcfs")
    assert fcfs[-1] == "high", fcfs


def test_high_priority_waiting_request_preempts_the_least_urgent_latest_arrival():
    sched = make_scheduler(num_blocks=8, max_num_seqs=8)
    a = make_seq(6, "a", 16, priority=1, arrival=0)
    b = make_seq(6, "b", 16, priority=2, arrival=1)
    c = make_seq(6, "c", 16, priority=1, arrival=2)
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # 6 of 8 blocks taken; the next decodes fit in them
    h = make_seq(12, "h", 4, priority=0, arrival=3)  # needs 3 blocks
    sched.add(h)
    out, _ = step(sched)
    assert [v.request_id for v in out.preempted] == ["b"]  # lowest priority first
    assert h in sched.running and h.status is SequenceStatus.RUNNING
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_equal_priority_never_preempts_a_running_request():
    sched = make_scheduler(num_blocks=8, max_num_seqs=8)
    running = [make_seq(12, f"r{i}", 16, priority=0, arrival=i) for i in range(2)]
    for s in running:
        sched.add(s)
    step(sched)  # 6 of 8 blocks
    late = make_seq(12, "late", 4, priority=0, arrival=9)
    sched.add(late)
    out, _ = step(sched)
    assert not out.preempted and late in sched.waiting


def test_seat_limit_preemption():
    """`max_num_seqs` full of less urgent requests: the urgent one takes a seat at once."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(2):
        sched.add(make_seq(4, f"low{i}", 20, priority=5, arrival=i))
    step(sched)
    urgent = make_seq(4, "urgent", 2, priority=1, arrival=5)
    sched.add(urgent)
    out, _ = step(sched)
    assert [v.request_id for v in out.preempted] == ["low1"]
    assert urgent in sched.running and len(sched.running) == 2


def test_preempted_request_goes_back_to_its_place_in_priority_order():
    sched = make_scheduler(num_blocks=8, max_num_seqs=8)
    low = make_seq(12, "low", 16, priority=3, arrival=0)
    sched.add(low)
    step(sched)
    mid = make_seq(4, "mid", 4, priority=2, arrival=1)
    sched.add(make_seq(24, "top", 4, priority=0, arrival=2))  # 6 blocks: low must go
    out, _ = step(sched)
    assert [v.request_id for v in out.preempted] == ["low"]
    sched.add(mid)
    assert [s.request_id for s in sched.waiting] == ["mid", "low"]  # not low at the front


def test_without_chunked_prefill_a_prompt_over_the_budget_preempts_nobody():
    sched = make_scheduler(num_blocks=8, max_num_seqs=8, budget=16, chunked=False)
    low = make_seq(8, "low", 16, priority=1)
    sched.add(low)
    step(sched)
    sched.add(make_seq(16, "long", 4, priority=0, arrival=1))  # 16 tokens, budget 15 left
    out, _ = step(sched)
    assert not out.preempted and low in sched.running


def test_without_priorities_the_policy_plans_exactly_like_fcfs():
    """No memory pressure, every priority 0: step for step the same plans as the core."""
    plans = {}
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(policy, num_blocks=256, max_num_seqs=4, budget=24)
        for i in range(10):
            sched.add(make_seq(5 + 3 * i, f"r{i}", 3 + i % 4))
        plans[policy] = []
        while sched.has_unfinished():
            out, _ = step(sched)
            plans[policy].append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
    assert plans["priority"] == plans["fcfs"]


@st.composite
def priority_workloads(draw):
    n = draw(st.integers(1, 8))
    reqs = [(draw(st.integers(1, 12)), draw(st.integers(1, 8)), draw(st.integers(-2, 2)),
             draw(st.integers(0, 6))) for _ in range(n)]  # prompt, max_tokens, priority, step
    bs = draw(st.sampled_from([1, 2, 4]))
    longest = max(p + t for p, t, _, _ in reqs)
    return dict(reqs=reqs, bs=bs, num_blocks=-(-longest // bs) + draw(st.integers(0, 6)),
                max_num_seqs=draw(st.integers(1, 5)), budget=draw(st.integers(2, 24)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(priority_workloads())
def test_random_workloads_with_priorities_finish_and_keep_the_queues_ordered(w):
    bm = BlockManager(w["num_blocks"], w["bs"], enable_prefix_caching=True)
    sched = build_scheduler(bm, max_num_seqs=w["max_num_seqs"],
                            max_num_batched_tokens=w["budget"], scheduling_policy="priority")
    assert isinstance(sched, PriorityScheduling)
    later: dict[int, list[Sequence]] = {}
    seqs = []
    for i, (p, t, prio, at) in enumerate(w["reqs"]):
        seq = make_seq(p, f"s{i}", t, priority=prio, arrival=float(at))
        seqs.append(seq)
        later.setdefault(at, []).append(seq)
    for i in range(3000):
        for seq in later.get(i, []):
            sched.add(seq)
        if not sched.has_unfinished() and i > max(later):
            break
        out, _ = step(sched)
        assert list(sched.waiting) == sorted(sched.waiting, key=priority_key)
        assert list(sched.running) == sorted(sched.running, key=priority_key)
        if out.preempted and sched.running:  # no victim is more urgent than a survivor
            assert (max(priority_key(v) for v in out.preempted)
                    > min(priority_key(s) for s in sched.running))
    assert not sched.has_unfinished()
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.num_output_tokens == s.sampling_params.max_tokens
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables


# --- the engine, the API and the checks ------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("stories260K", device="cpu", scheduling_policy="priority", num_blocks=24,
               block_size=16, max_num_seqs=8, max_model_len=256)


def test_engine_serves_a_late_urgent_request_first_and_the_tokens_do_not_change(llm):
    """stories260K under a full cache (24 blocks of 16; four low-priority requests would grow to
    10 each): the urgent request arrives once they fill it, preempts its way in and finishes
    first; its tokens and a low one's are those they get alone (greedy)."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    prompts = [f"Once upon a time there was a {w}" for w in ("cat", "dog", "bird", "fish")]
    for i, p in enumerate(prompts):
        eng.add_request(f"low{i}", p, params, priority=1)
    while eng.block_manager.num_free_blocks > 1:
        eng.step()
    start = eng.num_steps
    eng.add_request("urgent", "Tom had a big red ball", SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True), priority=0)
    finished, texts = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished.append(out.request_id)
                texts[out.request_id] = out.outputs[0].token_ids
    assert finished[0] == "urgent", finished
    admitted = next(r for r in list(eng.trace)[start:]
                    if any(e.request_id == "urgent" for e in r.scheduled))
    assert admitted.preempted and "urgent" not in admitted.preempted
    alone = llm.generate(["Tom had a big red ball", prompts[0]],
                         [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), params],
                         use_tqdm=False, priority=[0, 1])
    assert alone[0].outputs[0].token_ids == texts["urgent"]
    assert alone[1].outputs[0].token_ids == texts["low0"]


@pytest.mark.parametrize("bad, words", [
    ("1", ["priority must be an integer in [-9223372036854775808, 9223372036854775807]", "'1'"]),
    (2**63, ["priority must be an integer", str(2**63)]),
    (1.5, ["priority must be an integer", "1.5"]),
    (True, ["priority must be an integer", "True"]),
])
def test_priority_is_checked_naming_field_value_and_range(llm, bad, words):
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("bad", [1, 2, 3], priority=bad)
    for w in words:
        assert w in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_nonzero_priority_needs_the_priority_policy():
    fcfs = LLM("stories260K", device="cpu", num_blocks=32)
    with pytest.raises(RequestError, match=r"priority=3 needs scheduling_policy='priority'"):
        fcfs.generate(["Once"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[3])
    out = fcfs.generate(["Once"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="one integer per prompt"):
        fcfs.generate(["a", "b"], use_tqdm=False, priority=[0])


def test_config_checks_the_policy():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', "
                                         r"'priority'\), got 'lifo'"):
        EngineConfig(scheduling_policy="lifo").validate()
    with pytest.raises(ValueError, match="needs preemption_mode='recompute'"):
        EngineConfig(scheduling_policy="priority", preemption_mode="swap").validate()


def test_server_priority_field():
    """The API's `priority`: honoured under --scheduling-policy priority, a 400 naming the
    field otherwise, and out of range."""
    from minipaged.lessons.server import InProcessServer
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "priority": 4}
    with InProcessServer("stories260K", "--device", "cpu", "--num-blocks", "32") as fcfs:
        r = httpx.post(fcfs.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "scheduling_policy='priority'" in r.json()["error"]["message"]
        r = httpx.post(fcfs.url + "/v1/completions", json=body | {"priority": 0}, timeout=30)
        assert r.status_code == 200
    with InProcessServer("stories260K", "--device", "cpu", "--num-blocks", "32",
                         "--scheduling-policy", "priority") as prio:
        r = httpx.post(prio.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = httpx.post(prio.url + "/v1/completions", json=body | {"priority": 2**70},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert str(2**70) in r.json()["error"]["message"]
