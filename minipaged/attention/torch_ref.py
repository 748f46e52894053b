"""The reference attention backend: the readable *definition* of paged attention.

Lesson 05 starts from it, and it is the oracle every faster backend is tested against (the
batched CPU path in batched_sdpa.py and cpu_backend.py, the Triton kernels). For each sequence it
finds where its keys live through its block table, gathers them, and runs causal attention:

    slots  = block_table[pos // block_size] * block_size + pos % block_size   # logical -> physical
    K_seq  = k_cache.flatten(0, 1)[slots]                                     # (ctx, kv_heads, dim)
    out    = softmax(q K_seq^T * scale + causal_mask) V_seq

online_softmax.py computes the same thing the way the Triton kernel does (lesson 05).
"""
from __future__ import annotations

import torch

from minipaged.attention.metadata import AttentionBackend, AttentionMetadata
from minipaged.worker.kv_dtype import raw, to_cache_dtype


def slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks * block_size, kv_heads, dim): one row per slot; float8 is indexed as bytes."""
    return raw(cache).view(-1, cache.shape[2], cache.shape[3])


class TorchRefBackend(AttentionBackend):
    """`store_kv` writes each new token's K/V to its slot; `attend` is the loop below."""

    name = "torch_ref"

    def store_kv(self, k, v, k_cache, v_cache, metadata):
        keep = metadata.slot_mapping >= 0  # padding tokens have slot -1
        slots = metadata.slot_mapping[keep]
        slot_rows(k_cache).index_copy_(0, slots, raw(to_cache_dtype(k[keep], k_cache.dtype)))
        slot_rows(v_cache).index_copy_(0, slots, raw(to_cache_dtype(v[keep], v_cache.dtype)))

    def attend(self, q, k_cache, v_cache, metadata, scale):
        return paged_attention_reference(q, k_cache, v_cache, metadata, scale)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention over a cache that already holds this step's K/V, one sequence at a time.
    q: (num_tokens, heads, dim); returns the same shape."""
    out = torch.empty_like(q)
    bs = metadata.block_size
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    start = 0  # sequence i's queries are rows start .. start + q_len
    for i, (q_len, ctx) in enumerate(zip(metadata.query_lens, metadata.context_lens_host)):
        pos = torch.arange(ctx, device=q.device)
        slots = metadata.block_tables[i].long()[pos // bs] * bs + pos % bs
        ks = slot_rows(k_cache)[slots].view(k_cache.dtype).float()  # (ctx, kv_heads, dim)
        vs = slot_rows(v_cache)[slots].view(v_cache.dtype).float()
        ks = ks.repeat_interleave(group, dim=1).transpose(0, 1)  # (heads, ctx, dim)
        vs = vs.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[start:start + q_len].float().transpose(0, 1)  # (heads, q_len, dim)
        scores = qs @ ks.transpose(1, 2) * scale  # (heads, q_len, ctx)
        q_abs = ctx - q_len + torch.arange(q_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_abs[None, :, None], float("-inf"))
        out[start:start + q_len] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
        start += q_len
    return out
