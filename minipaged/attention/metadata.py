"""`AttentionMetadata`: everything attention needs to know about one engine step.

Built once per step by `model_runner.py` and passed *explicitly* down through the model to every
attention layer (lesson 03 prints one). A step is a flat batch of `num_tokens` new tokens that
belong to `num_seqs` sequences; sequence `i` owns tokens `cu_seqlens_q[i]:cu_seqlens_q[i+1]`.

    token t of sequence i sits at position  context_lens[i] - query_len_i + (t - cu_seqlens_q[i])
    its K/V are written to cache slot       slot_mapping[t] = block * block_size + offset
    and it attends to keys 0 .. its own position (causal), which live in the blocks
    block_tables[i, 0], block_tables[i, 1], ...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


# GPU block-table rows are padded to a multiple of this (gpu_model_runner.py, cuda_graphs.py):
# the row stride is a kernel argument, and Triton compiles a variant per divisibility by 16.
BLOCK_TABLE_WIDTH_MULTIPLE = 16


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token; -1 = padding
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32, padded with 0
    context_lens: torch.Tensor  # (num_seqs,) int32: tokens in the cache after this step
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32: prefix sums of query lengths
    query_lens: list[int]  # host copy of the query lengths (1 for a decode)
    context_lens_host: list[int]  # host copy of context_lens
    max_query_len: int
    max_context_len: int
    block_size: int
    num_decode_tokens: int = 0  # sequences with query length 1 (for the lessons' trace)
    # Backend-specific work shared by all layers of the step, filled by `AttentionBackend.prepare`.
    plan: Optional[Any] = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend:
    """Interface every backend implements (see `minipaged.attention`).

    Per step `prepare(metadata)` once (work shared by all layers); per layer `store_kv` (the
    step's new K/V into their slots; the model's `QKVRopeStore` calls it, or fuses it) then
    `attend` (the queries over the cache, which now holds this step's keys too).
    """

    name = "base"

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Per-step work shared by all layers; may set `metadata.plan`."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Write each new token's K/V to `metadata.slot_mapping[token]` (slot -1: padding).

        k, v: (num_tokens, num_kv_heads, head_dim)
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)
        """
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of the step's queries over the paged cache.

        q: (num_tokens, num_heads, head_dim); returns (num_tokens, num_heads, head_dim)
        """
        raise NotImplementedError
