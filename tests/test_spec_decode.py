"""Speculative decoding in the engine (minipaged/spec_decode/, lesson 10).

Greedy with speculation == greedy without it == HF generate, token for token, on stories260K:
n-gram k = 1..5, a draft model (stories260K itself: everything accepted; a random tiny Llama
with its vocabulary: almost nothing accepted), under preemption and chunked prefill, in mixed
batches where only some requests speculate. Then seeded sampling, the guards, stops and
max_tokens, the statistics, and a hypothesis machine over propose / accept / rollback on the
block manager.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minipaged import LLM, BeamSearchParams, EngineConfig, SamplingParams
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.block_usage import check_invariants
from minipaged.engine.processor import RequestError
from minipaged.engine.sequence import Sequence
from minipaged.lessons.baseline import load_hf_model
from minipaged.models.loader import resolve_builtin
from tests.helpers import IGNORE_INTERPRETER_WARNINGS, hf_greedy, make_tiny_hf_model


def ngram(k, **kw):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, **kw}


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def stories_hf():
    return load_hf_model(str(resolve_builtin("stories260K")))


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A random 1-layer Llama with stories260K's vocabulary (512) and context (512)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("draft") / "tiny"
    LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    return str(path)


def prompts_of(n, seed, lo=4, hi=40):
    """Half random, half repetitive (a phrase said twice): prompt lookup finds the second half."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))]
        out.append([1] + (body[:len(body) // 2] * 2 if i % 2 else body))
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_ngram_greedy_equals_hf_for_k_1_to_5(stories_hf):
    prompts = prompts_of(8, 0)
    lengths = [random.Random(i).randint(10, 40) for i in range(len(prompts))]
    expected = hf_greedy(stories_hf, prompts, lengths)
    for k in range(1, 6):
        llm = LLM("stories260K", block_size=8, speculative_config=ngram(k))
        outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
        assert tokens(outs) == expected, f"k={k}"
        stats = llm.engine.step_loop.stats
        assert stats.num_accepted_tokens > 0 and len(stats.num_accepted_tokens_per_pos) == k
        per_request = sum(o.metrics["spec_num_accepted_tokens"] for o in outs)
        assert per_request == stats.num_accepted_tokens
        # Every emitted token is a verified one: fewer steps than tokens once proposals land.
        assert len(llm.trace) < max(lengths) + 1
        check_invariants(llm.engine.block_manager, [])
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_draft_model_greedy_parity(stories_hf, tiny_draft):
    prompts = prompts_of(6, 1)
    expected = hf_greedy(stories_hf, prompts, 30)
    same = LLM("stories260K", block_size=8, speculative_config={
        "method": "draft_model", "model": "stories260K", "num_speculative_tokens": 3})
    assert tokens(same.generate(prompts, greedy(30), use_tqdm=False)) == expected
    stats = same.engine.step_loop.stats  # the target as its own draft: all accepted
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    tiny = LLM("stories260K", block_size=8, speculative_config={
        "method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 4})
    assert tokens(tiny.generate(prompts, greedy(30), use_tqdm=False)) == expected
    stats = tiny.engine.step_loop.stats  # random weights: proposals mostly rejected
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.5
    assert tiny.engine.step_loop.proposer.kv_cache.shape[2] == tiny.engine.num_blocks


@pytest.mark.parametrize("spec, mode", [
    (ngram(4), "recompute"), (ngram(2), "swap"),
    ({"method": "draft_model", "model": "stories260K", "num_speculative_tokens": 2}, "recompute")])
def test_speculation_under_preemption_and_chunked_prefill(stories_hf, spec, mode):
    """24 blocks x 8 slots for 16 sequences force preemptions; a budget of 32 tokens splits
    prompts into chunks and cuts proposals where the budget ends."""
    prompts = prompts_of(16, 2, 20, 50)
    llm = LLM("stories260K", block_size=8, num_blocks=24, max_model_len=128,
              max_num_batched_tokens=32, speculative_config=spec, preemption_mode=mode)
    outs = llm.generate(prompts, greedy(30), use_tqdm=False)
    assert tokens(outs) == hf_greedy(stories_hf, prompts, 30)
    trace = llm.trace
    assert sum(len(r.preempted) for r in trace) > 0
    assert (mode == "swap") == any(r.swapped_out for r in trace)
    assert any(r.num_recomputed_tokens for r in trace) == (mode == "recompute")
    for r in trace:  # prefill work a preemption caused, never the verify rows' rollback
        assert 0 <= r.num_recomputed_tokens <= r.num_prefill_tokens
    assert all(r.num_batched_tokens <= 32 for r in trace)
    assert any(r.num_prefill_tokens and any(r.num_draft_tokens_per_pos) for r in trace)
    assert llm.engine.step_loop.stats.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("budget, spec", [
    (2, ngram(4)), (6, ngram(4)), (7, ngram(4)),
    (6, {"method": "draft_model", "model": "stories260K", "num_speculative_tokens": 4})])
def test_tiny_token_budgets_cut_proposals(stories_hf, budget, spec):
    """A budget smaller than 1 + k: the proposals are cut to what is left, down to none (the
    sequence then decodes its one token and still samples)."""
    prompts = [[1] + [300, 301, 302, 303] * 3, [1] + [310, 311, 312] * 4, [1, 5, 6, 7, 5, 6]]
    llm = LLM("stories260K", block_size=8, max_num_batched_tokens=budget,
              speculative_config=spec)
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert tokens(outs) == hf_greedy(stories_hf, prompts, 20)
    assert all(r.num_batched_tokens <= budget for r in llm.trace)


def test_gpu_ordered_inputs_verify_the_same(stories_hf):
    """The GPU runner's inputs (decodes first, longest context first, packed) on the CPU: the
    verify rows' k + 1 logits still come back in step order."""
    from minipaged.worker.gpu_model_runner import GPUModelRunner
    prompts = prompts_of(8, 9)
    llm = LLM("stories260K", block_size=8, max_num_batched_tokens=40,
              speculative_config=ngram(4))
    eng = llm.engine
    eng.model_runner = GPUModelRunner(eng.model, eng.kv_cache, eng.backend, 8, max_num_seqs=256,
                                      max_model_len=512, cuda_graphs=False)
    outs = llm.generate(prompts, greedy(30), use_tqdm=False)
    assert tokens(outs) == hf_greedy(stories_hf, prompts, 30)
    assert eng.step_loop.stats.num_accepted_tokens > 0


@IGNORE_INTERPRETER_WARNINGS
def test_verify_graph_buffers_front_padded_equal_hf(stories_hf):
    """spec_decode/cuda_graphs.py's padded static step (queries of 2..k + 1 tokens padded at
    the front to k + 1, a short prompt included), run eagerly through the Triton kernels (the
    interpreter on the CPU): the tokens HF gives. The GPU test replays the captured graphs."""
    import os
    from minipaged.worker.gpu_model_runner import GPUModelRunner
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    prompts = [[1] + [400, 401, 402, 403] * 3, [1, 300, 301]]
    lengths = [10, 4]
    llm = LLM("stories260K", device=device, block_size=8, num_blocks=64, max_model_len=64,
              max_num_seqs=4, attention_backend="triton", enforce_eager=True,
              speculative_config={"method": "draft_model", "model": "stories260K",
                                  "num_speculative_tokens": 3})
    eng = llm.engine
    if not isinstance(eng.model_runner, GPUModelRunner):
        eng.model_runner = GPUModelRunner(eng.model, eng.kv_cache, eng.backend, 8, max_num_seqs=4,
                                          max_model_len=64, cuda_graphs=False)
    eng.step_loop.install_verify_graphs(eng, capture=False)
    graphs = eng.model_runner.cuda_graphs.get("verify")
    ran = []
    run = graphs.run
    graphs.run = lambda *a: ran.append(list(a[2].query_lens)) or run(*a)
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert tokens(outs) == hf_greedy(stories_hf, prompts, lengths)
    assert len(ran) >= 2, ran  # verify steps went through the padded buffers ...
    assert any(q != [4] * len(q) for q in ran), ran  # ... some with padded rows
    assert any(q == [4] * len(q) for q in ran), ran  # ... some with every query full


def test_mixed_batch_some_requests_do_not_speculate(stories_hf):
    """Requests with logprobs or a repetition penalty decode one token at a time beside the
    speculating ones, through the ordinary sampler."""
    prompts = prompts_of(6, 3)
    params = [greedy(25, logprobs=2) if i % 3 == 0 else greedy(25) for i in range(6)]
    llm = LLM("stories260K", block_size=8, speculative_config=ngram(3))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == hf_greedy(stories_hf, prompts, 25)
    for o, p in zip(outs, params):
        if p.logprobs is not None:
            assert o.metrics["spec_num_draft_tokens"] == 0 and len(o.outputs[0].logprobs) == 25
    steps = [r for r in llm.trace if any(r.num_draft_tokens_per_pos)]
    assert any(len(r.scheduled) > 1 and any(e.num_decode_tokens == 1 for e in r.scheduled)
               for r in steps)


def test_prefix_cache_never_holds_a_rejected_token():
    """Every published block's tokens are the tokens of the sequence that wrote it."""
    prompts = prompts_of(6, 4)
    llm = LLM("stories260K", block_size=4, speculative_config=ngram(4))
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    bm = llm.engine.block_manager
    published = {b.token_ids for b in bm.allocator.blocks if b.block_hash is not None}
    written = set()
    for o in outs:
        ids = o.prompt_token_ids + o.outputs[0].token_ids
        written |= {tuple(ids[i:i + 4]) for i in range(0, len(ids) - 3, 4)}
    assert published and published <= written
    again = llm.generate([o.prompt_token_ids + o.outputs[0].token_ids[:20] for o in outs],
                         greedy(10), use_tqdm=False)  # prefix hits on blocks written by spec
    base = LLM("stories260K", block_size=4, enable_prefix_caching=False)
    assert tokens(again) == tokens(base.generate([o.prompt_token_ids for o in again],
                                                 greedy(10), use_tqdm=False))
    assert sum(o.num_cached_tokens for o in again) > 0


def test_rollback_gives_rejected_slots_blocks_back():
    """After every step, a running sequence holds blocks for its computed tokens only: those
    reserved for proposals the target rejected went back to the free queue."""
    llm = LLM("stories260K", block_size=2, speculative_config=ngram(5))
    eng = llm.engine
    for i, p in enumerate(prompts_of(4, 8)):
        eng.add_request(str(i), p, greedy(30))
    rejected = 0
    while eng.has_unfinished_requests():
        eng.step()
        record = llm.trace[-1]
        rejected += sum(record.num_draft_tokens_per_pos) - sum(record.num_accepted_tokens_per_pos)
        for seq in eng.scheduler.running:
            table = eng.block_manager.block_tables[seq.seq_id]
            assert len(table) == -(-seq.num_computed_tokens // 2)
        check_invariants(eng.block_manager, [s.seq_id for s in eng.scheduler.running])
    assert rejected > 10


def test_streaming_reports_each_request_once_per_step():
    llm = LLM("stories260K", block_size=8, speculative_config=ngram(4))
    eng = llm.engine
    eng.stream_outputs = True
    prompts = prompts_of(4, 10)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy(30))
    seen: dict[str, list[int]] = {}
    grew = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        ids = [o.request_id for o in outs]
        assert len(ids) == len(set(ids))
        for o in outs:
            new = o.outputs[0].token_ids
            grew = max(grew, len(new) - len(seen.get(o.request_id, [])))
            assert new[:len(seen.get(o.request_id, []))] == seen.get(o.request_id, [])
            seen[o.request_id] = new
    base = LLM("stories260K", block_size=8).generate(prompts, greedy(30), use_tqdm=False)
    assert [seen[str(i)] for i in range(4)] == tokens(base)
    assert grew > 1  # a step that emitted several tokens for one request


def test_seeded_sampling_is_reproducible():
    prompts = prompts_of(4, 5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=30,
                             ignore_eos=True) for i in range(4)]
    runs = []
    for batch in (prompts, prompts[:1]):  # alone or in a batch: a seeded row draws the same
        llm = LLM("stories260K", block_size=8, speculative_config=ngram(3))
        runs.append(tokens(llm.generate(batch, params[:len(batch)], use_tqdm=False)))
    assert runs[0][0] == runs[1][0]
    llm = LLM("stories260K", block_size=8, speculative_config=ngram(3))
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == runs[0]
    other = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=30, ignore_eos=True)
             for i in range(4)]
    assert tokens(llm.generate(prompts, other, use_tqdm=False)) != runs[0]


# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def chi2_homogeneity(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories both samples show, and its df."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb))
    stat = 0.0
    for c in cats:
        total = ca[c] + cb[c]
        for counts, n in ((ca, len(a)), (cb, len(b))):
            expected = total * n / (len(a) + len(b))
            stat += (counts[c] - expected) ** 2 / expected
    return stat, len(cats) - 1


def test_sampled_tokens_follow_the_target_distribution(monkeypatch):
    """End to end: the token a verify step emits (after one proposal, the target's own argmax
    as a draft, at temperature 0.8 and top_k 3) is distributed as the one a plain step
    samples; a verification that skipped the request's temperature and top-k is caught by the
    same test."""
    import minipaged.spec_decode.verify as verify_module
    spec = {"method": "draft_model", "model": "stories260K", "num_speculative_tokens": 1}
    n = 1200

    def second_tokens(config, seed0):
        llm = LLM("stories260K", block_size=8, speculative_config=config)
        params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=3, seed=seed0 + i,
                                 ignore_eos=True) for i in range(n)]
        outs = llm.generate(["Once upon a time"] * n, params, use_tqdm=False)
        drafts = llm.engine.step_loop.stats.num_drafts if config else 0
        ids = [o.outputs[0].token_ids for o in outs]
        mode = max({t[0] for t in ids}, key=[t[0] for t in ids].count)  # one context for all
        return [t[1] for t in ids if t[0] == mode], drafts

    plain, _ = second_tokens(None, 10**6)
    verified, drafts = second_tokens(spec, 0)
    assert drafts >= n and len(verified) > n // 4
    stat, df = chi2_homogeneity(verified, plain)
    assert len(set(verified)) <= 3 and df >= 1 and stat < CHI2_001[df], (stat, df)
    monkeypatch.setattr(verify_module, "target_probs",
                        lambda logits, seqs: logits.float().softmax(dim=-1))  # biased: T = 1
    biased, _ = second_tokens(spec, 0)
    stat, df = chi2_homogeneity(biased, plain)
    # outside top-k's support (which the target never samples), or rejected by the test
    assert len(set(biased)) > 3 or stat > CHI2_001[df], (stat, df)


