"""The CPU attention backend (`attention_backend="cpu"`, the default on the CPU): `torch_ref` with
a paged decode path for steps in which every sequence decodes one token.

Lesson 05 reads `torch_ref.py`, the definition; this file is what the CPU runs, and
`tests/test_cpu_backend.py` checks it against that definition and against HF's greedy tokens.
Steps with a prompt chunk in them (prefills, chunked prefill, speculative verification) go
through `BatchedSDPABackend` (batched_sdpa.py) unchanged; a decode-only step, nearly every step of a generation,
takes the path below. It computes the same attention with fewer and cheaper ops:

* Whole blocks are gathered, not slots: each sequence's block-table row *is* the gather index
  (no slot arithmetic per step), and the keys past a sequence's length are masked by the bias.
  The plan (`plan_chunks`) is made once per step, by the first layer, for all of them.
* Small KV heads are packed block-diagonally. With head_dim 8 (stories260K) the per-head SDPA
  problems are so small that their count, not their arithmetic, sets the time. When
  `num_kv_heads * head_dim <= BLOCK_DIAGONAL_MAX_WIDTH`, the query rows of all heads of one
  sequence go into one problem whose head_dim is `num_kv_heads * head_dim`: query head h keeps
  its values in the columns of its KV head and zeros elsewhere, so its dot products with a
  gathered key row (all KV heads side by side, as the cache stores them) are exactly its own
  head's, and its output is read from its KV head's columns (the diagonal blocks). One problem
  per sequence instead of one per KV head: num_kv_heads times the multiply-adds, a quarter of
  the problems for stories260K, and the gathered K/V need no transpose.
* The batch is attended in chunks of sequences whose gathered K/V fit in the core's L2 cache
  (`GATHER_CHUNK_BYTES`), gathered into two buffers reused by every chunk and every layer: the
  gather's writes are still in L2 when SDPA reads them, instead of a round trip through memory
  (64 sequences x 200 keys: K and V of one layer are 3.2 MB). The sequences are sorted by
  context length first, so that each chunk pads only to its own longest context.

benchmarks/README.md has what each step saved; `EngineConfig.resolve` picks this backend on the
CPU, once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from minipaged.attention.metadata import AttentionMetadata
from minipaged.attention.batched_sdpa import BatchedSDPABackend
from minipaged.utils import cdiv
from minipaged.worker.kv_dtype import raw, to_cache_dtype

# KV heads packed block-diagonally up to this many values per key row (num_kv_heads * head_dim):
# measured at stories260K's 4 x 8; wider rows keep torch_ref's packing (one problem per KV head).
BLOCK_DIAGONAL_MAX_WIDTH = 32
# Gathered K + V of one chunk of sequences: at most this many bytes (a quarter of a 2 MiB L2).
GATHER_CHUNK_BYTES = 1 << 19


@dataclass
class DecodeChunk:
    """Sequences attended in one SDPA call (positions start:end of the step's length order),
    with views into the step's buffers, made once for all layers."""

    start: int
    end: int
    blocks: torch.Tensor  # (m * max_blocks,) int64: the sequences' block-table rows, end to end
    k_rows: torch.Tensor  # (m * max_blocks, block_size * width): the gather's destination
    v_rows: torch.Tensor
    k: torch.Tensor  # the same memory as SDPA reads it
    v: torch.Tensor
    queries: torch.Tensor  # the chunk's packed query rows
    mask: torch.Tensor  # 0 for a key in the sequence's context, -inf past its end


@dataclass
class DecodePlan:
    """One decode-only step, shared by every layer. The chunks are planned by the first layer's
    `attend`, which knows the cache's geometry and the model's dtype."""

    metadata: AttentionMetadata
    chunks: list = field(default_factory=list)
    order: Optional[torch.Tensor] = None  # (num_seqs,) the sequences by context length
    q: Optional[torch.Tensor] = None  # block-diagonal packing: (num_seqs, 1, heads, width)
    q_diagonal: Optional[torch.Tensor] = None  # its diagonal blocks (num_seqs, group, dim, kv)


def decode_chunks(context_lens: list[int], block_size: int, block_bytes: int,
                  budget: int = GATHER_CHUNK_BYTES) -> tuple[list[int], list[tuple]]:
    """Sequences in order of context length, cut into (start, end, max_blocks) chunks whose
    gathered K and V (`2 * block_bytes` per block of each sequence) fit in `budget` bytes (at
    least one sequence per chunk). Each chunk is padded to its own longest context."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    chunks: list[tuple[int, int, int]] = []
    start = 0
    for i, seq in enumerate(order):
        blocks = cdiv(context_lens[seq], block_size)  # the longest so far: the order is sorted
        if i > start and (i - start + 1) * 2 * blocks * block_bytes > budget:
            chunks.append((start, i, cdiv(context_lens[order[i - 1]], block_size)))
            start = i
    chunks.append((start, len(order), cdiv(context_lens[order[-1]], block_size)))
    return order, chunks


def block_diagonal(kv_heads: int, head_dim: int) -> bool:
    """Pack the query heads block-diagonally (one SDPA problem per sequence)?"""
    return kv_heads > 1 and kv_heads * head_dim <= BLOCK_DIAGONAL_MAX_WIDTH


class CPUBackend(BatchedSDPABackend):
    name = "cpu"

    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.max_query_len != 1 or metadata.num_tokens != metadata.num_seqs:
            return super().prepare(metadata)  # prompt chunks or padding tokens: batched SDPA
        metadata.plan = DecodePlan(metadata)

    def store_kv(self, k, v, k_cache, v_cache, metadata):
        if not isinstance(metadata.plan, DecodePlan):
            return super().store_kv(k, v, k_cache, v_cache, metadata)
        slots = metadata.slot_mapping  # one new token per sequence, none of them padding
        _rows(k_cache).index_copy_(0, slots, raw(to_cache_dtype(k, k_cache.dtype)))
        _rows(v_cache).index_copy_(0, slots, raw(to_cache_dtype(v, v_cache.dtype)))

    def attend(self, q, k_cache, v_cache, metadata, scale):
        plan = metadata.plan
        if not isinstance(plan, DecodePlan):
            return super().attend(q, k_cache, v_cache, metadata, scale)
        if not plan.chunks:
            plan_chunks(plan, q, k_cache)
        num_blocks, bs, kv_heads, head_dim = k_cache.shape
        n, heads = q.shape[0], q.shape[1]
        group = heads // kv_heads
        diagonal = plan.q is not None
        if plan.order is not None:
            q = q.index_select(0, plan.order)
        if diagonal:  # query head h = kv * group + j into the columns of KV head kv
            plan.q_diagonal.copy_(q.view(n, kv_heads, group, head_dim).permute(0, 2, 3, 1))
        k_blocks = raw(k_cache).view(num_blocks, -1)  # one row per block
        v_blocks = raw(v_cache).view(num_blocks, -1)
        outs = []
        for c in plan.chunks:
            torch.index_select(k_blocks, 0, c.blocks, out=c.k_rows)
            torch.index_select(v_blocks, 0, c.blocks, out=c.v_rows)
            k, v = c.k, c.v
            if k_cache.dtype != q.dtype:  # fp8 cache: the bytes as float8, then the model's dtype
                k, v = k.view(k_cache.dtype).to(q.dtype), v.view(v_cache.dtype).to(q.dtype)
            queries = c.queries if diagonal else (
                q[c.start:c.end].view(-1, kv_heads, group, head_dim))  # (m, kv_heads, group, dim)
            o = F.scaled_dot_product_attention(queries, k, v, attn_mask=c.mask, scale=scale)
            if diagonal:  # (m, 1, heads, width) -> each head's output from its KV head's columns
                o = (o.view(-1, kv_heads, group, kv_heads, head_dim).diagonal(dim1=1, dim2=3)
                     .permute(0, 3, 1, 2))  # (m, kv_heads, group, dim)
            outs.append(o)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (n, kv_heads, group, dim)
        if plan.order is not None:  # back from the length order to the step's
            out = out.new_empty(out.shape).index_copy_(0, plan.order, out)
        return out.reshape(n, heads, head_dim)


def plan_chunks(plan: DecodePlan, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The step's chunks, gather buffers (sized for the largest chunk) and packed queries."""
    md = plan.metadata
    num_blocks, bs, kv_heads, head_dim = k_cache.shape
    n, heads, width = q.shape[0], q.shape[1], kv_heads * head_dim
    store = raw(k_cache)
    order, spans = decode_chunks(md.context_lens_host, bs, bs * width * store.element_size(),
                                 GATHER_CHUNK_BYTES)
    tables, lens = md.block_tables.long(), md.context_lens
    if len(spans) > 1 and order != list(range(n)):  # by length: each chunk pads to its longest
        plan.order = torch.tensor(order, device=tables.device)
        tables, lens = tables[plan.order], lens[plan.order]
    keys = torch.arange(spans[-1][2] * bs, device=tables.device)
    bias = torch.zeros(n, keys.shape[0], device=tables.device, dtype=q.dtype)
    bias = bias.masked_fill_(keys[None, :] >= lens[:, None], float("-inf"))[:, None, None]
    # bias: (n, 1, 1, keys), 0 for a key inside the sequence's context, -inf past its end
    rows = max((end - start) * max_blocks for start, end, max_blocks in spans)
    k_buf, v_buf = store.new_empty(rows, bs * width), store.new_empty(rows, bs * width)
    if block_diagonal(kv_heads, head_dim):
        plan.q = q.new_zeros(n, 1, heads, width)
        plan.q_diagonal = plan.q.view(n, kv_heads, heads // kv_heads, kv_heads,
                                      head_dim).diagonal(dim1=1, dim2=3)
    for start, end, max_blocks in spans:
        m, nkeys = end - start, max_blocks * bs
        k_rows, v_rows = k_buf[:m * max_blocks], v_buf[:m * max_blocks]
        mask = bias[start:end, ..., :nkeys]  # (m, 1, 1, keys)
        if plan.q is not None:  # (m, 1, keys, width): all KV heads side by side
            k, v = k_rows.view(m, 1, nkeys, width), v_rows.view(m, 1, nkeys, width)
            mask = mask.expand(m, 1, heads, nkeys)
            queries = plan.q[start:end]
        else:  # (m, kv_heads, keys, dim)
            k = k_rows.view(m, nkeys, kv_heads, head_dim).transpose(1, 2)
            v = v_rows.view(m, nkeys, kv_heads, head_dim).transpose(1, 2)
            queries = None
        plan.chunks.append(DecodeChunk(
            start, end, tables[start:end, :max_blocks].reshape(-1), k_rows, v_rows, k, v,
            queries, mask))


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks * block_size, kv_heads, dim): one row per slot; float8 is indexed as bytes."""
    return raw(cache).view(-1, cache.shape[2], cache.shape[3])
