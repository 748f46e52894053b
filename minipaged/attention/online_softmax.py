"""Paged attention the way the Triton kernel computes it, in torch: an online softmax (lesson 05).

`online_softmax_attention` takes one sequence and walks its block table one block at a time with
a running max, sum and accumulator instead of one softmax over the whole row of scores (lesson
05, section 3). It equals the oracle, torch_ref.py's `paged_attention_reference`
(tests/test_torch_ref.py), and it is the build-it exercise of lesson 05
(`minipaged exercise check online_softmax`).
"""
from __future__ import annotations

import torch

from minipaged.utils import cdiv


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
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # (heads, q_len, dim)
    q_pos = context_len - q_len + torch.arange(q_len, device=q.device)  # (q_len,)
    m = torch.full((num_heads, q_len), float("-inf"), device=q.device)
    l = torch.zeros(num_heads, q_len, device=q.device)
    acc = torch.zeros(num_heads, q_len, head_dim, device=q.device)
    for i in range(cdiv(context_len, block_size)):
        block = int(block_table[i])
        n = min(block_size, context_len - i * block_size)  # keys in this block (the last: fewer)
        # (n, kv_heads, dim) -> (heads, n, dim): each query head reads its KV head
        k = k_cache[block, :n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = v_cache[block, :n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        s = qf @ k.transpose(1, 2) * scale  # (heads, q_len, n)
        k_pos = i * block_size + torch.arange(n, device=q.device)  # (n,)
        s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        # Block 0 holds key 0, which every query sees: m is finite from the first block on.
        m_new = torch.maximum(m, s.amax(dim=-1))  # (heads, q_len)
        alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
        p = torch.exp(s - m_new[..., None])  # (heads, q_len, n); masked keys give 0
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + p @ v  # (heads, q_len, dim)
        m = m_new
    return (acc / l[..., None]).transpose(0, 1).to(q.dtype)  # (q_len, heads, dim)
