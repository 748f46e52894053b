"""Preemption by recompute and by swap (`preemption_mode`, lesson 06), with sequence groups.

* A swap round trip is bit-exact: blocks copied to the CPU pool and back hold the same K/V, and
  blocks shared inside a group stay shared (one CPU block, then one GPU block).
* Greedy outputs are the same with no memory pressure, under recompute and under swap, also for
  n > 1 samples and beam searches; the trace says what each mode cost.
* A property test drives the real engine with random mixes of plain, n-sample and beam-search
  requests, random aborts, small caches and both modes, checking the block manager's
  invariants after every step and that every block comes back.
"""
import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from minipaged import LLM, BeamSearchParams, EngineConfig, SamplingParams
from minipaged.engine.block_usage import check_invariants
from minipaged.swap.block_manager import SwapBlockManager
from minipaged.worker.kv_cache import copy_blocks
from minipaged.worker.swap import allocate_cpu_cache, swap_in_blocks, swap_out_blocks
from minipaged.engine.sequence import Sequence
from minipaged.groups.group import SequenceGroup


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_swap_round_trip_is_bit_exact_and_keeps_sharing(head_major):
    """Also with the head-major cache the GPU engine allocates (a transposed view)."""
    bs, nb = 4, 16
    bm = SwapBlockManager(nb, bs, enable_prefix_caching=False, num_cpu_blocks=12)
    kv = torch.randn(3, 2, nb, bs, 2, 5, dtype=torch.float64)
    if head_major:
        kv = torch.empty(3, 2, nb, 2, bs, 5, dtype=torch.float64).transpose(3, 4).copy_(kv)
        assert kv.stride()[3:] == (5, bs * 5, 1)
    cpu = allocate_cpu_cache(kv, 12)
    assert cpu.shape == (12, 3, 2, bs, 2, 5)  # block-major: a run of CPU blocks is contiguous
    other = Sequence("o", list(range(6)), SamplingParams())
    bm.allocate(other, [], 6)  # takes blocks 0, 1: the group's blocks are not 0..n
    parent = Sequence("p", list(range(10)), SamplingParams())
    parent.group = SequenceGroup("p", 2, [parent])
    bm.allocate(parent, [], 10)
    parent.num_computed_tokens = 10
    child = parent.fork(1)
    bm.fork(parent, child)
    child.append_token(7)
    copies = bm.append_slots(child, 1)  # copy-on-write of the shared last block
    copy_blocks(kv, copies)

    def gather(seq):
        return kv[:, :, bm.block_tables[seq.seq_id]].clone()

    before = {s.seq_id: gather(s) for s in (parent, child)}
    shared = set(bm.block_tables[parent.seq_id]) & set(bm.block_tables[child.seq_id])
    assert len(shared) == 2
    assert bm.can_swap_out([parent, child])
    out = bm.swap_out([parent, child])
    assert len(out) == 4  # 2 shared + 2 private blocks, each copied once
    swap_out_blocks(kv, cpu, out)
    cpu_tables = [bm.cpu_block_tables[s.seq_id] for s in (parent, child)]
    assert cpu_tables[0][:2] == cpu_tables[1][:2]
    assert bm.cpu_allocator.blocks[cpu_tables[0][0]].ref_count == 2
    check_invariants(bm, [other.seq_id])
    kv[:, :, 2:] = float("nan")  # the freed GPU blocks get overwritten
    assert bm.num_swap_in_blocks([parent, child]) == 4
    back = bm.swap_in([parent, child])
    swap_in_blocks(cpu, kv, back)
    for s in (parent, child):
        assert torch.equal(gather(s), before[s.seq_id])
    assert bm.block_tables[parent.seq_id][:2] == bm.block_tables[child.seq_id][:2]
    assert bm.allocator.blocks[bm.block_tables[parent.seq_id][0]].ref_count == 2
    check_invariants(bm, [other.seq_id, parent.seq_id, child.seq_id])
    assert bm.cpu_allocator.num_free_blocks == 12
    for s in (parent, child, other):
        bm.free(s)
    assert bm.num_free_blocks == nb