def test_max_tokens_and_stops_are_never_passed():
    """The same requests with and without speculation end at the same token, for the same
    reason, with the same text (stops cut a step's accepted tokens where they apply)."""
    llm0 = LLM("stories260K", block_size=8)
    llm = LLM("stories260K", block_size=8, speculative_config=ngram(5))
    prompts = ["Once upon a time", "Lily and Ben went to the park. Lily and Ben"]
    plain = llm0.generate(prompts, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)
    text = plain[0].outputs[0].text
    ids = plain[0].outputs[0].token_ids
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 7)]
    cases += [SamplingParams(temperature=0, max_tokens=80, stop_token_ids=[ids[9]]),
              SamplingParams(temperature=0, max_tokens=80, stop=[text[30:36]]),
              SamplingParams(temperature=0, max_tokens=80, stop=[text[30:36]],
                             include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=120)]
    for p in cases:
        want = llm0.generate(prompts, p, use_tqdm=False)
        got = llm.generate(prompts, p, use_tqdm=False)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, p
            assert g.outputs[0].text == w.outputs[0].text
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            if p.max_tokens < 80:
                assert len(g.outputs[0].token_ids) == p.max_tokens
    assert llm.engine.step_loop.stats.num_accepted_tokens > 0


def test_max_model_len_is_never_passed():
    llm = LLM("stories260K", block_size=8, max_model_len=48, speculative_config=ngram(5))
    prompt = [1] + [300, 301, 302, 303] * 8
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 48
    assert out.outputs[0].finish_reason == "length"


