"""The CPU attention backend (minipaged/attention/cpu_backend.py) against the `torch_ref` oracle.

Its decode path gathers whole blocks (keys past a sequence's end masked), packs small KV heads
block-diagonally and attends in L2-sized chunks of sequences sorted by length; every other step
goes through `TorchRefBackend`. Each case uses shuffled physical blocks and finite garbage in
every slot that holds no key of the step (as a reused cache does). Token-level parity with HF
runs through tests/test_parity.py, whose engines use this backend by default on the CPU.
"""
from __future__ import annotations

import math

import pytest
import torch

from minipaged import LLM, EngineConfig, SamplingParams
from minipaged.attention import cpu_backend, default_backend_name, get_attention_backend
from minipaged.attention.cpu_backend import CPUBackend, DecodePlan, decode_chunks
from minipaged.attention.metadata import AttentionMetadata
from minipaged.attention.batched_sdpa import BatchedPlan
from minipaged.attention.torch_ref import paged_attention_reference
from minipaged.models.config import ModelConfig
from minipaged.models.loader import resolve_model
from minipaged.utils import cdiv
from tests.helpers import STORIES_EXPECTED, store_and_attend

BLOCK = 8


def make_step(seqs, num_heads, num_kv_heads, head_dim, dtype=torch.float32,
              cache_dtype=None, pad_tokens=0, seed=0):
    """One step of sequences (query_len, context_len) over a cache with shuffled blocks; returns
    (q, k, v, k_cache, v_cache, metadata). Slots without a key hold large finite garbage."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [cdiv(c, BLOCK) for _, c in seqs]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # block 0: the tables' padding
    physical = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int32)
    shape = (num_blocks, BLOCK, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 300.0).to(cache_dtype)  # finite garbage: never attended
    v_cache = torch.full(shape, -300.0).to(cache_dtype)
    slots, start = [], 0
    for i, (q_len, ctx) in enumerate(seqs):
        own = physical[start:start + blocks_per_seq[i]]
        start += blocks_per_seq[i]
        tables[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(ctx)
        seq_slots = torch.tensor(own)[pos // BLOCK] * BLOCK + pos % BLOCK
        cached = seq_slots[:ctx - q_len]
        for cache in (k_cache, v_cache):
            rows = torch.randn(len(cached), num_kv_heads, head_dim, generator=g)
            cache.view(torch.uint8 if cache_dtype == torch.float8_e4m3fn else cache_dtype) \
                .view(-1, num_kv_heads, head_dim)[cached] = _bytes(rows.to(cache_dtype))
        slots.append(seq_slots[ctx - q_len:])
    slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1)]).long()
    n = len(slot_mapping)
    q, k, v = (torch.randn(n, h, head_dim, generator=g).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    qlens, ctxs = [q_len for q_len, _ in seqs], [c for _, c in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(qlens).cumsum(0)
    md = AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=tables,
        context_lens=torch.tensor(ctxs, dtype=torch.int32), cu_seqlens_q=cu, query_lens=qlens,
        context_lens_host=ctxs, max_query_len=max(qlens), max_context_len=max(ctxs),
        block_size=BLOCK, num_decode_tokens=qlens.count(1))
    return q, k, v, k_cache, v_cache, md


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


DECODES = [(1, c) for c in (1, 7, 8, 9, 16, 17, 40, 3, 25, 64, 2)]  # edge lengths around BLOCK


@pytest.mark.parametrize("heads", [
    pytest.param((8, 4, 8), id="gqa-block-diagonal"),  # stories260K's shape
    pytest.param((4, 2, 16), id="gqa-block-diagonal-wider"),
    pytest.param((8, 2, 64), id="per-head"),  # 2 x 64 values per key row: too wide to pack
    pytest.param((4, 4, 16), id="mha-per-head"),
    pytest.param((4, 1, 16), id="one-kv-head"),
])
@pytest.mark.parametrize("budget", [1 << 20, 1], ids=["one-chunk", "chunk-per-sequence"])
def test_decode_step_equals_reference(monkeypatch, heads, budget):
    monkeypatch.setattr(cpu_backend, "GATHER_CHUNK_BYTES", budget)
    q, k, v, k_cache, v_cache, md = make_step(DECODES, *heads)
    backend = CPUBackend()
    backend.prepare(md)
    assert isinstance(md.plan, DecodePlan)
    for layer in range(2):  # the plan, chunks and buffers are shared by the layers of a step
        out = store_and_attend(backend, q, k, v, k_cache, v_cache, md, 1 / math.sqrt(heads[2]))
        ref = paged_attention_reference(q, k_cache, v_cache, md, 1 / math.sqrt(heads[2]))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    chunks = md.plan.chunks
    assert len(chunks) == (1 if budget > 1 else len(DECODES))
    assert (md.plan.order is None) == (len(chunks) == 1)
    packed = heads[1] > 1 and heads[1] * heads[2] <= cpu_backend.BLOCK_DIAGONAL_MAX_WIDTH
    assert (md.plan.q is not None) == packed


@pytest.mark.parametrize("dtype,cache_dtype,tol", [
    (torch.bfloat16, torch.bfloat16, 3e-2), (torch.float32, torch.float8_e4m3fn, 2e-5)])
def test_decode_step_in_other_dtypes(monkeypatch, dtype, cache_dtype, tol):
    """A bf16 model (the bias in the model's dtype) and an fp8 cache (gathered as bytes)."""
    monkeypatch.setattr(cpu_backend, "GATHER_CHUNK_BYTES", 4096)  # several chunks
    q, k, v, k_cache, v_cache, md = make_step(DECODES, 8, 4, 8, dtype, cache_dtype)
    backend = CPUBackend()
    backend.prepare(md)
    out = store_and_attend(backend, q, k, v, k_cache, v_cache, md, 0.35)
    ref = paged_attention_reference(q, k_cache, v_cache, md, 0.35)
    assert out.dtype == dtype and len(md.plan.chunks) > 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("seqs,pad", [
    pytest.param([(12, 30), (1, 9), (4, 4)], 0, id="prompt-chunks"),
    pytest.param([(1, 40), (1, 9)], 2, id="padding-tokens"),
])
def test_other_steps_take_batched_sdpa(seqs, pad):
    """A step with a prompt chunk, or with padding tokens (slot -1), is planned by batched SDPA:
    the decode path would attend one query per sequence and write to slot -1."""
    q, k, v, k_cache, v_cache, md = make_step(seqs, 8, 4, 8, pad_tokens=pad)
    backend = CPUBackend()
    backend.prepare(md)
    assert isinstance(md.plan, BatchedPlan)
    out = store_and_attend(backend, q, k, v, k_cache, v_cache, md, 0.35)
    n = sum(q_len for q_len, _ in seqs)
    ref = paged_attention_reference(q[:n], k_cache, v_cache, md, 0.35)
    torch.testing.assert_close(out[:n], ref, rtol=1e-5, atol=2e-5)


def test_decode_chunks_sort_by_length_and_fit_the_budget():
    lens = [40, 3, 100, 17, 64, 1, 90]
    block_bytes = 100  # per block of K (V the same)
    order, chunks = decode_chunks(lens, 8, block_bytes, budget=6000)
    assert sorted(order) == list(range(len(lens)))
    assert [lens[i] for i in order] == sorted(lens)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, in order
    for start, end, max_blocks in chunks:
        assert max_blocks == cdiv(max(lens[i] for i in order[start:end]), 8)
        assert end - start == 1 or (end - start) * 2 * max_blocks * block_bytes <= 6000
    assert len(chunks) > 1
    assert decode_chunks([5, 300], 8, 10 ** 6, budget=1)[1] == [(0, 1, 1), (1, 2, 38)]


def test_cpu_is_the_default_backend_on_the_cpu():
    mc = ModelConfig.from_dict(resolve_model("stories260K").config)
    assert default_backend_name("cpu") == "cpu"
    assert EngineConfig(device="cpu").resolve(mc).attention_backend == "cpu"
    assert EngineConfig(device="cpu", attention_backend="torch_ref").resolve(mc) \
        .attention_backend == "torch_ref"
    assert isinstance(get_attention_backend("cpu", "cpu"), CPUBackend)


def test_stories260k_greedy_with_both_backends():
    """SOURCE.md's ids from both CPU backends, with many sequences decoding at once in chunks."""
    params = SamplingParams(temperature=0, max_tokens=40)
    for backend in ("cpu", "torch_ref"):
        llm = LLM("stories260K", attention_backend=backend, block_size=8)
        out = llm.generate(["Once upon a time"] * 3, params, use_tqdm=False)
        assert all(o.prompt_token_ids + o.outputs[0].token_ids == STORIES_EXPECTED for o in out)