def test_preemption_mode_config():
    with pytest.raises(ValueError, match="'recompute'.*'swap'"):
        EngineConfig(preemption_mode="drop").validate()
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(preemption_mode="swap", swap_space=-1).validate()
    llm = LLM("stories260K", block_size=8, num_blocks=64, preemption_mode="swap",
              swap_space=1280 * 8 * 10 / 1024 ** 3)
    assert llm.engine.block_manager.cpu_allocator.num_blocks == 10
    assert llm.engine.cpu_cache.shape == (10, 5, 2, 8, 4, 8)
    assert LLM("stories260K", block_size=8, num_blocks=64).engine.cpu_cache is None


def pressure_prompts(n=16, seed=7):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(20, 50))] for _ in range(n)]


def run_modes(prompts, params, **kw):
    """Outputs and traces with no memory pressure, recompute, swap and swap with a tiny pool."""
    configs = {"none": dict(num_blocks=1024), "recompute": dict(num_blocks=28),
               "swap": dict(num_blocks=28, preemption_mode="swap"),
               "swap, small pool": dict(num_blocks=28, preemption_mode="swap", num_cpu_blocks=8)}
    results = {}
    for name, cfg in configs.items():
        llm = LLM("stories260K", block_size=8, max_model_len=128, max_num_batched_tokens=64,
                  enable_prefix_caching=False, **cfg, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = ([[c.token_ids for c in o.outputs] for o in outs], llm.trace)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not getattr(bm, "cpu_block_tables", {})
        check_invariants(bm, [])
    return results


def test_greedy_outputs_identical_in_all_three_modes():
    res = run_modes(pressure_prompts(), SamplingParams(temperature=0, max_tokens=30,
                                                       ignore_eos=True))
    ref = res["none"][0]
    for name, (outs, trace) in res.items():
        assert outs == ref, name
    rec, swap, small = (res[k][1] for k in ("recompute", "swap", "swap, small pool"))
    assert sum(len(r.preempted) for r in rec) > 0
    assert sum(r.num_recomputed_tokens for r in rec) > 0
    assert sum(r.num_swapped_bytes for r in rec) == 0
    assert sum(len(r.swapped_out) for r in swap) > 0 and sum(r.num_swapped_bytes for r in swap) > 0
    assert sum(r.num_recomputed_tokens for r in swap) == 0  # the pool holds every victim
    assert all(set(r.swapped_out) <= set(r.preempted) for r in swap)
    # a pool of 8 blocks cannot take every victim: some fall back to recompute
    assert sum(len(r.swapped_out) for r in small) > 0
    assert sum(r.num_recomputed_tokens for r in small) > 0
    # bytes: whole blocks, every layer, K and V (1280 bytes per token x 8 tokens per block)
    assert all(r.num_swapped_bytes % (1280 * 8) == 0 for r in swap)


def test_samples_and_beams_survive_preemption_in_all_modes():
    prompts = pressure_prompts(8, seed=3)
    res = run_modes(prompts, SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24,
                                            ignore_eos=True))
    for name, (outs, _) in res.items():
        assert outs == res["none"][0], name
    # beams: gang-preempted, swapped or readmitted together
    beam = {}
    for name, kw in [("none", dict(num_blocks=1024)), ("recompute", dict(num_blocks=24)),
                     ("swap", dict(num_blocks=24, preemption_mode="swap"))]:
        llm = LLM("stories260K", block_size=8, max_model_len=128, max_num_batched_tokens=48, **kw)
        outs = llm.beam_search([{"prompt_token_ids": p[:24]} for p in prompts[:4]],
                               BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True))
        beam[name] = [[s.tokens for s in o.sequences] for o in outs]
        if name != "none":
            assert sum(len(r.preempted) for r in llm.trace) > 0, name
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert beam["recompute"] == beam["none"] and beam["swap"] == beam["none"]