def test_trace_and_stats_per_position():
    llm = LLM("stories260K", block_size=8, speculative_config=ngram(3))
    llm.generate(prompts_of(4, 6), greedy(30), use_tqdm=False)
    stats = llm.engine.step_loop.stats
    drafts = [sum(r.num_draft_tokens_per_pos[i] for r in llm.trace if r.num_draft_tokens_per_pos)
              for i in range(3)]
    accepted = [sum(r.num_accepted_tokens_per_pos[i] for r in llm.trace
                    if r.num_accepted_tokens_per_pos) for i in range(3)]
    assert sum(drafts) == stats.num_draft_tokens and accepted == stats.num_accepted_tokens_per_pos
    assert all(a <= d for a, d in zip(accepted, drafts))
    # A verify row counts as a decode of 1 + k tokens from the cache position before the step.
    row = next(e for r in llm.trace for e in r.scheduled if e.num_decode_tokens > 1)
    assert row.num_prefill_tokens == 0 and row.num_computed_before > 0
    untraced = LLM("stories260K", block_size=8, max_trace_len=0, speculative_config=ngram(3))
    untraced.generate(prompts_of(4, 6), greedy(30), use_tqdm=False)
    assert untraced.engine.step_loop.stats.num_drafts == stats.num_drafts


# --- guards ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"\['method'\] must be one of ngram"),
    ({"method": "ngram"}, "num_speculative_tokens'] is required"),
    (ngram(0), r"num_speculative_tokens'\] must be an integer in \[1, 16\], got 0"),
    (ngram(17), r"in \[1, 16\], got 17"),
    (ngram(2, prompt_lookup_min=5), r"prompt_lookup_min'\] must be an integer in \[1, 3\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"\['model'\] is required"),
    ("ngram", "must be None or a dict"),
])
def test_bad_speculative_config_is_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=spec).validate()


