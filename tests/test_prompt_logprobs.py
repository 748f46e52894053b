"""Prompt logprobs (minipaged/prompt_logprobs/) against HF: log_softmax of HF's forward.

`SamplingParams(prompt_logprobs=k)` must give, at every prompt position i >= 1, prompt token
i's log-probability given tokens 0..i-1 and the k most likely tokens there, as HF's forward
computes them in float32 (within 1e-4), on stories260K and a random Qwen3: with chunked prefill
small enough to split every prompt, with a prefix-cache hit on the prompt, after recompute
preemptions, with n > 1 and with a LoRA adapter. The perplexity helper equals HF's NLL.
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from minipaged import LLM, LoRARequest, RequestError, SamplingParams
from minipaged.lessons.baseline import load_hf_model
from minipaged.models.loader import resolve_builtin
from minipaged.prompt_logprobs import perplexity, score_prompts
from minipaged.prompt_logprobs.extension import PromptLogprobsExtension
from minipaged.prompt_logprobs.runner import PromptLogprobsRunner, scoring_requests
from tests.helpers import make_tiny_hf_model

ATOL = 1e-4
STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.",
    "One day, a big dog came to the park. The dog barked at the birds in the tall tree.",
    "Tom had a red ball. He threw it to his friend Sam, and they laughed and played all day.",
    "The cat was sad because it could not find its toy. Mom helped the cat look under the bed.",
]


@pytest.fixture(scope="module")
def stories_hf():
    return load_hf_model(str(resolve_builtin("stories260K")))


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): row i is log p(. | ids[:i + 1]) from HF's forward, in float32."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def check_against_hf(out, hf, k: int) -> None:
    """Every position's prompt-token logprob and top-k equal HF's, within ATOL (a rank may
    differ only among tokens within ATOL of each other)."""
    ids = out.prompt_token_ids
    ref = hf_logprobs(hf, ids)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row = out.prompt_logprobs[i], ref[i - 1]
        for tid, lp in entry.items():  # the prompt token and the top k, each HF's value
            assert lp.logprob == pytest.approx(row[tid].item(), abs=ATOL)
            assert (int((row > row[tid] + ATOL).sum()) < lp.rank
                    <= int((row > row[tid] - ATOL).sum()) + 1)
        assert ids[i] in entry
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(k).values.tolist(), abs=ATOL)
        assert len(entry) in (k, k + 1)  # the top k, and the prompt token if it is not in them


def random_prompts(n, vocab, lo, hi, seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi) - 1)]
            for _ in range(n)]


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


# --- against HF --------------------------------------------------------------------------------
def test_stories260k_chunked_prefill_splits_every_prompt(stories_hf):
    llm = LLM("stories260K", block_size=8, max_num_batched_tokens=8, max_num_seqs=4,
              device="cpu")
    prompts = STORIES + random_prompts(4, 512, 12, 40, seed=0)
    outs = llm.generate(prompts, greedy(4, prompt_logprobs=5), use_tqdm=False)
    for out in outs:
        check_against_hf(out, stories_hf, 5)
    # every prompt was split: none ran whole in one step
    lengths = {o.request_id: len(o.prompt_token_ids) for o in outs}
    chunks = {}
    for rec in llm.trace:
        for e in rec.scheduled:
            if e.num_prefill_tokens:
                chunks.setdefault(e.request_id, []).append(e.num_prefill_tokens)
    assert all(len(chunks[rid]) > 1 and sum(chunks[rid]) == n for rid, n in lengths.items())
    # the generated tokens are the same as without prompt logprobs
    plain = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_random_qwen3_float32(tmp_path):
    hf = make_tiny_hf_model("qwen3", tmp_path / "q3", dtype=torch.float32)
    llm = LLM(str(tmp_path / "q3"), dtype="float32", block_size=8, num_blocks=64,
              max_num_batched_tokens=7, device="cpu")
    prompts = random_prompts(6, 97, 9, 40, seed=1)
    outs = llm.generate(prompts, greedy(3, prompt_logprobs=4), use_tqdm=False)
    for out in outs:
        check_against_hf(out, hf, 4)


def test_prefix_cache_hit_is_not_read_but_published(stories_hf):
    """A request with prompt logprobs computes its whole prompt (a prefix hit has no logits),
    and the blocks it computes serve later requests without prompt logprobs."""
    llm = LLM("stories260K", block_size=8, enable_prefix_caching=True, device="cpu")
    prompt = STORIES[0]
    first = llm.generate(prompt, greedy(2), use_tqdm=False)[0]  # fills the prefix cache
    assert first.num_cached_tokens == 0
    scored = llm.generate(prompt, greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # the hit was there, and not read
    check_against_hf(scored, stories_hf, 2)
    again = llm.generate(prompt, greedy(2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 8 * ((len(again.prompt_token_ids) - 1) // 8) > 0


def test_without_skipping_the_prefix_cache_a_hit_is_refused(monkeypatch):
    """The guard the skip stands for: a hit would leave positions without logits."""
    prepare = PromptLogprobsExtension.prepare

    def prepare_reading_the_cache(self, engine, request_id, params, n):
        params, start = prepare(self, engine, request_id, params, n)
        if start is None:
            return params, None

        def start_and_read_cache(seq):
            start(seq)
            seq.skip_reading_prefix_cache = False
        return params, start_and_read_cache
    monkeypatch.setattr(PromptLogprobsExtension, "prepare", prepare_reading_the_cache)
    llm = LLM("stories260K", block_size=8, enable_prefix_caching=True, device="cpu")
    llm.generate(STORIES[1], greedy(1), use_tqdm=False)
    with pytest.raises(RuntimeError, match="prompt positions are scored"):
        llm.generate(STORIES[1], greedy(1, prompt_logprobs=0), use_tqdm=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_scores_each_position_once(stories_hf, mode):
    """A cache too small for the batch: sequences are preempted, some in the middle of their
    prompt's chunks, and prefill again (recompute) or come back from the CPU pool (swap);
    their prompt logprobs are neither lost nor repeated."""
    llm = LLM("stories260K", block_size=4, num_blocks=20, max_model_len=64,
              max_num_batched_tokens=12, preemption_mode=mode, swap_space=0.01, device="cpu")
    prompts = STORIES + random_prompts(4, 512, 20, 36, seed=2)
    outs = llm.generate(prompts, greedy(24, prompt_logprobs=3), use_tqdm=False)
    for out in outs:
        check_against_hf(out, stories_hf, 3)
    lengths = {o.request_id: len(o.prompt_token_ids) for o in outs}
    computed: dict[str, int] = {}  # request id -> tokens in the cache after its last step
    mid_prompt = 0
    for rec in llm.trace:
        for rid in rec.preempted:
            mid_prompt += computed.get(rid, 0) < lengths[rid]
        for e in rec.scheduled:
            computed[e.request_id] = e.num_computed_before + e.num_prefill_tokens + \
                e.num_decode_tokens
    assert sum(len(r.preempted) for r in llm.trace) > 0 and mid_prompt > 0


def test_n_samples_share_the_prompt_logprobs(stories_hf):
    llm = LLM("stories260K", block_size=8, max_num_batched_tokens=16, device="cpu")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, prompt_logprobs=2)
    out = llm.generate(STORIES[2], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check_against_hf(out, stories_hf, 2)


def test_lora_adapter_scores_with_its_weights(stories_hf, tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    model = peft.get_peft_model(copy.deepcopy(stories_hf), cfg).eval()
    with torch.no_grad():  # an adapter that matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(2.0)
    model.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM("stories260K", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
              num_blocks=128, max_num_batched_tokens=16, device="cpu")
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    params = greedy(2, prompt_logprobs=3)
    with_adapter, base = llm.generate([STORIES[0]] * 2, params, use_tqdm=False,
                                      lora_request=[lora, None])
    check_against_hf(with_adapter, model, 3)
    check_against_hf(base, stories_hf, 3)
    ids = base.prompt_token_ids  # the adapter matters: the test could fail
    assert max(abs(a[t].logprob - b[t].logprob) for a, b, t in zip(
        with_adapter.prompt_logprobs[1:], base.prompt_logprobs[1:], ids[1:])) > 0.1


def test_speculative_decoding(stories_hf):
    """Prompt chunks and verify steps in the same engine (n-gram proposals, lesson 10)."""
    llm = LLM("stories260K", block_size=8, max_num_batched_tokens=16, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate(STORIES, greedy(24, prompt_logprobs=2), use_tqdm=False)
    for out in outs:
        check_against_hf(out, stories_hf, 2)
    assert llm.engine.step_loop.stats.num_accepted_tokens > 0


def test_async_scheduling(stories_hf):
    llm = LLM("stories260K", async_scheduling=True, block_size=8, max_num_batched_tokens=16,
              device="cpu")
    outs = llm.generate(STORIES, [greedy(8, prompt_logprobs=1), greedy(8)] * 2, use_tqdm=False)
    check_against_hf(outs[0], stories_hf, 1)
    check_against_hf(outs[2], stories_hf, 1)
    assert outs[1].prompt_logprobs is None


# --- edges, validation, cost -------------------------------------------------------------------
def test_one_token_prompt_and_zero_top_tokens():
    llm = LLM("stories260K", device="cpu")
    out = llm.generate([[1]], greedy(2, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    out = llm.generate([[1, 403, 407]], greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    assert [list(e) if e else e for e in out.prompt_logprobs] == [None, [403], [407]]


def test_prompt_logprobs_validated():
    llm = LLM("stories260K", device="cpu")
    with pytest.raises(RequestError, match=r"prompt_logprobs must be <= max_logprobs \(20\), "
                                           r"got 21"):
        llm.generate("Once", greedy(1, prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be .*>= 0.*got -1"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"^prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
    unlimited = LLM("stories260K", device="cpu", max_logprobs=-1)
    out = unlimited.generate([[1, 403]], greedy(1, prompt_logprobs=600), use_tqdm=False)[0]
    assert len(out.prompt_logprobs[1]) == 512  # the whole vocabulary, at most


def test_refused_where_no_runner_computes_them():
    """With tensor parallelism there is no PromptLogprobsRunner: refused, by name."""
    class Engine:
        class config:
            tensor_parallel_size = 2
    ext = PromptLogprobsExtension(None)
    assert ext.prepare(Engine, "r", greedy(1), 5) == (greedy(1), None)
    with pytest.raises(RequestError, match="prompt_logprobs=2 is not supported with "
                                           "tensor_parallel_size=2"):
        ext.prepare(Engine, "r", greedy(1, prompt_logprobs=2), 5)


def test_free_when_no_request_asks(monkeypatch):
    """Without a scored request the wrapper hands the step on untouched: it plans nothing."""
    def plan(self, sched):
        raise AssertionError("planned prompt rows with no scored request")
    monkeypatch.setattr(PromptLogprobsRunner, "plan", plan)
    llm = LLM("stories260K", device="cpu")
    llm.generate(STORIES[:2], greedy(4), use_tqdm=False)


def test_aborted_request_stops_being_scored():
    llm = LLM("stories260K", block_size=8, max_num_batched_tokens=8, device="cpu")
    eng = llm.engine
    eng.add_request("a", STORIES[0], greedy(2, prompt_logprobs=1))
    eng.step()  # its first chunk
    scoring = scoring_requests(eng.model_runner)
    assert list(scoring) == ["a"]
    eng.abort_request("a")
    assert not scoring and not eng.has_unfinished_requests()


# --- perplexity ---------------------------------------------------------------------------------
def test_perplexity_equals_hf_nll(stories_hf):
    llm = LLM("stories260K", max_num_batched_tokens=16, device="cpu")
    scores = score_prompts(llm, STORIES)
    total_nll, total_tokens = 0.0, 0
    for s in scores:
        ref = hf_logprobs(stories_hf, s.token_ids)
        ids = torch.tensor(s.token_ids)
        nll = -ref[:-1].gather(1, ids[1:, None]).sum().item()  # HF's NLL of tokens 1..
        assert s.nll == pytest.approx(nll, abs=1e-3)
        assert s.num_scored == len(s.token_ids) - 1
        with torch.no_grad():  # HF's own loss is the mean NLL over the same tokens
            loss = stories_hf(ids[None], labels=ids[None]).loss.item()
        assert s.perplexity == pytest.approx(math.exp(loss), rel=1e-4)
        total_nll, total_tokens = total_nll + nll, total_tokens + s.num_scored
    assert perplexity(scores) == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-4)
