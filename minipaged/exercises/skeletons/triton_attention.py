"""Stage 9, `triton_attention` (lesson 05): the Triton kernels, from the store to the merge.

Write three Triton functions of minipaged/attention/triton_kernels.py: `store_kv_kernel` (one
program per new token copies its K and V rows into their cache slot), `_attend_key_tile` (one
tile of keys in the attention kernel: the block-table walk, the scores, the online-softmax
update) and `reduce_splits_kernel` (split-KV: merge the parts of a long key range). While the
grader runs, yours replace the real ones: `store_kv` launches your store kernel,
`paged_attention_kernel` calls your tile function for every tile of keys, and
`paged_attention` launches your merge after a split launch. On a
machine without a GPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, which the
graders set): slow, but exact, and a Python exception inside a kernel shows where it happened.
Grade them with

    minipaged exercise check triton_attention

Needs from stage 8 (online_softmax): the same recurrence, now on a (BLOCK_M, BLOCK_N) tile of
scores in registers, in log2 units (`qk_scale` already holds log2(e): use `tl.exp2`). Read the
real kernel around them (`paged_attention_kernel`: which rows a program owns, q_pos, the two
phases of tiles) and lesson 05's sections 2 to 4 first.

Rules that bite (the module docstring of triton_kernels.py has them all): `tl.arange` sizes are
powers of two, so head_dim is padded to HEAD_DIM_PAD and masked; block ids are cast to int64
before they multiply a stride; masked lanes load 0 (`other=0.0`), never garbage that could be
NaN; the cache slots past a sequence's end hold NaN in the tests.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
    # Program `tl.program_id(0)` is one token. Its slot gives (block, offset); one
    # (KV_HEADS_PAD, HEAD_DIM_PAD) tile of K and one of V go from the token's rows to the
    # cache, with a mask for padding tokens (slot -1) and the padded heads and dims.
    raise NotImplementedError("exercise: write store_kv_kernel")


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
    # Returns (acc, l_i, m_new). The tile's key positions kv_start + arange(BLOCK_N); each one's
    # physical block from the block-table row, its row offset inside the block; load K and V
    # (BLOCK_N, HEAD_DIM_PAD) tiles (masked when MASKED, and for padded dims); widen them
    # (FP32_DOT: to fp32, CAST_KV: to q's dtype); scores tl.dot(q, tl.trans(k)) * qk_scale,
    # with -inf where a key is after its query's position or past kv_end (when MASKED); then
    # the online softmax in base 2: the new max, exp2 of the scores minus it (a row that has
    # seen no key yet must not give NaN), rescale l_i and acc by exp2(m_i - m_new), add the
    # tile. Pass `input_precision=DOT_PRECISION` to both dots.
    raise NotImplementedError("exercise: write _attend_key_tile")


@triton.jit(do_not_specialize=["first_token"])  # varies from step to step (see above)
def reduce_splits_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim)
    partial_out_ptr,  # (num_tokens, num_heads, NUM_SPLITS, head_dim) fp32
    partial_lse_ptr,  # (num_tokens, num_heads, NUM_SPLITS) fp32
    stride_o_tok, stride_o_head,
    first_token,  # program i merges token first_token + i (a launch over some of the sequences)
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # Program (i, head) merges token first_token + i, one head: row = token * num_heads + head
    # indexes the partials. out = sum_s w_s * out_s / sum_s w_s with w_s = exp2(lse_s - max
    # lse) (log2 units, as the attention kernel wrote them). An empty part has lse = -inf
    # (weight 0); a row with no keys at all must come out 0, not NaN. Mask the padded dims.
    raise NotImplementedError("exercise: write reduce_splits_kernel")