def test_combinations_not_supported_yet_are_refused(tmp_path):
    with pytest.raises(ValueError, match="async_scheduling=True"):
        LLM("stories260K", async_scheduling=True, speculative_config=ngram(2))
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, speculative_config=ngram(2)).validate()
    with pytest.raises(ValueError, match="preemption_mode='swap'"):
        EngineConfig(preemption_mode="swap", speculative_config={
            "method": "draft_model", "model": "stories260K",
            "num_speculative_tokens": 2}).validate()
    make_tiny_hf_model("llama", tmp_path / "v97")  # vocabulary 97, not 512
    with pytest.raises(ValueError, match="vocab_size is 97, the target's 512"):
        LLM("stories260K", speculative_config={"method": "draft_model",
                                               "model": str(tmp_path / "v97"),
                                               "num_speculative_tokens": 2})
    llm = LLM("stories260K", speculative_config=ngram(2))
    assert llm.config.async_scheduling is False
    with pytest.raises(RequestError, match="n=2 does not combine with speculative decoding"):
        llm.generate(["Once"], SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    with pytest.raises(RequestError, match="beam search does not combine"):
        llm.beam_search([{"prompt": "Once"}], BeamSearchParams(beam_width=2, max_tokens=4))


def test_speculative_config_flag_is_json(capsys):
    from minipaged.cli import main
    from minipaged.cli.args import add_engine_args, engine_config_from_args, FlexibleArgumentParser
    ap = FlexibleArgumentParser(prog="t")
    add_engine_args(ap)
    spec = ngram(2)
    cfg = engine_config_from_args(ap.parse_args(["--speculative-config", json.dumps(spec)]))
    assert cfg.speculative_config == spec
    assert main(["generate", "--max-tokens", "12", "--speculative-config", json.dumps(spec)]) == 0
    assert "[12 tokens, finish_reason=length]" in capsys.readouterr().out
    assert main(["generate", "--speculative-config", "{method: ngram}"]) != 0
    assert "expected a JSON object" in capsys.readouterr().err
    assert main(["generate", "--speculative-config", '{"method": "x"}']) != 0
    assert "speculative_config['method'] must be one of" in capsys.readouterr().err


# --- block manager: propose / accept / rollback ---------------------------------------------
class SpecRollbackMachine(RuleBasedStateMachine):
    """Sequences admitted with prefix-cache hits, then steps of 1 + k reserved slots of which
    a random number are accepted and the rest rolled back; the manager's invariants hold, a
    table never keeps a block without a computed token, and published blocks hold exactly the
    sequence's real tokens."""

    bs = 4

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(24, self.bs, enable_prefix_caching=True)
        self.seqs: list[Sequence] = []

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt):
        seq = Sequence("r", [1] + prompt, SamplingParams())
        blocks, cached = self.bm.get_computed_blocks(seq)
        n = seq.num_tokens - cached
        if self.bm.can_allocate(seq, blocks, n):
            self.bm.allocate(seq, blocks, n)
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            seq.append_token(prompt[-1])  # the prefill's sampled token: next step's input
            self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), k=st.integers(0, 5), data=st.data())
    def speculate(self, i, k, data):
        seq = self.seqs[i % len(self.seqs)]
        if not self.bm.can_append(seq, 1 + k):
            return
        assert not self.bm.append_slots(seq, 1 + k)  # no sharing of a written block: no CoW
        seq.num_computed_tokens += 1  # the newest token, always good
        self.bm.cache_full_blocks(seq)
        a = data.draw(st.integers(0, k))
        seq.num_computed_tokens += a  # accepted proposals
        for _ in range(a + 1):
            seq.append_token(data.draw(st.integers(0, 2)))
        self.bm.truncate(seq, seq.num_computed_tokens)
        self.bm.cache_full_blocks(seq)
        assert len(self.bm.block_tables[seq.seq_id]) == -(-seq.num_computed_tokens // self.bs)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self.bm.free(self.seqs.pop(i % len(self.seqs)))

    @invariant()
    def consistent(self):
        check_invariants(self.bm, [s.seq_id for s in self.seqs])
        a, bs = self.bm.allocator, self.bs
        for s in self.seqs:
            for j, b in enumerate(self.bm.block_tables[s.seq_id]):
                block = a.blocks[b]
                if block.block_hash is not None:
                    assert (j + 1) * bs <= s.num_computed_tokens
                    assert block.token_ids == tuple(s.token_ids[j * bs:(j + 1) * bs])

    def teardown(self):
        for s in self.seqs:
            self.bm.free(s)
        assert self.bm.num_free_blocks == 24


TestSpecRollback = SpecRollbackMachine.TestCase
TestSpecRollback.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_serve_exposes_vllm_spec_decode_counters():
    """`serve --speculative-config JSON`: vLLM's spec-decode counters at /metrics, equal to
    the engine's, and the completions equal the offline engine's."""
    import httpx
    from tests.test_server import ServerThread
    spec = ngram(3)
    server = ServerThread("stories260K", "--num-blocks", "128", "--device", "cpu",
                          "--speculative-config", json.dumps(spec),
                          "--uvicorn-log-level", "warning")
    try:
        prompt = "Lily and Ben went to the park. Lily and Ben"
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": prompt, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        offline = LLM("stories260K", num_blocks=128, speculative_config=spec)
        want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=40),
                                use_tqdm=False)[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == want
        server.wait_idle()
        stats = server.engine.step_loop.stats
        m = server.metrics()
        assert stats.num_accepted_tokens > 0
        assert m["minipaged:spec_decode_num_drafts_total"] == stats.num_drafts
        assert m["minipaged:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
        assert m["minipaged:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
        for i, n in enumerate(stats.num_accepted_tokens_per_pos):
            key = f'minipaged:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'
            assert m.get(key, 0.0) == n
    finally:
        server.stop()


def test_speculation_with_lora_adapters_keeps_each_adapters_tokens(tmp_path):
    """A verify step's 1 + k query tokens run through the adapter of their request (the punica
    mapping follows the step's token order): greedy tokens with n-gram speculation equal those
    without, for two adapters and the base model in one batch."""
    import json

    from minipaged import LoRARequest
    from minipaged.lora.random_adapter import save_random_adapter
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_builtin
    cfg = ModelConfig.from_dict(json.load(open(resolve_builtin("stories260K") / "config.json")))
    loras = [LoRARequest(f"a{i}", i + 1, save_random_adapter(
        str(tmp_path / f"a{i}"), cfg, rank=8, lora_alpha=16, seed=i, std=0.3)) for i in range(2)]
    prompts = ["Once upon a time", "Lily and Tom went", "The little dog", "One day"]
    per_prompt = [loras[0], None, loras[1], loras[0]]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs, accepted = [], 0
    for spec in (None, ngram(3)):
        llm = LLM("stories260K", enable_lora=True, max_loras=2, speculative_config=spec)
        res = llm.generate(prompts, sp, lora_request=per_prompt, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in res])
        if spec is not None:
            accepted = llm.engine.step_loop.stats.num_accepted_tokens
    assert accepted > 0
    assert outs[0] == outs[1]


def test_greedy_verify_matches_the_rejection_rule():
    """`verify_greedy` (the argmaxes compared on the host) decides rows of k = 0..4, read at
    their own offsets among rows it must skip, as `rejection_sample`'s greedy rule does on the
    softmax: guesses kept while they equal the argmax, then the argmax."""
    from types import SimpleNamespace
    from minipaged.sampling.rejection_sampler import rejection_sample
    from minipaged.spec_decode.verify import verify_greedy
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    ks = [0, 1, 4, 2, 3, 4, 0, 4]
    starts, row = [], 1  # row 0, and one row after every third entry, belong to no entry
    for i, k in enumerate(ks):
        starts.append(row)
        row += k + 1 + (i % 3 == 2)
    logits = torch.randn(row, 512, generator=g)
    argmax = logits.argmax(dim=-1).tolist()
    entries = []
    for start, k in zip(starts, ks):
        drafts = argmax[start:start + k]
        miss = rng.randint(0, k)  # k: every guess right
        if miss < k:
            drafts[miss] = (drafts[miss] + 1 + rng.randrange(511)) % 512
        entries.append(SimpleNamespace(spec_token_ids=drafts))
    tokens, accepted = verify_greedy(logits, entries, starts)
    max_k = max(ks)
    index = torch.tensor([[s + min(i, k) for i in range(max_k + 1)] for s, k in zip(starts, ks)])
    drafts = torch.tensor([e.spec_token_ids + [-1] * (max_k - len(e.spec_token_ids))
                           for e in entries])
    output, num_accepted = rejection_sample(logits[index].softmax(dim=-1), drafts,
                                            torch.tensor(ks), None,
                                            torch.ones(len(ks), dtype=torch.bool))
    assert accepted == num_accepted.tolist()
    assert tokens == [row[:a + 1] for row, a in zip(output.tolist(), accepted)]
    assert 0 < sum(accepted) < sum(ks)


def test_greedy_verify_steps_take_no_sampler_and_no_rejection_kernels(stories_hf, monkeypatch):
    """An all-greedy step with proposals decides every row from one argmax: no rejection
    sampling, and its greedy rows without proposals ride along instead of a second sampler
    pass (a second host read on a GPU). Tokens: HF greedy's."""
    import minipaged.spec_decode.verify as verify_module
    monkeypatch.setattr(verify_module, "rejection_sample", None)  # a call would raise
    ks_seen = []
    real = verify_module.verify_greedy
    monkeypatch.setattr(verify_module, "verify_greedy", lambda logits, entries, starts: (
        ks_seen.append([len(e.spec_token_ids) for e in entries]) or real(logits, entries, starts)))
    prompts = prompts_of(8, 3)
    lengths = [random.Random(i).randint(10, 30) for i in range(len(prompts))]
    llm = LLM("stories260K", block_size=8, speculative_config=ngram(3))
    eng = llm.engine
    sampled = []
    real_sample = eng.sample_and_process
    eng.sample_and_process = lambda logits, seqs: (
        sampled.append(len(eng.trace)) or real_sample(logits, seqs))
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert tokens(outs) == hf_greedy(stories_hf, prompts, lengths)
    assert any(0 in ks and max(ks) > 0 for ks in ks_seen), ks_seen  # mixed steps happened
    spec_steps = {i for i, r in enumerate(eng.trace) if sum(r.num_draft_tokens_per_pos)}
    assert spec_steps and not spec_steps & set(sampled)  # steps with proposals: no sampler
