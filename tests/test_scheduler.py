"""Tests for `minipaged/engine/scheduler.py` with a real `BlockManager` and real `Sequence`s, no model.

A step is simulated the way `LLMEngine.process_tokens` does it: decide which scheduled sequences
sample (before anything moves), then `num_computed_tokens += num_new_tokens` and
`cache_full_blocks` for every scheduled sequence, then append a token to the sampling ones and
finish those that reached `max_tokens`. `check_step` asserts the scheduler's promises on every
plan it makes.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minipaged.engine.block_manager import BlockManager
from minipaged.engine.block_usage import check_invariants
from minipaged.engine.build import build_block_manager, build_scheduler
from minipaged.sampling import SamplingParams
from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus


def make_seq(prompt, name="r", max_tokens=16) -> Sequence:
    return Sequence(request_id=name, prompt_token_ids=list(prompt),
                    sampling_params=SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                   chunked=True, prefix_caching=False) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     enable_chunked_prefill=chunked)


def check_step(sched: Scheduler, out: SchedulerOutput, waiting_before: list[Sequence]) -> None:
    bm = sched.block_manager
    assert out.num_batched_tokens <= sched.max_num_batched_tokens, (
        f"{out.num_batched_tokens} tokens scheduled, budget {sched.max_num_batched_tokens}")
    assert len(sched.running) <= sched.max_num_seqs
    seqs = [s.seq for s in out.scheduled]
    assert len(set(map(id, seqs))) == len(seqs), "a sequence scheduled twice in one step"
    # Decodes first, then prefill chunks and admissions.
    kinds = [s.is_prefill for s in out.scheduled]
    assert kinds == sorted(kinds), f"a decode was scheduled after a prefill: {kinds}"
    for s in out.scheduled:
        seq = s.seq
        assert seq.status is SequenceStatus.RUNNING and seq in sched.running
        assert 1 <= s.num_new_tokens <= seq.num_uncomputed_tokens
        assert s.is_prefill == (s.num_new_tokens > 1 or seq.num_uncomputed_tokens > 1 or
                                seq in waiting_before)
        if not s.is_prefill:
            assert s.num_new_tokens == 1
        # The scheduler asked for room first: the table covers every token computed this step.
        table = bm.get_block_table(seq)
        assert len(table) * bm.block_size >= seq.num_computed_tokens + s.num_new_tokens
        if seq.num_computed_tokens < len(table) * bm.block_size:
            landing = table[seq.num_computed_tokens // bm.block_size]
            # Shared only if this step fills it and a later admission hit it (published at
            # allocation): the readers want exactly what this sequence writes.
            assert (bm.allocator.blocks[landing].ref_count == 1
                    or bm._uncomputed.get(landing, (None,))[0] is seq)
    for i, victim in enumerate(reversed(out.preempted)):
        assert victim.status is SequenceStatus.WAITING
        assert victim not in sched.running and victim not in seqs
        assert sched.waiting[i] is victim, "a preempted sequence goes to the front of the queue"
        assert victim.num_computed_tokens == 0
        assert victim.seq_id not in bm.block_tables, "a preempted sequence keeps its blocks"
    if out.preempted:
        admitted = [s for s in seqs if s in waiting_before]
        assert not admitted, "a sequence was admitted in a step that had to preempt"
    check_invariants(bm, [s.seq_id for s in sched.running])
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.seq_id not in bm.block_tables


def step(sched: Scheduler, token_of=lambda seq: 1) -> SchedulerOutput:
    """One engine step with the engine's post-step rule; finishes sequences at max_tokens."""
    waiting_before = list(sched.waiting)
    out = sched.schedule()
    check_step(sched, out, waiting_before)
    samples = [s.samples for s in out.scheduled]  # decided before num_computed_tokens moves
    for s, sampled in zip(out.scheduled, samples):
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(s.seq)
        if sampled:
            assert s.seq.num_computed_tokens == s.seq.num_tokens
            s.seq.append_token(token_of(s.seq))
            if s.seq.num_output_tokens >= s.seq.sampling_params.max_tokens:
                sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH)
        else:
            assert s.seq.num_computed_tokens < s.seq.num_tokens
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def place_running(sched: Scheduler, seq: Sequence, num_computed: int, decoding: bool) -> None:
    """Put `seq` in the running set by hand: `num_computed` tokens cached (a decode: plus one
    sampled token to compute)."""
    sched.block_manager.allocate(seq, [], num_computed)
    seq.num_computed_tokens = num_computed
    sched.block_manager.cache_full_blocks(seq)  # (the engine's post-step rule)
    if decoding:
        assert num_computed == seq.num_tokens
        seq.append_token(9)
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)


