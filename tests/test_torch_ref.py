"""`online_softmax_attention` (minipaged/attention/online_softmax.py, lesson 05) against the oracle.

The block-by-block online softmax must give what `paged_attention_reference` (one softmax over
the whole row) gives: decodes and prefills, a chunk over a cached prefix, lengths at the block
edges (1, block_size, block_size + 1), GQA groups of 1, 2 and 4, fp32 and bf16. Physical blocks
are shuffled, and every slot past a sequence's end holds NaN: reading one turns the output NaN.
These tests also grade the `online_softmax` exercise (`minipaged exercise check online_softmax`).
"""
from __future__ import annotations

import math

import pytest
import torch

from minipaged.attention.metadata import AttentionMetadata
from minipaged.attention.online_softmax import online_softmax_attention
from minipaged.attention.torch_ref import paged_attention_reference
from minipaged.utils import cdiv


def paged_case(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A step of sequences given as (query_len, context_len): q, caches and metadata."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(ctx, block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks nobody uses
    physical = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    start = 0
    for i, (_, ctx) in enumerate(seqs):
        own = physical[start:start + blocks_per_seq[i]]
        start += blocks_per_seq[i]
        tables[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
        pos = torch.arange(ctx)
        slots = torch.tensor(own)[pos // block_size] * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = (
                torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype))
    qlens, ctxs = [q for q, _ in seqs], [c for _, c in seqs]
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(qlens).cumsum(0)
    md = AttentionMetadata(
        slot_mapping=torch.full((sum(qlens),), -1), block_tables=tables,
        context_lens=torch.tensor(ctxs, dtype=torch.int32), cu_seqlens_q=cu, query_lens=qlens,
        context_lens_host=ctxs, max_query_len=max(qlens), max_context_len=max(ctxs),
        block_size=block_size)
    return q, k_cache, v_cache, md


def check_against_reference(seqs, block_size, num_heads, num_kv_heads, head_dim=8,
                            dtype=torch.float32, atol=2e-5, seed=0):
    q, k_cache, v_cache, md = paged_case(seqs, block_size, num_heads, num_kv_heads, head_dim,
                                         dtype, seed)
    scale = 1.0 / math.sqrt(head_dim)
    ref = paged_attention_reference(q, k_cache, v_cache, md, scale)
    for i, (q_len, ctx) in enumerate(seqs):
        start = int(md.cu_seqlens_q[i])
        got = online_softmax_attention(q[start:start + q_len], k_cache, v_cache,
                                       md.block_tables[i], ctx, scale)
        assert got.shape == (q_len, num_heads, head_dim) and got.dtype == dtype
        assert torch.isfinite(got).all(), f"sequence {i} (q_len {q_len}, ctx {ctx}) read a NaN slot"
        want = ref[start:start + q_len]
        err = (got.float() - want.float()).abs().max().item()
        assert err <= atol, f"sequence {i} (q_len {q_len}, context {ctx}): max error {err:.2e}"


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)],
                         ids=["mha", "gqa2", "gqa4"])
def test_decodes_at_block_edges_match_the_reference(num_heads, num_kv_heads):
    bs = 4
    check_against_reference([(1, 1), (1, bs), (1, bs + 1), (1, 3 * bs), (1, 37)], bs,
                            num_heads, num_kv_heads)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefills_and_chunks_over_a_cached_prefix_match_the_reference(block_size):
    # whole prompts (q_len == ctx) and chunks whose first keys were cached by earlier steps
    seqs = [(5, 5), (3, 13), (block_size, block_size), (block_size + 1, 2 * block_size + 3),
            (7, 40)]
    check_against_reference(seqs, block_size, num_heads=4, num_kv_heads=2, seed=block_size)


def test_bf16_inputs_match_the_reference():
    check_against_reference([(1, 29), (6, 22)], 8, num_heads=8, num_kv_heads=4, head_dim=16,
                            dtype=torch.bfloat16, atol=2e-2)


def test_large_scores_do_not_overflow():
    """Scores around 100: exp without subtracting the running max would overflow fp32."""
    q, k_cache, v_cache, md = paged_case([(3, 20)], 4, 2, 2, 8, torch.float32, seed=5)
    q, k_cache = q * 12, k_cache * 12
    ref = paged_attention_reference(q, k_cache, v_cache, md, 1.0)
    got = online_softmax_attention(q, k_cache, v_cache, md.block_tables[0], 20, 1.0)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref, atol=1e-4)
