"""Stage 8, `online_softmax` (lesson 05): paged attention over a block-table walk, online softmax.

Write `online_softmax_attention` of minipaged/attention/online_softmax.py: one sequence's
attention, reading its keys and values one block at a time through its block table, with the
running max / sum / accumulator of the flash-attention recurrence (lesson 05, section 3, does it with
numbers; the Triton kernel does it per tile). While the grader runs, your function replaces the
real one, and the tests compare it with `paged_attention_reference` (one softmax over the whole
row). Grade it with

    minipaged exercise check online_softmax

Needs: the cache layout the block manager's tables index (stage 2): a token at position p of a
sequence sits in physical block block_table[p // block_size], row p % block_size. In the
capstone your function is the engine's attention, called once per sequence and layer.

Slots past the sequence's end hold NaN in the tests: read only the context_len keys.
"""
from __future__ import annotations

import torch

from minipaged.utils import cdiv  # noqa: F401  (blocks of a context: cdiv(context_len, block_size))


def online_softmax_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, context_len: int,
                             scale: float) -> torch.Tensor:
    """One sequence's causal attention, one block of its block table at a time (online softmax).

    q: (q_len, num_heads, head_dim), the queries of the sequence's last q_len tokens (query t
    sits at position context_len - q_len + t and sees keys 0 .. its own position).
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), already holding all
    context_len keys; logical block i of the sequence is physical block block_table[i].
    Returns (q_len, num_heads, head_dim) in q's dtype, equal to `paged_attention_reference`.

    The row of scores is never held whole: per block, with m the running max of the scores seen,
    l the running sum of exp(score - m) and acc the running sum of exp(score - m) * v,
        m_new = max(m, max(block scores));   alpha = exp(m - m_new)
        l     = l * alpha + sum(exp(block scores - m_new))
        acc   = acc * alpha + exp(block scores - m_new) @ V_block
    and at the end out = acc / l. Computes in fp32. GQA: query head h reads KV head
    h // (num_heads // num_kv_heads).
    """
    # Shapes that keep it short: q as (heads, q_len, dim); per block, K and V as (heads, n, dim)
    # (`repeat_interleave(group, dim=1)` gives every query head its KV head); scores
    # (heads, q_len, n); m and l (heads, q_len); acc (heads, q_len, dim).
    raise NotImplementedError("exercise: write online_softmax_attention")