# --- ordering, budget, seats ----------------------------------------------------------------
def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(range(30), "a")  # admitted first, still prefilling
    b = make_seq(range(3), "b")  # admitted second, decoding
    place_running(sched, a, 5, decoding=False)
    place_running(sched, b, 3, decoding=True)
    c = make_seq(range(4), "c")
    sched.add(c)
    out = step(sched)
    assert plan(out) == [("b", 1), ("a", 7)]  # b first although a was admitted first; no room for c
    assert [s.is_prefill for s in out.scheduled] == [False, True]
    assert b.num_output_tokens == 2 and a.num_computed_tokens == 12
    assert c.status is SequenceStatus.WAITING


def test_new_prefill_shares_a_step_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add(make_seq(range(4), "a"))
    assert plan(step(sched)) == [("a", 4)]
    sched.add(make_seq(range(20), "b"))
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 9)]  # a's decode first, b's chunk fills the budget
    assert out.num_batched_tokens == 10


def test_max_num_seqs_caps_running_sequences():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(range(3), f"s{i}", max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert plan(out) == [("s0", 3), ("s1", 3)]
    assert len(sched.waiting) == 3
    finished_order = []
    for _ in range(30):
        if not sched.has_unfinished():
            break
        before = {s.request_id for s in sched.running}
        step(sched)
        finished_order += sorted(before - {s.request_id for s in sched.running})
    assert not sched.has_unfinished()
    assert finished_order == ["s0", "s1", "s2", "s3", "s4"]
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_token_budget_is_never_exceeded_with_many_prompts():
    sched = make_scheduler(max_num_batched_tokens=7, max_num_seqs=16, num_blocks=128)
    for i in range(10):
        sched.add(make_seq(range(i + 2), f"s{i}", max_tokens=4))
    totals = []
    while sched.has_unfinished():
        totals.append(step(sched).num_batched_tokens)  # check_step asserts <= 7
        assert len(totals) < 100
    assert max(totals) == 7  # the budget was the binding limit, and always respected


# --- chunked prefill ------------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(range(10), "long", max_tokens=2)
    sched.add(seq)
    chunks = []
    while sched.has_unfinished():
        out = step(sched)
        chunks.append([(s.num_new_tokens, s.is_prefill, s.seq.num_computed_tokens) for s in out.scheduled])
    assert chunks == [[(4, True, 4)], [(4, True, 8)], [(2, True, 10)], [(1, False, 11)]]
    assert seq.num_output_tokens == 2 and seq.status is SequenceStatus.FINISHED_LENGTH


def test_chunk_samples_only_when_it_reaches_the_end():
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(range(6), "s")
    sched.add(seq)
    out = sched.schedule()
    assert [s.samples for s in out.scheduled] == [False]
    seq.num_computed_tokens += 4
    out = sched.schedule()
    assert [(s.num_new_tokens, s.samples) for s in out.scheduled] == [(2, True)]


def test_without_chunked_prefill_a_too_long_prompt_waits():
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    short, long = make_seq(range(3), "short", max_tokens=2), make_seq(range(12), "long")
    sched.add(short)
    sched.add(long)
    out = step(sched)
    assert plan(out) == [("short", 3)]  # the long prompt does not fit the budget: no chunk
    for _ in range(3):
        step(sched)
        assert long.status is SequenceStatus.WAITING and long.num_computed_tokens == 0
        assert long.seq_id not in sched.block_manager.block_tables
    assert short.is_finished and list(sched.waiting) == [long]
    assert sched.schedule().is_empty


def test_without_chunked_prefill_a_fitting_prompt_runs_whole():
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    sched.add(make_seq(range(5), "a"))
    sched.add(make_seq(range(5), "b"))  # 5 + 5 > 8: b waits for the next step, unsplit
    assert plan(step(sched)) == [("a", 5)]
    assert plan(step(sched)) == [("a", 1), ("b", 5)]


# --- preemption -----------------------------------------------------------------------------
def test_preemption_takes_the_most_recently_admitted():
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=16)
    a, b, c = (make_seq(range(3), n) for n in "abc")
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [("a", 3), ("b", 3), ("c", 3)]  # 2 blocks each: cache full
    assert sched.block_manager.num_free_blocks == 0
    d = make_seq([5], "d")
    sched.add(d)
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 1)]  # 4 tokens still fit 2 blocks
    c_blocks = list(sched.block_manager.get_block_table(c))
    out = step(sched)  # a needs a third block: c (admitted last) gives its blocks up
    assert out.preempted == [c]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [c, d]  # front of the queue, ahead of d
    assert c.seq_id not in sched.block_manager.block_tables
    a_b_blocks = set(sched.block_manager.get_block_table(a) + sched.block_manager.get_block_table(b))
    assert set(c_blocks) & a_b_blocks  # the freed blocks were reused at once
    assert d.status is SequenceStatus.WAITING  # no admission in a preempting step
    # c keeps its outputs and later recomputes prompt + outputs in one prefill.
    assert c.num_output_tokens == 2 and c.num_tokens == 5
    out = step(sched)  # a and b now fit 6 tokens in 3 blocks each
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == []
    out = step(sched)  # a needs a fourth block: b is now the most recently admitted
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    assert list(sched.waiting) == [b, c, d]


