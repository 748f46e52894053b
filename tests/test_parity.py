"""Parity, the backbone test: minipaged's greedy tokens equal HF generate(do_sample=False).

stories260K runs in fp32 (its real dtype). The random tiny models run in float64 on both sides,
so that near-ties in their flat logits cannot flip an argmax through rounding alone.
"""
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.lessons.baseline import load_hf_model
from minipaged.models.loader import resolve_builtin
from tests.helpers import STORIES_EXPECTED, hf_greedy, make_tiny_hf_model


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def stories_hf():
    return load_hf_model(str(resolve_builtin("stories260K")))


def random_prompts(n, vocab, lo, hi, seed, bos=1, shared_prefix=None):
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids = [bos] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi) - 1)]
        if shared_prefix is not None and rng.random() < 0.5:
            ids = list(shared_prefix) + ids[1:]
        prompts.append(ids)
    return prompts


def test_stories260k_matches_source_md():
    llm = LLM("stories260K")
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids + out.outputs[0].token_ids == STORIES_EXPECTED
    assert out.outputs[0].text.startswith(", there was a little girl named Lily.")


@pytest.mark.parametrize("block_size,backend", [(8, "cpu"), (16, "cpu"), (8, "torch_ref")])
def test_stories260k_many_concurrent_prompts(stories_hf, block_size, backend):
    """40 mixed-length prompts at once, prefix caching on, default chunked prefill; with the
    CPU's default backend (attention/cpu_backend.py) and with the reference it speeds up."""
    prompts = random_prompts(40, 512, 2, 60, seed=block_size)
    lengths = [random.Random(i).randint(1, 40) for i in range(len(prompts))]
    llm = LLM("stories260K", block_size=block_size, attention_backend=backend)
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(stories_hf, prompts, lengths)
    assert max(len(r.scheduled) for r in llm.trace) == len(prompts)  # all in one step


def test_stories260k_under_preemption_and_chunked_prefill(stories_hf):
    """A cache of 24 blocks x 8 slots for 24 sequences forces recompute preemptions; a budget of
    32 tokens forces prompts to be split into chunks that share steps with decodes."""
    prompts = random_prompts(24, 512, 20, 60, seed=7)
    n = 30
    llm = LLM("stories260K", block_size=8, num_blocks=24, max_model_len=128,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(stories_hf, prompts, n)
    trace = llm.trace
    assert sum(len(r.preempted) for r in trace) > 0
    assert all(r.num_batched_tokens <= 32 for r in trace)
    mixed = [r for r in trace if r.num_prefill_tokens and r.num_decode_tokens]
    assert mixed, "chunked prefill should put prefill chunks and decodes in one step"
    assert llm.engine.block_manager.num_free_blocks == 24


def test_stories260k_prefix_caching_shared_prefix(stories_hf):
    system = [1] + [random.Random(3).randrange(3, 512) for _ in range(40)]
    prompts = [system + [random.Random(i).randrange(3, 512) for _ in range(1 + i % 7)]
               for i in range(12)]
    llm = LLM("stories260K", block_size=8, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], greedy(12), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(12), use_tqdm=False)
    outs = [o.outputs[0].token_ids for o in first + rest]
    assert outs == hf_greedy(stories_hf, prompts, 12)
    assert all(o.num_cached_tokens == 40 for o in rest)  # 5 full blocks of the shared prefix
    assert llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_random_tiny_families(tmp_path, family, block_size):
    hf = make_tiny_hf_model(family, tmp_path / family)
    prompts = random_prompts(10, 97, 1, 40, seed=1)
    lengths = [5 + (i * 7) % 20 for i in range(len(prompts))]
    llm = LLM(str(tmp_path / family), dtype="float64", block_size=block_size, num_blocks=40,
              max_num_batched_tokens=48)
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, lengths)


def test_random_llama_preemption_float64(tmp_path):
    hf = make_tiny_hf_model("llama", tmp_path / "m", seed=3)
    prompts = random_prompts(12, 97, 10, 30, seed=2)
    llm = LLM(str(tmp_path / "m"), dtype="float64", block_size=8, num_blocks=12, max_model_len=96)
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, 40)
    assert sum(len(r.preempted) for r in llm.trace) > 0
