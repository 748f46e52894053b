"""Triton kernels for paged attention: store K/V into cache slots, then attend through block tables.

Lesson 05 (notebooks/05_paged_attention_kernel.ipynb) walks through this file top-down; the
readable definition it starts from is `minipaged/attention/torch_ref.py`, and
`tests/test_triton_kernels.py` proves the two agree. `triton_backend.py` calls these functions
once per layer.

Three kernels:

1. `store_kv_kernel`: one program per new token copies its K and V rows into cache slot
   `slot_mapping[t]` (block `slot // block_size`, offset `slot % block_size`); slot -1 is padding.
2. `paged_attention_kernel`: ONE kernel for decode and prefill. A program owns a tile of query
   rows of one sequence and one KV head, walks that sequence's block table tile by tile and keeps
   an online softmax (the flash-attention recurrence) in registers:

       rows of a tile = (query token, query head of this KV head)  pairs     (GQA packing)
       decode:  1 query token  x  the heads that share a KV head   (K/V read once for all of them)
       prefill: BLOCK_Q tokens x  those heads; causal, with the query offset of a cached prefix

   With `num_splits > 1` (flash-decoding / split-KV) the key range is cut into `num_splits` parts
   handled by different programs, so that a batch of one long sequence still fills the GPU;
   each part writes its own softmax-normalised result plus its log-sum-exp.
3. `reduce_splits_kernel`: merges those partial results, weighting each by its share of the
   softmax mass.

Shapes (the vLLM Triton-backend layout, see worker/kv_cache.py):

    q            (num_tokens, num_heads, head_dim)          any dtype, last dim contiguous
    k, v         (num_tokens, num_kv_heads, head_dim)       this step's new keys/values
    k/v_cache    (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables (num_seqs, max_blocks_per_seq) int32, context_lens (num_seqs,) int32,
    cu_seqlens_q (num_seqs + 1,) int32, slot_mapping (num_tokens,) int64

Rules every kernel here follows (they bite otherwise):
* `tl.arange` sizes are powers of two: head_dim is padded to `HEAD_DIM_PAD` (>= 16) and masked.
* block ids are cast to int64 before they are multiplied by strides (a cache over 2 GiB overflows
  int32 offsets).
* on the GPU, `tl.dot` needs every dimension >= 16: tiles have >= 16 rows and keys, and head_dim
  is padded to >= 16 (stories260K has head_dim 8).
* scores, softmax and accumulators are fp32. Under the CPU interpreter (TRITON_INTERPRET=1, which
  must be set before this module is imported) the dot operands are upcast to fp32 too, because the
  interpreter mishandles bf16 arithmetic; on the GPU bf16/fp16 operands go to the tensor cores
  with fp32 accumulation, and fp32 caches use exact ("ieee") fp32 dots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from minipaged.kernel_launch import launch_pdl, wait_for_previous_kernel
from minipaged.utils import check_last_dim_contiguous, last_dim_contiguous
from minipaged.worker.kv_dtype import is_fp8, to_cache_dtype


# --------------------------------------------------------------------------------------------
# 1. store_kv: the new tokens' K and V go to their slots
# --------------------------------------------------------------------------------------------
@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr,  # (num_tokens, num_kv_heads, head_dim)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping_ptr,  # (num_tokens,) int64, -1 = padding token: nothing to store
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_slot, stride_c_head,  # the K and V caches share one layout
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE  # physical block ...
    offset = slot % BLOCK_SIZE  # ... and the row inside it
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # One (KV_HEADS_PAD, HEAD_DIM_PAD) tile per token; padding tokens and padded lanes are masked.
    mask = (slot >= 0) & (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst = block * stride_c_block + offset * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `k`, `v` (num_tokens, num_kv_heads, head_dim) into the caches at `slot_mapping`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.dtype != k_cache.dtype:  # the model may run in another dtype than the cache (fp8)
        k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )


# --------------------------------------------------------------------------------------------
# 2. paged attention: one program = (tile of query rows of one sequence, one KV head, one split)
# --------------------------------------------------------------------------------------------
@triton.jit
def _attend_key_tile(
    acc, l_i, m_i,  # running state of the online softmax: (BLOCK_M, HEAD_DIM_PAD), (BLOCK_M,) x2
    q,  # (BLOCK_M, HEAD_DIM_PAD) the tile's queries
    q_pos,  # (BLOCK_M,) absolute position of each query row
    kv_start, kv_end,  # this key tile starts at position kv_start; keys >= kv_end don't exist
    block_table_row,  # pointer to this sequence's row of the block table
    k_cache_ptr, v_cache_ptr, kv_head,
    stride_c_block, stride_c_slot, stride_c_head,
    offs_d, qk_scale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,  # False: every row sees every key of this tile, no masks at all
    FP32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CAST_KV: tl.constexpr,  # a float8 cache: K/V tiles are widened to q's dtype for the dots
):
    # -- the block-table walk: logical key position -> (physical block, offset) ---------------
    offs_n = kv_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions of this tile
    if MASKED:
        n_mask = offs_n < kv_end
    if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies inside one block: one block-table entry
        block_ids = tl.load(block_table_row + kv_start // BLOCK_SIZE)
    elif MASKED:
        block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)  # int64 before multiplying by a stride
    kv_offs = (block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot
               + kv_head * stride_c_head)  # (BLOCK_N,) where each key row starts
    kv_ptrs = kv_offs[:, None] + offs_d[None, :]  # (BLOCK_N, HEAD_DIM_PAD)
    # -- load the K and V tiles (masked lanes read 0: never garbage that could be NaN) --------
    if MASKED:
        if HEAD_DIM_PAD == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM_PAD != HEAD_DIM:
        d_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_cache_ptr + kv_ptrs, mask=d_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=d_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_ptrs)
        v = tl.load(v_cache_ptr + kv_ptrs)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif CAST_KV:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    # -- scores, in log2 units: s = q k^T * scale * log2(e) -----------------------------------
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
    if MASKED:  # causal (key <= query position) and past-the-end keys
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    # -- online softmax: rescale what we have by exp2(m_old - m_new), add this tile -----------
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet: no NaN
    p = tl.exp2(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N) unnormalised probabilities
    alpha = tl.exp2(m_i - m_safe)  # (BLOCK_M,) how much the old maximum overestimated
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# The two ints vary from step to step: compiling a variant for each value would stall serving.
# The metadata pointers may point into the middle of a step's tensors (a mixed step attends in two
# launches over slices of its sequences) and are only read element by element: no variants for
# their alignment either.
@triton.jit(do_not_specialize=["num_q_tiles", "num_splits", "block_tables_ptr",
                               "context_lens_ptr", "cu_seqlens_q_ptr"])
def paged_attention_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim): written when not SPLIT
    partial_out_ptr,  # (num_tokens, num_heads, num_splits, head_dim) fp32: when SPLIT
    partial_lse_ptr,  # (num_tokens, num_heads, num_splits) fp32 log2-sum-exp2 of each part
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,
    qk_scale,  # softmax scale * log2(e): we use exp2, which is what the hardware has
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq,
    num_q_tiles,  # query tiles per sequence in the grid (cdiv(max_query_len, BLOCK_Q))
    num_splits,  # parts the key range is cut into (grid axis 2)
    QUERIES_PER_KV: tl.constexpr,  # GQA group: query heads that share one KV head
    GROUP_PAD: tl.constexpr,  # that group padded to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # keys per tile (any power of two; pages are gathered row by row)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for reduce_splits_kernel
    FP32_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, CAST_KV: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernel_launch.py)
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    wait_for_previous_kernel(USE_PDL)
    # -- which work is mine -------------------------------------------------------------------
    pid = tl.program_id(0)
    seq = pid // num_q_tiles
    q_tile = num_q_tiles - 1 - pid % num_q_tiles  # late tiles (most keys) start first
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)  # first token of this sequence in the flat batch
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest query; shorter sequences have spare tiles
    ctx_len = tl.load(context_lens_ptr + seq)  # keys in the cache, this step's included

    # -- the tile's rows: (query token, head in group) pairs ------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # (BLOCK_M,) query token within the sequence
    head = kv_head * QUERIES_PER_KV + offs_m % GROUP_PAD  # (BLOCK_M,) query head
    row_valid = (tok < q_len) & (offs_m % GROUP_PAD < QUERIES_PER_KV)
    q_pos = ctx_len - q_len + tok  # (BLOCK_M,) absolute position: the causal offset
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :], mask=q_mask, other=0.0)  # (BLOCK_M, HEAD_DIM_PAD)
    if FP32_DOT:
        q = q.to(tl.float32)

    # -- which keys: [0, kv_end), cut into tiles of BLOCK_N, then into num_splits parts --------
    first_pos = ctx_len - q_len + q_tile * BLOCK_Q  # position of the tile's first query
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx_len)  # one past the tile's last query position
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    # Keys 0..first_pos are visible to every row: those whole tiles need no mask at all.
    unmasked_tiles = (first_pos + 1) // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - max)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)  # running sum of p * V
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    # Phase 1: tiles below the diagonal, no masks.  Phase 2: the diagonal / last partial tile.
    for tile in range(tile_lo, tl.minimum(tile_hi, unmasked_tiles)):
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, q, q_pos, tile * BLOCK_N, kv_end, block_table_row,
            k_cache_ptr, v_cache_ptr, kv_head, stride_c_block, stride_c_slot, stride_c_head,
            offs_d, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD,
            False, FP32_DOT, DOT_PRECISION, CAST_KV)
    for tile in range(tl.maximum(tile_lo, unmasked_tiles), tile_hi):
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, q, q_pos, tile * BLOCK_N, kv_end, block_table_row,
            k_cache_ptr, v_cache_ptr, kv_head, stride_c_block, stride_c_slot, stride_c_head,
            offs_d, qk_scale, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD,
            True, FP32_DOT, DOT_PRECISION, CAST_KV)

    # -- write: normalise, or leave a partial result for reduce_splits_kernel ------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split has l = 0
    out = acc / l_safe[:, None]
    token = (q_start + tok).to(tl.int64)
    if not SPLIT:
        o_ptrs = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        num_heads = tl.num_programs(1) * QUERIES_PER_KV
        row = (token * num_heads + head) * num_splits + split  # (BLOCK_M,) index into partials
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


# --------------------------------------------------------------------------------------------
# 3. merge the split-KV parts: out = sum_s w_s * out_s / sum_s w_s, w_s = exp2(lse_s - max lse)
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["first_token"])  # varies from step to step (see above)
def reduce_splits_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim)
    partial_out_ptr,  # (num_tokens, num_heads, NUM_SPLITS, head_dim) fp32
    partial_lse_ptr,  # (num_tokens, num_heads, NUM_SPLITS) fp32
    stride_o_tok, stride_o_head,
    first_token,  # program i merges token first_token + i (a launch over some of the sequences)
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = first_token + tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * tl.num_programs(1) + head
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits)  # (NUM_SPLITS,)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row (no keys at all): output 0, not NaN
    weight = tl.exp2(lse - m)  # an empty part has lse = -inf: weight 0
    part = tl.load(partial_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM
                   + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    total = tl.sum(weight, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(weight[:, None] * part, axis=0) / total  # (HEAD_DIM_PAD,)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------------
# Launch configuration and the Python entry point
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch knobs of `paged_attention_kernel` (tuned on an H200, see
    benchmarks/attention.py)."""

    block_m: int  # query rows per tile (>= 16 on the GPU), = block_q * group_pad
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, group: int, interpret: bool) -> KernelConfig:
    """Decode: one query token per sequence, so one tile holds just the heads of one KV head.

    Memory-bound. On decode steps shaped like a serving workload
    (benchmarks/experiments/attention_tiles/attention_workload.py: 256 down to 36 sequences,
    contexts of 100-2,000 keys, H200), tiles of 128 keys on 4 warps with num_stages=2 read fastest:
    3.72 / 3.84 / 3.67 / 3.54 / 2.98 TB/s at 256 / 196 / 118 / 83 / 36 sequences; 8 warps, 3 stages,
    64-key tiles and split-KV at the small batches were all slower.
    The compiled kernel keeps one K and one V tile in shared memory (72 KB) and uses 168 registers
    per thread: 3 programs per SM, 12 warps (Nsight Compute: 82% of DRAM peak at 256 sequences,
    69% at 36, where fewer programs than SM slots are left). Blocks of 128 tokens read 3-4%
    faster than blocks of 16 (fewer, longer runs of memory; a tile then needs one block-table
    entry).
    """
    rows = max(16, triton.next_power_of_2(group))
    if interpret:  # big tiles = few Python-level loop iterations in the interpreter
        return KernelConfig(block_m=rows, block_n=64, num_warps=1, num_stages=1)
    if head_dim > 128:
        return KernelConfig(block_m=rows, block_n=32, num_warps=4, num_stages=3)
    return KernelConfig(block_m=rows, block_n=128, num_warps=4, num_stages=2)


