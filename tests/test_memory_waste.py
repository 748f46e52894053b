"""The accounting behind lesson 01's Fig. 2 reproduction (minipaged/lessons/memory_waste.py)."""
import pytest

from minipaged.lessons.memory_waste import (CATEGORIES, ContiguousAllocator, Request, compare_strategies,
                                    make_trace, next_pow2, paged_step_usages, reservation,
                                    simulate_contiguous, simulate_paged, waste_from_trace)


def cats(step):
    return tuple(getattr(step, c) for c in CATEGORIES)


def test_first_fit_allocator_holes():
    a = ContiguousAllocator(10)
    assert a.allocate("a", 4) == 0 and a.allocate("b", 3) == 4 and a.allocate("c", 3) == 7
    assert a.allocate("d", 1) is None
    a.free("a")
    a.free("c")
    assert a.holes() == [(0, 4), (7, 3)]
    assert a.free_slots == 7 and a.largest_hole == 4
    assert a.allocate("e", 5) is None  # 7 slots free, but not 5 in one piece
    assert a.allocate("f", 3) == 0  # first fit


def test_reservation_sizes():
    r = Request(prompt_len=3, output_len=3)  # writes 3 + 3 - 1 = 5 K/V entries
    assert r.kv_len == 5
    assert reservation("oracle", r, 64) == 5
    assert reservation("pow2", r, 64) == 8
    assert reservation("max", r, 64) == 64
    assert reservation("pow2", Request(30, 20), 40) == 40  # capped at max_model_len
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]


def test_contiguous_oracle_by_hand():
    # r0: prompt 2, output 3 -> writes 4 K/V; r1: prompt 1, output 2 -> writes 2.
    res = simulate_contiguous([(2, 3), (1, 2)], "oracle", capacity=16, max_model_len=8)
    # (token states, reserved, internal, external, free) after each step
    assert [cats(s) for s in res.steps] == [
        (3, 3, 0, 0, 10),  # both prefilled: r0 has 2 of 4, r1 1 of 2
        (3, 1, 0, 0, 12),  # both decoded; r1 sampled its 2nd token and finished
        (0, 0, 0, 0, 16),  # r0 finished
    ]
    assert res.token_state_share == pytest.approx(6 / 10)


def test_contiguous_max_and_pow2_by_hand():
    res = simulate_contiguous([(3, 3)], "max", capacity=16, max_model_len=8)
    # regions of 8 for a request that writes 5: 3 slots never used (internal fragmentation)
    assert [cats(s) for s in res.steps] == [(3, 2, 3, 0, 8), (4, 1, 3, 0, 8), (0, 0, 0, 0, 16)]
    res = simulate_contiguous([(3, 3)], "pow2", capacity=16, max_model_len=16)
    assert [cats(s) for s in res.steps][0] == (3, 2, 3, 0, 8)  # next_pow2(5) = 8
    assert res.token_state_share == pytest.approx(7 / 16)


def test_contiguous_external_fragmentation_by_hand():
    # a: 4 slots, b: 7 slots, c: 4 slots fill a cache of 15; a and c end after step 3, leaving
    # two holes of 4 while b runs: d needs 5 -> 8 free slots it cannot use (external
    # fragmentation) until b ends after step 5.
    reqs = [(1, 4), (2, 6), (1, 4), (1, 5)]
    res = simulate_contiguous(reqs, "oracle", capacity=15, max_model_len=16)
    ext = [s.external_fragmentation for s in res.steps]
    assert ext[:6] == [0, 0, 0, 8, 8, 0]
    assert res.steps[3].free == 0 and res.steps[3].num_waiting == 1
    assert res.steps[5].free == 15 and res.steps[5].num_waiting == 1  # b done; d admitted next
    assert res.steps[6].num_running == 1


def test_categories_sum_to_the_cache_for_every_strategy():
    reqs = make_trace("alpaca", 60, seed=3, max_model_len=256)
    results = compare_strategies(reqs, capacity=1024, block_sizes=(4, 16, 64), max_model_len=256)
    assert len(results) == 6
    for r in results:
        assert all(s.total == r.capacity for s in r.steps), r.label
        shares = r.shares(include_free=True)
        assert sum(shares.values()) == pytest.approx(1.0)
        assert sum(r.shares().values()) == pytest.approx(1.0)


def test_paged_share_is_tokens_stored_over_slots_allocated():
    reqs = make_trace("sharegpt", 40, seed=1, max_model_len=512)
    usages = [u for _, u in paged_step_usages(reqs, 200, 16, max_model_len=512)]
    res = simulate_paged(reqs, 200, 16, max_model_len=512)
    stored = sum(u.num_tokens_stored for u in usages)
    allocated = sum(u.num_slots_allocated for u in usages)
    assert res.token_state_share == pytest.approx(stored / allocated)
    assert all(s.reserved == 0 and s.external_fragmentation == 0 for s in res.steps)
    # block size 1 cannot waste a slot
    assert simulate_paged(reqs, 3200, 1, max_model_len=512).token_state_share == 1.0


def test_paged_internal_fragmentation_by_hand():
    # one request, prompt 5, output 2, block size 4: after prefill 5 tokens in 2 blocks (3
    # empty slots), after the last step 6 tokens... but it finished, so its blocks are free.
    res = simulate_paged([(5, 2)], 8, 4, max_model_len=32)
    assert [cats(s) for s in res.steps] == [(5, 0, 3, 0, 24), (0, 0, 0, 0, 32)]


def test_fig2_shape_on_sharegpt():
    """The paper's claim: paging keeps >= 96% token states, contiguous reservation far less."""
    reqs = make_trace("sharegpt", 120, seed=0)
    res = {r.label: r for r in compare_strategies(reqs, capacity=8 * 2048, block_sizes=(16,))}
    assert res["paged (block 16)"].token_state_share >= 0.96
    assert res["Orca (Max)"].token_state_share < 0.4
    assert (res["Orca (Max)"].token_state_share < res["Orca (Pow2)"].token_state_share
            < res["Orca (Oracle)"].token_state_share < res["paged (block 16)"].token_state_share)
    # less waste, more requests at once
    assert res["paged (block 16)"].mean_running > 2 * res["Orca (Max)"].mean_running


def test_driver_reproduces_the_engine_step_for_step():
    """The paged numbers are the engine's: the same usage after every step, preemptions included."""
    from minipaged import LLM, SamplingParams
    from minipaged.lessons.bench import make_workload
    wl = make_workload("alpaca", 512, 10, seed=1, bos=1, max_model_len=128)
    wl.max_tokens = [min(m, 40) for m in wl.max_tokens]
    llm = LLM("stories260K", num_blocks=16, block_size=8, max_model_len=128,
              max_num_batched_tokens=32, record_block_tables=True)
    llm.generate(wl.prompts, [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0)
                              for m in wl.max_tokens], use_tqdm=False)
    engine_usage = [r.usage for r in llm.trace]
    driver_usage = [u for _, u in paged_step_usages(wl, 16, 8, max_model_len=128,
                                                      max_num_batched_tokens=32)]
    assert sum(len(r.preempted) for r in llm.trace) > 0  # the interesting case
    assert driver_usage == engine_usage
    assert waste_from_trace(llm.trace).token_state_share == pytest.approx(
        simulate_paged(wl, 16, 8, max_model_len=128, max_num_batched_tokens=32).token_state_share)
