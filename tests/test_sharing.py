"""Parallel sampling (`SamplingParams(n=...)`) and prefix-cache statistics (lesson 06).

The prompt of an n-sample request is prefilled once; when it samples its first token the engine
forks it into n sequences that share every block (`BlockManager.fork`), and the first write into
the shared, partly filled last block copies it (copy-on-write). These tests check the block
tables step by step, that each sample is the request it would be alone (seed + index), the
request-level reporting, aborts, and the trace's sharing and prefix-cache numbers. Then the
prefix cache's same-step hits (a block is published when its slots are allocated, vLLM V1):
requests of one prompt arriving together prefill its full blocks once, a chunk publishes only
the blocks it covers, and a forward that raises leaves no block published.
"""
import pytest

from minipaged import LLM, RequestError, SamplingParams
from minipaged.engine.block_usage import check_invariants
from minipaged.engine.sequence import SequenceStatus
from minipaged.lessons.timeline import tokens_in_cache

PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]  # 10 tokens: 2 full blocks of 4 + 2


@pytest.fixture(scope="module")
def llm():
    return LLM("stories260K", block_size=4, num_blocks=128, enable_prefix_caching=False)


def refs(bm, block):
    return bm.allocator.blocks[block].ref_count


def test_prompt_prefilled_once_then_forked_with_copy_on_write(llm):
    eng, bm = llm.engine, llm.engine.block_manager
    n = 3
    eng.add_request("p", PROMPT, SamplingParams(n=n, temperature=1.0, max_tokens=6, seed=1,
                                                ignore_eos=True))
    eng.step()  # prefill + fork: n sequences, one block table
    rec = eng.trace[-1]
    assert rec.num_prefill_tokens == len(PROMPT)  # the prompt once, not n times
    group = eng.groups["p"]
    assert [s.index for s in group.seqs] == [0, 1, 2] and group.forked
    tables = [bm.block_tables[s.seq_id] for s in group.seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert all(refs(bm, b) == n for b in tables[0])
    assert rec.num_blocks_saved_by_sharing == (n - 1) * 3
    check_invariants(bm, [s.seq_id for s in eng.scheduler.running])

    eng.step()  # each sample writes its first token into the shared last block
    rec = eng.trace[-1]
    assert rec.num_cow_copies == n - 1  # the last writer finds ref count 1 and writes in place
    tables = [bm.block_tables[s.seq_id] for s in group.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full prompt blocks stay shared
    assert len({t[2] for t in tables}) == n  # the partial block is now private to each
    assert all(refs(bm, b) == n for b in tables[0][:2])
    assert rec.num_blocks_saved_by_sharing == (n - 1) * 2
    check_invariants(bm, [s.seq_id for s in eng.scheduler.running])
    while eng.has_unfinished_requests():
        eng.step()
    assert bm.num_free_blocks == bm.num_blocks and not eng.groups
    check_invariants(bm, [])


def test_each_sample_is_the_request_it_would_be_alone(llm):
    """Sample i draws from seed + i; its K/V come through fork + copy-on-write, so its tokens
    must equal a single request with that seed."""
    sp = dict(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    out = llm.generate([PROMPT], SamplingParams(n=4, seed=10, **sp), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    alone = llm.generate([PROMPT] * 4, [SamplingParams(seed=10 + i, **sp) for i in range(4)],
                         use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([PROMPT], SamplingParams(n=4, seed=10, **sp), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_greedy_samples_equal_greedy(llm):
    sp = dict(temperature=0.0, max_tokens=12, logprobs=1)
    single = llm.generate("Once upon a time", SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    outs = llm.generate("Once upon a time", SamplingParams(n=3, **sp), use_tqdm=False)[0].outputs
    for c in outs:
        assert c.token_ids == single.token_ids and c.text == single.text
        # the n = 3 step runs 3 logits rows through one matmul, the single request 1: the same
        # math in another blocking, so the float32 sums agree to rounding, not bit for bit
        assert c.cumulative_logprob == pytest.approx(single.cumulative_logprob, rel=1e-5)


def test_request_reported_once_when_all_samples_finished(llm):
    eng = llm.engine
    # "." (426) ends some samples early; the request waits for the slowest one.
    eng.add_request("r", "Once upon a time", SamplingParams(n=4, temperature=1.0, seed=3,
                                                            max_tokens=30, stop_token_ids=[426]))
    reports = []
    while eng.has_unfinished_requests():
        reports += eng.step()
    assert len(reports) == 1 and reports[0].finished
    outs = reports[0].outputs
    assert len(outs) == 4 and all(c.finish_reason in ("stop", "length") for c in outs)
    assert len({len(c.token_ids) for c in outs}) > 1, "samples of different lengths expected"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_streaming_reports_every_sample(llm):
    eng = llm.engine
    eng.stream_outputs = True
    try:
        eng.add_request("s", PROMPT, SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=5,
                                                    ignore_eos=True))
        reports = []
        while eng.has_unfinished_requests():
            reports += eng.step()
    finally:
        eng.stream_outputs = False
    assert len(reports) == 5 and [r.finished for r in reports] == [False] * 4 + [True]
    for k, r in enumerate(reports):
        assert [len(c.token_ids) for c in r.outputs] == [k + 1, k + 1]


def test_abort_frees_every_sample():
    llm = LLM("stories260K", block_size=4, num_blocks=64, max_model_len=128,
              enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(n=4, max_tokens=40, ignore_eos=True))
    eng.add_request("b", PROMPT[:5], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    seqs = list(eng.groups["a"].seqs)
    eng.abort_request("a")
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in seqs)
    assert eng.scheduler.num_reserved_seats == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == 64 and not eng.groups
    check_invariants(eng.block_manager, [])
    # aborted before its prompt was even scheduled: the reserved seats go back too
    eng.add_request("c", PROMPT, SamplingParams(n=4, max_tokens=4))
    eng.abort_request("c")
    assert not eng.has_unfinished_requests() and eng.scheduler.num_reserved_seats == 0


def test_prompt_reserves_a_seat_per_sample():
    llm = LLM("stories260K", block_size=4, num_blocks=64, max_model_len=128, max_num_seqs=4)
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    eng.add_request("b", PROMPT[:4], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    eng.step()
    assert [e.request_id for e in eng.trace[-1].scheduled] == ["a"]  # b would need 5 seats
    assert len(eng.scheduler.running) == 3 and eng.scheduler.num_reserved_seats == 0
    with pytest.raises(RequestError, match="max_num_seqs=4"):
        eng.add_request("c", PROMPT, SamplingParams(n=5))
    while eng.has_unfinished_requests():
        eng.step()
        assert len(eng.scheduler.running) + eng.scheduler.num_reserved_seats <= 4


def test_trace_names_samples_and_draws_their_tables():
    from minipaged.lessons import viz
    llm = LLM("stories260K", block_size=4, num_blocks=64, max_model_len=128,
              record_block_tables=True)
    llm.generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=3,
                                          ignore_eos=True), use_tqdm=False)
    rid = llm.trace[0].scheduled[0].request_id
    assert set(llm.trace[0].block_tables) == {f"{rid}/0", f"{rid}/1"}
    assert tokens_in_cache(llm.trace, 1) == {f"{rid}/0": 11, f"{rid}/1": 11}
    view = viz.view_from_trace(llm.trace, 0)
    assert view.shared_blocks == set(llm.trace[0].block_tables[f"{rid}/0"])


def test_prefix_cache_statistics_for_a_shared_system_prompt():
    system = [1] + [300 + i for i in range(39)]  # 40 tokens = 5 blocks of 8
    questions = [[400 + i, 401 + i, 402] for i in range(6)]
    llm = LLM("stories260K", block_size=8, num_blocks=128, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([system + questions[0]], sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and first.metrics["prefix_cache_hit_rate"] == 0.0
    start = len(llm.trace)
    rest = llm.generate([system + q for q in questions[1:]], sp, use_tqdm=False)
    for o in rest:
        assert o.num_cached_tokens == 40 and o.metrics["num_cached_blocks"] == 5
        assert o.metrics["prefix_cache_hit_rate"] == pytest.approx(40 / 43)
    admit = llm.trace[start]
    assert admit.num_prefix_hit_tokens == 5 * 40 and admit.num_prefix_query_tokens == 5 * 43
    assert admit.prefix_cache_hit_rate == pytest.approx(40 / 43)
    assert [e.num_cached_tokens for e in admit.scheduled] == [40] * 5
    assert admit.num_blocks_saved_by_sharing == 4 * 5  # five tables, one copy of the prompt


def test_n_samples_fork_against_n_requests_through_the_prefix_cache():
    """Lesson 06's comparison: vLLM V1 has no fork; it turns n > 1 into n requests that share
    the prompt's full blocks through the prefix cache. The same samples either way; the fork
    prefills the prompt once; n requests compute each tail again, whether they arrive together
    (the later ones hit the first one's blocks in the same step: a block is published when its
    slots are allocated, as in V1) or a step apart (one step more)."""
    from minipaged.lessons.sharing import n_samples_two_ways
    prompt = list(range(3, 3 + 13))  # 13 tokens: 3 full blocks of 4, then 1
    n, bs = 3, 4
    fork, together, ahead = n_samples_two_ways(prompt, n=n, max_tokens=6, block_size=bs)
    assert fork.outputs == together.outputs == ahead.outputs
    assert len(fork.outputs) == n and all(len(o) == 6 for o in fork.outputs)
    assert fork.prefill_tokens == len(prompt) and fork.cow_copies == n - 1
    full = len(prompt) // bs * bs
    for way in (together, ahead):
        assert way.prefix_hit_tokens == (n - 1) * full and way.cow_copies == 0
        assert way.prefill_tokens == len(prompt) + (n - 1) * (len(prompt) - full)
    assert together.steps == ahead.steps - 1 == fork.steps


# --- same-step prefix hits (vLLM V1 publishes a block when its slots are allocated) ----------
STORY = [1] + [(37 * i) % 500 + 3 for i in range(63)]  # 64 tokens: 4 full blocks of 16


@pytest.fixture(scope="module")
def stories_hf():
    from minipaged.lessons.baseline import load_hf_model
    from minipaged.models.loader import resolve_builtin
    return load_hf_model(str(resolve_builtin("stories260K")))


def _greedy(n=8):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_requests_arriving_together_prefill_the_shared_prompt_once(stories_hf, backend):
    """4 requests of one 64-token prompt admitted in one step: the first computes the 4 blocks,
    the other three hit its first 3 (published as their slots were allocated, filled by the same
    forward before any attention reads them) and compute only the last block (its last token
    must be computed to sample). The tokens equal each request alone and HF."""
    n = 8
    if backend == "triton":  # the kernels, under the interpreter on a CPU (tests/conftest.py)
        pytest.importorskip("triton")
        n = 2
    from tests.helpers import hf_greedy
    llm = LLM("stories260K", block_size=16, enable_prefix_caching=True,
              attention_backend=backend)
    outs = llm.generate([STORY] * 4, _greedy(n), use_tqdm=False)
    first = llm.trace[0]
    assert [e.num_cached_tokens for e in first.scheduled] == [0, 48, 48, 48]
    assert first.num_prefix_hit_tokens == 3 * 48
    prefill = sum(r.num_prefill_tokens for r in llm.trace)
    assert prefill == 64 + 3 * 16  # without same-step hits: 4 * 64
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48, 48]
    alone = LLM("stories260K", block_size=16, enable_prefix_caching=False,
                attention_backend=backend)
    one_at_a_time = alone.generate([STORY], _greedy(n), use_tqdm=False)[0].outputs[0].token_ids
    expected = hf_greedy(stories_hf, [STORY], n)[0]
    assert one_at_a_time == expected
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 4


def test_a_chunk_publishes_only_the_blocks_it_covers():
    """A budget of 24 splits the first prompt: step 1 fills 1 full block and half of the next,
    so the second request (admitted in the same step, budget left 0: it waits) and later ones
    find only what each step's chunks complete."""
    llm = LLM("stories260K", block_size=16, enable_prefix_caching=True,
              max_num_batched_tokens=24)
    eng = llm.engine
    eng.add_request("a", STORY, _greedy(2))
    eng.add_request("b", STORY, _greedy(2))
    eng.step()  # a: tokens 0..23, one full block
    bm = eng.block_manager
    assert bm.get_computed_blocks(eng.requests["b"])[1] == 16
    eng.step()  # a: 24..47 (blocks 1, 2 full); b admitted with 0 budget left: waits
    assert [e.request_id for e in eng.trace[-1].scheduled] == ["a"]
    eng.step()  # a: 48..63 (16 tokens), b: hits 3 blocks (48), computes 8 of its 16
    last = eng.trace[-1]
    assert [(e.request_id, e.num_prefill_tokens, e.num_cached_tokens) for e in last.scheduled] == [
        ("a", 16, 0), ("b", 8, 48)]
    while eng.has_unfinished_requests():
        eng.step()


def test_a_forward_that_raises_leaves_nothing_published(monkeypatch):
    """Blocks published at allocation for a step whose forward raised never got their K/V:
    after `generate` aborted its requests, the prompt must miss (and decode right)."""
    llm = LLM("stories260K", block_size=16, enable_prefix_caching=True)
    ref = llm.generate([STORY], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("stories260K", block_size=16, enable_prefix_caching=True)
    runner = llm.engine.model_runner

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(runner, "execute", broken)
    with pytest.raises(RuntimeError, match="the device is gone"):
        llm.generate([STORY] * 2, _greedy(), use_tqdm=False)
    monkeypatch.undo()
    bm = llm.engine.block_manager
    assert bm.allocator.hash_to_block == {} and bm.allocator.num_cached_free == 0
    out = llm.generate([STORY], _greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == ref


def test_the_step_after_a_raising_forward_recomputes_the_hits(monkeypatch):
    """The engine keeps stepping after a forward raised (no abort): the second request had hit
    blocks the failed step was to compute; the next pass cuts its table back before them, so it
    prefills the whole prompt itself. Both end with the right tokens."""
    llm = LLM("stories260K", block_size=16, enable_prefix_caching=True)
    ref = llm.generate([STORY], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM("stories260K", block_size=16, enable_prefix_caching=True)
    eng = llm.engine
    real = eng.model_runner.execute
    calls = []

    def once_broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a transient fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.model_runner, "execute", once_broken)
    eng.add_request("a", STORY, _greedy())
    eng.add_request("b", STORY, _greedy())
    with pytest.raises(RuntimeError, match="transient"):
        eng.step()
    b = eng.requests["b"]
    assert b.num_computed_tokens == 48  # its hit on blocks the failed step never filled
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o.outputs[0].token_ids
    retry = eng.trace[0]
    assert [(e.request_id, e.num_prefill_tokens, e.num_computed_before)
            for e in retry.scheduled] == [("a", 64, 0), ("b", 64, 0)]
    assert done == {"a": ref, "b": ref}
    check_invariants(eng.block_manager, [])