def test_preempting_a_decode_already_scheduled_this_step():
    """State built by hand: running = [a (prefilling), c (prefilling), b (decoding)]. b's decode
    is planned first, then a's chunk of 7 does not fit, so b (admitted last) is preempted and its
    token goes back to the budget. a's chunk must stay at the 7 tokens whose blocks were checked
    (growing it to 8 would need a block nobody checked), and c gets the returned token."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    a = make_seq(range(30), "a")
    c = make_seq(range(10), "c")
    b = make_seq([1, 2, 3], "b")
    place_running(sched, a, 5, decoding=False)  # 2 blocks
    place_running(sched, c, 2, decoding=False)  # 1 block, 2 free slots
    place_running(sched, b, 3, decoding=True)  # 1 block; 0 free
    out = step(sched)
    assert out.preempted == [b]
    assert plan(out) == [("a", 7), ("c", 1)]
    assert b.status is SequenceStatus.WAITING and b.seq_id not in sched.block_manager.block_tables
    assert a.num_computed_tokens == 12 and c.num_computed_tokens == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_block_planned_then_preempted_in_the_same_pass_is_unpublished(mode):
    """As above, with the prefix cache: b's decode fills its block, which is published when the
    slot is allocated; then b is preempted before any forward ran. Its block must leave the
    prefix cache and b's hash chain (swap_in would publish the hashes it keeps, over a copy
    whose last slot was never written)."""
    bm = build_block_manager(4, 4, enable_prefix_caching=True, num_cpu_blocks=8,
                             preemption_mode=mode)
    sched = build_scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, preemption_mode=mode)
    a, c, b = make_seq(range(30), "a"), make_seq(range(10), "c"), make_seq([1, 2, 3], "b")
    place_running(sched, a, 5, decoding=False)
    place_running(sched, c, 2, decoding=False)
    place_running(sched, b, 3, decoding=True)
    out = sched.schedule()
    assert out.preempted == [b] and (out.swapped_out == [b]) == (mode == "swap")
    assert all(owner is not b for owner, _, _ in bm._uncomputed.values())  # a's chunk's are left
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 9, 0]))[1] == 0
    if mode == "swap":
        assert bm._hashes[b.seq_id] == []


def test_a_lone_sequence_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=2, block_size=2, max_num_batched_tokens=8)
    seq = make_seq(range(4), "s")
    sched.add(seq)
    step(sched)  # 4 tokens in 2 blocks, then one sampled token: a fifth needs a third block
    out = step(sched)
    assert out.preempted == [seq] and out.is_empty
    assert list(sched.waiting) == [seq] and sched.running == []
    assert sched.block_manager.num_free_blocks == 2


def test_finish_frees_blocks():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=14)
    a, b, w = make_seq(range(9), "a"), make_seq(range(5), "b"), make_seq(range(50), "w")
    for s in (a, b, w):
        sched.add(s)
    step(sched)
    assert list(sched.waiting) == [w]  # a and b used the whole budget
    bm = sched.block_manager
    used = bm.num_blocks - bm.num_free_blocks
    a_blocks = len(bm.get_block_table(a))
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert a.status is SequenceStatus.FINISHED_STOPPED and a not in sched.running
    assert a.seq_id not in bm.block_tables
    assert bm.num_blocks - bm.num_free_blocks == used - a_blocks
    sched.finish(w, SequenceStatus.FINISHED_ABORTED)  # a waiting sequence: leaves the queue
    assert not sched.waiting
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


# --- random workloads -----------------------------------------------------------------------
@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    chunked = draw(st.booleans())
    prefix_caching = draw(st.booleans())
    max_tokens = draw(st.lists(st.integers(1, 8), min_size=1, max_size=8))
    base = draw(st.lists(st.integers(0, 3), min_size=20, max_size=20))
    prompts = []
    for _ in max_tokens:  # many prompts share a prefix of `base`
        cut = draw(st.integers(0, 12))
        prompts.append(base[:cut] + draw(st.lists(st.integers(0, 3), min_size=1 if cut == 0 else 0,
                                                  max_size=8)))
    longest = max(len(p) + t for p, t in zip(prompts, max_tokens))
    budget = draw(st.integers(2, 24))
    if not chunked:
        budget = max(budget, longest)  # the config check: without chunks a whole sequence fits
    num_blocks = -(-longest // bs) + draw(st.integers(0, 8))  # one longest sequence always fits
    return dict(bs=bs, chunked=chunked, prefix_caching=prefix_caching, prompts=prompts,
                max_tokens=max_tokens, budget=budget, num_blocks=num_blocks,
                max_num_seqs=draw(st.integers(1, 6)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_run_to_completion(w):
    sched = make_scheduler(num_blocks=w["num_blocks"], block_size=w["bs"],
                           max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                           chunked=w["chunked"], prefix_caching=w["prefix_caching"])
    seqs = [make_seq(p, f"s{i}", max_tokens=t)
            for i, (p, t) in enumerate(zip(w["prompts"], w["max_tokens"]))]
    for s in seqs:
        sched.add(s)
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        out = step(sched, token_of=lambda seq: (seq.num_tokens * 3) % 4)
        assert not out.is_empty or out.preempted, "a step with nothing to do and nothing freed"
    assert not sched.has_unfinished(), "the workload did not finish in 1000 steps"
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED_LENGTH
        assert s.num_output_tokens == s.sampling_params.max_tokens
        assert s.token_ids == s.prompt_token_ids + s.output_token_ids
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
    check_invariants(bm, [])
