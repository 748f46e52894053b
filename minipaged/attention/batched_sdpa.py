"""Paged attention as a few batched SDPA calls: the CPU's path for steps with a prompt chunk.

`torch_ref.py` is the definition (one sequence at a time, lesson 05); this file computes the same
attention without a Python loop over sequences. Per step it plans at most two groups of sequences
(decodes, whose query length is 1, and prefills), and per layer it runs one gather and one masked
SDPA per group. `CPUBackend` (cpu_backend.py) builds on it; `tests/test_torch_ref.py` checks it
against the definition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from minipaged.attention.metadata import AttentionBackend, AttentionMetadata
from minipaged.attention.torch_ref import slot_rows
from minipaged.utils import cdiv
from minipaged.worker.kv_dtype import raw, to_cache_dtype


@dataclass
class SDPAGroup:
    """Sequences attended together in one SDPA call (same padded query length)."""

    token_index: torch.Tensor  # (G, max_q) flat token index of each padded query row
    valid: Optional[torch.Tensor]  # (G, max_q) bool, None when no row is padding
    slots: torch.Tensor  # (G, max_ctx) cache slot of every key position (0 where past the end)
    mask: torch.Tensor  # (G, 1, max_q, max_ctx) bool: True = may attend
    bias: torch.Tensor  # (G, 1, max_q, max_ctx) the mask as 0 / -inf, added to the scores


@dataclass
class BatchedPlan:
    store_slots: torch.Tensor  # (num_valid_tokens,) slots to write
    store_tokens: Optional[torch.Tensor]  # token rows that are not padding (None: all of them)
    groups: list[SDPAGroup]
    identity_order: bool  # one group whose rows are exactly tokens 0..num_tokens-1


def build_group(metadata: AttentionMetadata, seq_ids: list[int]) -> SDPAGroup:
    """Plan one SDPA call for `seq_ids` (indices into the step's sequences)."""
    device = metadata.block_tables.device
    bs = metadata.block_size
    qlens = [metadata.query_lens[i] for i in seq_ids]
    ctx = [metadata.context_lens_host[i] for i in seq_ids]
    max_q, max_ctx = max(qlens), max(ctx)
    idx = torch.tensor(seq_ids, device=device, dtype=torch.long)
    q_len = torch.tensor(qlens, device=device)[:, None]  # (G, 1)
    ctx_len = metadata.context_lens[idx].long()[:, None]  # (G, 1)
    q_start = metadata.cu_seqlens_q[idx].long()[:, None]  # (G, 1)

    q_pos = torch.arange(max_q, device=device)[None, :]  # (1, max_q)
    valid = q_pos < q_len  # (G, max_q)
    token_index = torch.where(valid, q_start + q_pos, 0)
    # Absolute position of each query row; padding rows look at key 0 only (and are discarded).
    q_abs = torch.where(valid, ctx_len - q_len + q_pos, 0)  # (G, max_q)

    k_pos = torch.arange(max_ctx, device=device)  # (max_ctx,)
    tables = metadata.block_tables[idx].long()  # (G, max_blocks)
    n_blocks = cdiv(max_ctx, bs)
    blocks = tables[:, :n_blocks].repeat_interleave(bs, dim=1)[:, :max_ctx]  # (G, max_ctx)
    slots = blocks * bs + (k_pos % bs)[None, :]
    mask = (k_pos[None, None, :] <= q_abs[:, :, None]) & (k_pos[None, None, :] < ctx_len[:, :, None])
    mask = mask[:, None]  # (G, 1, max_q, max_ctx)
    # SDPA turns a bool mask into this float one on every call; once per step is enough
    bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
    return SDPAGroup(token_index=token_index, valid=None if bool(valid.all()) else valid,
                  slots=slots, mask=mask, bias=bias)


class BatchedSDPABackend(AttentionBackend):
    """`torch_ref`'s attention, batched: one gather and one masked SDPA per group per layer."""

    name = "batched_sdpa"

    def prepare(self, metadata: AttentionMetadata) -> None:
        decodes = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        prefills = [i for i, n in enumerate(metadata.query_lens) if n > 1]
        groups = [build_group(metadata, ids) for ids in (decodes, prefills) if ids]
        slot_mapping = metadata.slot_mapping
        keep = slot_mapping >= 0
        all_valid = bool(keep.all())
        identity = (len(groups) == 1 and groups[0].valid is None
                    and groups[0].token_index.numel() == metadata.num_tokens)  # rows in token order
        metadata.plan = BatchedPlan(
            store_slots=slot_mapping if all_valid else slot_mapping[keep],
            store_tokens=None if all_valid else keep.nonzero().squeeze(1),
            groups=groups, identity_order=identity)

    def store_kv(self, k, v, k_cache, v_cache, metadata):
        """Each new token's K/V goes to its slot (padding tokens are skipped)."""
        plan: BatchedPlan = metadata.plan
        k_flat, v_flat = slot_rows(k_cache), slot_rows(v_cache)
        if plan.store_tokens is not None:
            k, v = k[plan.store_tokens], v[plan.store_tokens]
        k_flat.index_copy_(0, plan.store_slots, raw(to_cache_dtype(k, k_cache.dtype)))
        v_flat.index_copy_(0, plan.store_slots, raw(to_cache_dtype(v, v_cache.dtype)))

    def attend(self, q, k_cache, v_cache, metadata, scale):
        """One gather and one masked SDPA per group of sequences."""
        plan: BatchedPlan = metadata.plan
        num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
        group = num_heads // num_kv_heads  # query heads per KV head (GQA)
        k_flat, v_flat = slot_rows(k_cache), slot_rows(v_cache)
        out = q.new_empty(q.shape) if not plan.identity_order else None
        for g in plan.groups:
            if plan.identity_order:  # rows already in order: a view, no gather
                qg = q.view(g.token_index.shape + q.shape[1:])
            else:
                qg = q[g.token_index]  # (G, max_q, heads, dim)
            G, max_q = g.token_index.shape
            ctx = g.slots.shape[1]
            # GQA: the `group` query heads that read one KV head become `group` times as many
            # query rows of that head, so SDPA runs one problem per KV head and reads its K/V
            # once, instead of once per query head with enable_gqa=True (the Triton decode
            # kernel packs heads the same way; benchmarks/README.md has what it saved).
            # Row t * group + j of KV head h is query position t of query head h * group + j;
            # the rows of one position share its mask row (a view when max_q is 1, a decode).
            qg = (qg.view(G, max_q, num_kv_heads, group, head_dim).transpose(1, 2)
                  .reshape(G, num_kv_heads, max_q * group, head_dim))  # (G, kv_heads, rows, dim)
            bias = (g.bias[:, :, :, None, :].expand(G, 1, max_q, group, ctx)
                    .reshape(G, 1, max_q * group, ctx))  # (G, 1, rows, max_ctx)
            # index_select on the flat slot list is much faster than 2-D fancy indexing
            kg = k_flat.index_select(0, g.slots.view(-1)).view(G, ctx, num_kv_heads, head_dim)
            vg = v_flat.index_select(0, g.slots.view(-1)).view(G, ctx, num_kv_heads, head_dim)
            kg = kg.view(k_cache.dtype).transpose(1, 2).to(q.dtype)  # (G, kv_heads, max_ctx, dim)
            vg = vg.view(v_cache.dtype).transpose(1, 2).to(q.dtype)
            bias = bias.to(q.dtype)  # a no-op for fp32 models
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias, scale=scale)
            og = (og.view(G, num_kv_heads, max_q, group, head_dim).transpose(1, 2)
                  .reshape(G, max_q, num_heads, head_dim))  # (G, max_q, heads, dim)
            if plan.identity_order:
                return og.reshape(q.shape)
            if g.valid is None:
                out[g.token_index.flatten()] = og.flatten(0, 1)
            else:
                out[g.token_index[g.valid]] = og[g.valid]
        return out