# --- property test: the real engine, random workloads --------------------------------------
@st.composite
def workloads(draw):
    reqs = []
    rng = random.Random(draw(st.integers(0, 2 ** 16)))  # token ids; lengths are drawn below
    for _ in range(draw(st.integers(3, 10))):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(draw(st.integers(4, 20)))]
        max_tokens = draw(st.integers(6, 16))
        kind = draw(st.sampled_from(["plain", "n", "beam"]))
        if kind == "plain":
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        elif kind == "n":
            p = SamplingParams(n=draw(st.integers(2, 3)), temperature=1.0, seed=1,
                               max_tokens=max_tokens, ignore_eos=True)
        else:
            p = BeamSearchParams(beam_width=draw(st.integers(1, 3)), max_tokens=max_tokens,
                                 ignore_eos=True,
                                 early_stopping=draw(st.sampled_from([False, True])))
        reqs.append((prompt, p))
    return dict(reqs=reqs, mode=draw(st.sampled_from(["recompute", "swap"])),
                block_size=draw(st.sampled_from([2, 4])), extra_blocks=draw(st.integers(0, 4)),
                num_cpu_blocks=draw(st.sampled_from([None, 3])),
                prefix_caching=draw(st.booleans()), budget=draw(st.sampled_from([8, 16, 64])),
                abort_at=draw(st.lists(st.integers(0, 40), max_size=2)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_books(w):
    bs = w["block_size"]
    # the smallest cache that holds a 3-beam search of max_model_len = 32 tokens, plus a few
    llm = LLM("stories260K", block_size=bs, num_blocks=3 * 32 // bs + w["extra_blocks"],
              max_model_len=32, max_num_seqs=8, max_num_batched_tokens=w["budget"],
              preemption_mode=w["mode"], num_cpu_blocks=w["num_cpu_blocks"],
              enable_prefix_caching=w["prefix_caching"])
    eng, bm = llm.engine, llm.engine.block_manager
    for i, (prompt, p) in enumerate(w["reqs"]):
        eng.add_request(str(i), prompt, p)
    done, step = {}, 0
    while eng.has_unfinished_requests():
        if step in w["abort_at"] and eng.requests:
            eng.abort_request(sorted(eng.requests)[0])
        for out in eng.step():
            assert out.finished and out.request_id not in done
            done[out.request_id] = out
        step += 1
        assert step < 2000, "no progress"
        check_invariants(bm, [s.seq_id for s in eng.scheduler.running])
        assert len(eng.scheduler.running) + eng.scheduler.num_reserved_seats <= 8
    trace = llm.trace
    event(f"{w['mode']}: " + ("swapped" if any(r.swapped_out for r in trace) else "no swap"))
    event("recomputed" if any(r.num_recomputed_tokens for r in trace) else "no recompute")
    event("copy-on-write" if any(r.num_cow_copies for r in trace) else "no copy-on-write")
    assert bm.num_free_blocks == bm.num_blocks and not bm.block_tables
    assert not getattr(bm, "cpu_block_tables", {})  # (swap's CPU pool)
    if getattr(bm, "cpu_allocator", None) is not None:
        assert bm.cpu_allocator.num_free_blocks == bm.cpu_allocator.num_blocks
    assert eng.scheduler.num_reserved_seats == 0 and not eng.groups and not eng.requests
    for i, (prompt, p) in enumerate(w["reqs"]):
        out = done.get(str(i))
        if out is None:
            continue  # aborted
        if isinstance(p, BeamSearchParams):
            assert 1 <= len(out.outputs) <= p.beam_width
        else:
            assert [c.index for c in out.outputs] == list(range(p.n))
            assert all(len(c.token_ids) == min(p.max_tokens, 32 - len(prompt))
                       for c in out.outputs)