def prefill_config(head_dim: int, group: int, max_query_len: int, interpret: bool) -> KernelConfig:
    """Prefill / mixed steps: tiles of several query tokens times the group's heads.

    Long prompts are compute-bound: 128-row x 128-key tiles on 8 warps (358 TFLOP/s on an
    8192-token prompt, H200); when they leave the GPU half empty, split-KV fills it.
    """
    group_pad = triton.next_power_of_2(group)
    rows = max(16, group_pad, min(128, triton.next_power_of_2(max_query_len) * group_pad))
    if interpret:
        return KernelConfig(block_m=rows, block_n=64, num_warps=1, num_stages=1)
    if rows <= 32:  # a few query tokens per sequence: memory-bound like decode
        return KernelConfig(block_m=rows, block_n=64 if head_dim <= 128 else 32,
                            num_warps=2 if rows == 16 else 4, num_stages=3)
    if head_dim > 128:
        return KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if rows == 64:
        return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


def choose_num_splits(num_programs: int, max_context_len: int, config: KernelConfig,
                      num_sms: int, max_splits: int = 64) -> int:
    """Split-KV factor: enough programs to fill the GPU, at least one key tile per split.

    `num_programs` is what the grid has without splitting (sequences x query tiles x KV heads).
    About 8 warps of these programs fit on an SM at once (registers): 4 two-warp decode programs,
    1 eight-warp prefill program. On an H200 (132 SMs) a decode batch of 1 is cut into 64 parts,
    16 into 4, 64 and more not at all (benchmarks/attention.py --sweep). A power of two, so the
    reduction kernel's `tl.arange` needs no padding.
    """
    target = num_sms * max(1, 8 // config.num_warps)
    tiles = triton.cdiv(max_context_len, config.block_n)
    splits = min(target // max(num_programs, 1), tiles, max_splits)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)  # round down to a power of two


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *, num_seqs: int,
                    max_query_len: int, config: KernelConfig, num_splits: int = 1,
                    out: Optional[torch.Tensor] = None,
                    workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                    tokens: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Attention of `q` over the paged cache (which already holds this step's K/V).

    Host-side ints only (`num_seqs`, `max_query_len`, `num_splits`): no device->host sync, so a
    decode step can be captured in a CUDA graph. Returns (num_tokens, num_heads, head_dim).
    `tokens` = (first, end): the rows of `q` that these sequences own, when the launch covers only
    some of the step's sequences (the other rows of `out` are left alone); default all.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} KV heads"
    assert config.block_m % group_pad == 0 and num_splits & (num_splits - 1) == 0
    q = last_dim_contiguous(q)
    check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    block_q = config.block_m // group_pad
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    if num_splits > 1:
        if workspace is None:
            workspace = split_workspace(num_tokens, num_heads, head_dim, num_splits, q.device)
        partial_out, partial_lse = workspace
    else:
        partial_out = partial_lse = out  # unused
    interpret = q.device.type == "cpu"
    fp8_cache = is_fp8(k_cache.dtype)  # widened to q's bf16/fp16 in the kernel
    fp32_dot = (interpret or k_cache.dtype == torch.float32 or q.dtype == torch.float32
                or (q.dtype != k_cache.dtype and not fp8_cache))
    grid = (num_seqs * num_q_tiles, num_kv_heads, num_splits)
    pdl = launch_pdl(q.device)
    paged_attention_kernel[grid](
        out, partial_out, partial_lse, q, k_cache, v_cache,
        block_tables, context_lens, cu_seqlens_q,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_q_tiles, num_splits,
        QUERIES_PER_KV=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=config.block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), SPLIT=num_splits > 1,
        FP32_DOT=fp32_dot, DOT_PRECISION="ieee" if fp32_dot else "tf32", CAST_KV=fp8_cache,
        USE_PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )
    if num_splits > 1:
        first, end = tokens or (0, num_tokens)
        reduce_splits_kernel[(end - first, num_heads)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1), first,
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=1 if interpret else 2,
        )
    return out


def split_workspace(num_tokens: int, num_heads: int, head_dim: int, num_splits: int,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 buffers for the split-KV partial results and their log-sum-exps."""
    return (torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                        device=device),
            torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=device))

