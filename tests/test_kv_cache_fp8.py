"""kv_cache_dtype="fp8": a float8 e4m3 KV cache (one byte per element).

On the CPU the torch_ref backend reads and writes it; tests/test_gpu.py checks the Triton kernels
(the fused K/V store and the paged attention kernel) on a float8 cache.
"""
import pytest
import torch

from minipaged import LLM, EngineConfig, SamplingParams
from minipaged.attention.torch_ref import paged_attention_reference
from minipaged.worker.kv_dtype import FP8_MAX, raw, to_cache_dtype
from tests.helpers import STORIES_EXPECTED

SP = SamplingParams(temperature=0, max_tokens=40)
PROMPTS = ["Once upon a time", "Lily went to the park", "The cat"]


def test_fp8_cache_holds_four_times_the_tokens_of_fp32():
    mem = 100 * 16 * 1280  # 100 blocks of 16 tokens; fp32 K+V: 2 x 5 layers x 4 heads x 8 x 4 B
    auto = LLM("stories260K", device="cpu", kv_cache_memory=mem, dtype="float32")
    fp8 = LLM("stories260K", device="cpu", kv_cache_memory=mem, dtype="float32",
              kv_cache_dtype="fp8")
    assert fp8.engine.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.kv_cache.element_size() == 1
    assert (auto.engine.num_blocks, fp8.engine.num_blocks) == (100, 400)


def test_fp8_greedy_stays_close_to_full_precision():
    full = LLM("stories260K", device="cpu").generate(PROMPTS, SP, use_tqdm=False)
    fp8 = LLM("stories260K", device="cpu", kv_cache_dtype="fp8").generate(PROMPTS, SP,
                                                                          use_tqdm=False)
    # 3 mantissa bits change the numbers a little; the greedy story of SOURCE.md survives whole,
    # and every other output starts the same way.
    ids = fp8[0].prompt_token_ids + fp8[0].outputs[0].token_ids
    assert ids == STORIES_EXPECTED[:len(ids)]
    for a, b in zip(full, fp8):
        assert a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4]


def test_fp8_store_clamps_and_attention_reads_the_rounded_values():
    x = torch.tensor([1e4, -1e4, 0.1234, 3.0])
    y = to_cache_dtype(x, torch.float8_e4m3fn)
    assert y.float().tolist()[:2] == [FP8_MAX, -FP8_MAX]  # not NaN
    assert y.float()[2] == torch.tensor(0.1234).to(torch.float8_e4m3fn).float()
    # The torch_ref backend through the engine's cache equals attention on the rounded K/V.
    llm = LLM("stories260K", device="cpu", kv_cache_dtype="fp8")
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    cache = llm.engine.kv_cache[0]  # layer 0: (2, blocks, block_size, kv_heads, dim)
    assert raw(cache).dtype == torch.uint8 and torch.isfinite(cache[0].float()).all()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fp8_preemption_and_sharing_move_bytes_intact(mode):
    """Copy-on-write (n=2) and swapping copy float8 blocks as bytes; greedy output is the same
    as without memory pressure."""
    prompts = [f"Once upon a time {w}" for w in ("Lily", "Tom", "a cat", "a dog", "the sun")] * 2
    sp = [SamplingParams(temperature=0, max_tokens=50), SamplingParams(n=2, temperature=0.8,
                                                                      seed=1, max_tokens=20)] * 5
    roomy = LLM("stories260K", device="cpu", kv_cache_dtype="fp8", block_size=8)
    tight = LLM("stories260K", device="cpu", kv_cache_dtype="fp8", block_size=8, num_blocks=24,
                max_model_len=96, preemption_mode=mode)
    a = roomy.generate(prompts, sp, use_tqdm=False)
    b = tight.generate(prompts, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_free_blocks == tight.engine.num_blocks


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="^kv_cache_dtype must be one of .*'auto'.*, got 'int4'$"):
        EngineConfig(kv_cache_dtype="int4").validate()


def test_reference_attention_widens_fp8():
    from minipaged.attention.metadata import AttentionMetadata
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, 2, 8, generator=g)  # (blocks, block_size, kv_heads, dim)
    v = torch.randn(4, 2, 2, 8, generator=g)
    q = torch.randn(1, 4, 8, generator=g)
    md = AttentionMetadata(slot_mapping=torch.tensor([-1]),
                           block_tables=torch.tensor([[2, 0, 3]], dtype=torch.int32),
                           context_lens=torch.tensor([5], dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), query_lens=[1],
                           context_lens_host=[5], max_query_len=1, max_context_len=5,
                           block_size=2)
    k8, v8 = to_cache_dtype(k, torch.float8_e4m3fn), to_cache_dtype(v, torch.float8_e4m3fn)
    out = paged_attention_reference(q, k8, v8, md, 0.35)
    ref = paged_attention_reference(q, k8.float(), v8.float(), md, 0.35)
    torch.testing.assert_close(out, ref)
