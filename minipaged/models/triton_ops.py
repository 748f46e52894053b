"""Fused element-wise kernels for the Llama family: fewer, larger kernels per decoder layer.

Between its matrix multiplies a decoder layer does only element-wise work: residual adds, RMSNorm,
Qwen3's per-head q/k norm, RoPE, storing K/V into the paged cache, SiLU and a multiply. Written in
torch (`llama.py` with `fused_ops=False`) that is about twenty small kernels per layer, each
reading and writing its whole tensor; in a decode step those tensors are tiny, so the GPU spends
its time starting kernels and waiting for memory, not computing. Lesson 08
(notebooks/08_benchmark.ipynb) measures this: the element-wise kernels cost milliseconds per
decode step. With `fused_ops=True` a layer is

    fused_add_rms_norm -> qkv GEMM -> qkv_rope_store -> paged attention (backend.attend)
    -> o_proj GEMM -> fused_add_rms_norm -> gate_up GEMM -> silu_and_mul -> down GEMM

The kernels (vLLM's names; shapes as `# (dims)`):

    rms_norm(x, weight, eps) -> out
        x (num_tokens, hidden), weight (hidden,); out like x
    fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
        x, residual (num_tokens, hidden), weight (hidden,); new_residual = x + residual rounded to
        x.dtype (HF adds in the model dtype), out = rms_norm(new_residual) in fp32, cast to x.dtype
    silu_and_mul(x) -> out
        x (num_tokens, 2 * intermediate) = [gate | up]; out (num_tokens, intermediate) = silu(gate) * up
    qkv_rope_store(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, eps,
                   k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim) -> q
        qkv (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim): q heads, k heads, v heads
        positions (num_tokens,) int; cos, sin (max_positions, head_dim) fp32 (halves equal)
        q_norm_weight, k_norm_weight (head_dim,) or None (no per-head norm; Qwen3 has one)
        k_cache, v_cache (num_blocks, block_size, num_kv_heads, head_dim); slot_mapping (num_tokens,)
        q (num_tokens, num_heads, head_dim), returned; k and v go into the caches (slot -1: nowhere)

All math is fp32 (`.to(tl.float32)` on every load: the CPU interpreter mishandles bf16
arithmetic, and the GPU gains nothing from narrower math here), rounded once to the output dtype;
float64 inputs are computed in fp32 too, like the attention kernels. Launch shapes come from host
ints and tensor shapes only (never `.item()`), so CUDA graphs can capture every kernel here. On the
CPU they run under TRITON_INTERPRET=1, which must be set before this module is imported;
`tests/test_fused_ops.py` checks each kernel against torch and whole models against the unfused path.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minipaged.kernel_launch import launch_pdl, wait_for_previous_kernel
from minipaged.utils import check_last_dim_contiguous, last_dim_contiguous
from minipaged.worker.kv_dtype import FP8_MAX, is_fp8


def _num_warps(elements: int) -> int:
    """Warps for a program that touches `elements` values: enough threads, none idle."""
    return 1 if elements <= 256 else 4 if elements <= 2048 else 8


# --------------------------------------------------------------------------------------------
# 1. RMSNorm, optionally fused with the residual add before it
# --------------------------------------------------------------------------------------------
@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr,  # (num_tokens, hidden) each; residual unused without HAS_RESIDUAL
    weight_ptr,  # (hidden,)
    out_ptr, residual_out_ptr,  # (num_tokens, hidden) each
    stride_x, stride_r, stride_out, stride_r_out,  # row strides; the last dim is contiguous
    hidden, eps,
    BLOCK: tl.constexpr,  # next power of two >= hidden
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernel_launch.py)
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # one program per token
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # the sum is rounded to the model dtype before it is normalised, as HF's `residual + x`
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_r_out + cols, x, mask=mask)
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden  # padded lanes are 0: they add nothing
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * tl.rsqrt(mean_square + eps) * w
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    hidden = x.shape[-1]
    x2 = _rows(x)  # (num_tokens, hidden)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = r_out = None
    if residual is not None:
        r2, r_out = _rows(residual), torch.empty_like(out)
    if x2.shape[0] > 0:
        block, pdl = triton.next_power_of_2(hidden), launch_pdl(x.device)
        rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, r_out,
            x2.stride(0), 0 if r2 is None else r2.stride(0),
            out.stride(0), 0 if r_out is None else r_out.stride(0),
            hidden, eps, BLOCK=block, HAS_RESIDUAL=residual is not None,
            USE_PDL=pdl, num_warps=_num_warps(block), launch_pdl=pdl)
    out = out.view(x.shape)
    return out, None if r_out is None else r_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32, cast to x.dtype.

    x (..., hidden), weight (hidden,)."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel; it replaces the residual add and the
    norm's square / mean / rsqrt / multiply / weight kernels.

    x, residual (num_tokens, hidden), weight (hidden,); both results like x."""
    return _rms_norm(x, residual, weight, eps)


# --------------------------------------------------------------------------------------------
# 2. SiLU-and-multiply (SwiGLU's element-wise half)
# --------------------------------------------------------------------------------------------
@triton.jit
def silu_and_mul_kernel(
    x_ptr,  # (num_tokens, 2 * intermediate): [gate | up]
    out_ptr,  # (num_tokens, intermediate)
    stride_x, stride_out, intermediate,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernel_launch.py)
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # a program per (token, BLOCK columns)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # silu(g) = g * sigmoid(g)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] (num_tokens, 2 * intermediate) -> (num_tokens, intermediate).

    Replaces `chunk`, `F.silu` and the multiply (two kernels and an intermediate tensor)."""
    num_tokens, width = x.shape
    intermediate = width // 2
    x = last_dim_contiguous(x)
    out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block, pdl = min(triton.next_power_of_2(intermediate), 1024), launch_pdl(x.device)
        silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            x, out, x.stride(0), out.stride(0), intermediate, BLOCK=block,
            USE_PDL=pdl, num_warps=_num_warps(block), launch_pdl=pdl)
    return out


# --------------------------------------------------------------------------------------------
# 3. q/k norm + RoPE + store K/V: everything between the qkv GEMM and attention
# --------------------------------------------------------------------------------------------
@triton.jit
def _norm_rope(x1, x2, norm_weight_ptr, dims, dim_mask, cos, sin, eps,
               HEAD_DIM: tl.constexpr, HAS_QK_NORM: tl.constexpr):
    """Optional per-head RMSNorm, then HF's rotate_half RoPE, on a tile of heads.

    x1, x2: (HEADS_PAD, HALF_PAD) fp32, the first and second half of each head (padded lanes 0);
    dims, dim_mask: (HALF_PAD,) lanes of a half; cos, sin: (HALF_PAD,) this token's angles."""
    if HAS_QK_NORM:
        w1 = tl.load(norm_weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_weight_ptr + HEAD_DIM // 2 + dims, mask=dim_mask, other=0.0).to(tl.float32)
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        rstd = tl.rsqrt(mean_square + eps)[:, None]  # (HEADS_PAD, 1)
        x1 = x1 * rstd * w1[None, :]
        x2 = x2 * rstd * w2[None, :]
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def qkv_rope_store_kernel(
    qkv_ptr,  # (num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    positions_ptr,  # (num_tokens,)
    cos_ptr, sin_ptr,  # (max_positions, HEAD_DIM) fp32; the two halves of a row are equal
    q_norm_ptr, k_norm_ptr,  # (HEAD_DIM,) each; unused without HAS_QK_NORM
    q_out_ptr,  # (num_tokens, NUM_HEADS, HEAD_DIM)
    k_cache_ptr, v_cache_ptr,  # (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    slot_mapping_ptr,  # (num_tokens,), -1 = padding token: store nothing
    stride_qkv, stride_q_out, stride_cos,
    stride_c_block, stride_c_slot, stride_c_head,  # the K and V caches share one layout
    eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_QK_NORM: tl.constexpr,
    FP8_CACHE: tl.constexpr, FP8_MAX: tl.constexpr,  # a float8 cache clamps to +-FP8_MAX
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernel_launch.py)
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)  # one program per token: all its q, k and v heads
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF_PAD)  # lanes of one half of a head
    dim_mask = dims < HALF
    row = qkv_ptr + token.to(tl.int64) * stride_qkv

    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)

    # q heads: (HEADS_PAD, HALF_PAD) tiles of first and second halves, normed, rotated, written out
    heads = tl.arange(0, HEADS_PAD)
    q_mask = (heads[:, None] < NUM_HEADS) & dim_mask[None, :]
    q_offs = heads[:, None] * HEAD_DIM + dims[None, :]
    q1 = tl.load(row + q_offs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(row + q_offs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    q1, q2 = _norm_rope(q1, q2, q_norm_ptr, dims, dim_mask, cos, sin, eps, HEAD_DIM, HAS_QK_NORM)
    q_dst = q_out_ptr + token.to(tl.int64) * stride_q_out + q_offs
    tl.store(q_dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # k heads the same way, v as it is; both straight into cache slot `slot_mapping[token]`
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE  # physical block (int64: large caches overflow int32 offsets) ...
    offset = slot % BLOCK_SIZE  # ... and the row inside it
    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (slot >= 0) & (kv_heads[:, None] < NUM_KV_HEADS) & dim_mask[None, :]
    kv_offs = kv_heads[:, None] * HEAD_DIM + dims[None, :]
    k_src = row + NUM_HEADS * HEAD_DIM + kv_offs
    v_src = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_offs
    k1 = tl.load(k_src, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k1, k2 = _norm_rope(k1, k2, k_norm_ptr, dims, dim_mask, cos, sin, eps, HEAD_DIM, HAS_QK_NORM)
    dst = block * stride_c_block + offset * stride_c_slot + kv_heads[:, None] * stride_c_head + dims[None, :]
    cache_dtype = k_cache_ptr.dtype.element_ty
    v1 = tl.load(v_src, mask=kv_mask).to(tl.float32)
    v2 = tl.load(v_src + HALF, mask=kv_mask).to(tl.float32)
    if FP8_CACHE:  # float8 e4m3 (kv_cache_dtype="fp8"): clamp, or out-of-range values become NaN
        k1, k2 = tl.clamp(k1, -FP8_MAX, FP8_MAX), tl.clamp(k2, -FP8_MAX, FP8_MAX)
        v1, v2 = tl.clamp(v1, -FP8_MAX, FP8_MAX), tl.clamp(v2, -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + dst, k1.to(cache_dtype), mask=kv_mask)
    tl.store(k_cache_ptr + dst + HALF, k2.to(cache_dtype), mask=kv_mask)
    tl.store(v_cache_ptr + dst, v1.to(cache_dtype), mask=kv_mask)
    tl.store(v_cache_ptr + dst + HALF, v2.to(cache_dtype), mask=kv_mask)


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
                   eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """q/k RMSNorm (when the weights are given) + RoPE on q and k, K/V stored into their slots.

    Replaces, per layer: the split and views of qkv, Qwen3's two per-head norms and their `cat`,
    RoPE's roll / multiplies / add, and `store_kv`. Returns q (num_tokens, num_heads, head_dim)
    ready for `TritonBackend.attend`; shapes of every argument in the module docstring.
    """
    num_tokens = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qkv has {qkv.shape[1]} columns; expected (num_heads {num_heads} + 2 x "
                         f"num_kv_heads {num_kv_heads}) x head_dim {head_dim} with head_dim even")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("pass both q_norm_weight and k_norm_weight, or neither")
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    qkv, cos, sin = last_dim_contiguous(qkv), last_dim_contiguous(cos), last_dim_contiguous(sin)
    assert cos.stride() == sin.stride(), "cos and sin tables must share one layout"
    check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)  # written in place
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_qk_norm, pdl = q_norm_weight is not None, launch_pdl(qkv.device)
    half_pad = triton.next_power_of_2(head_dim // 2)
    qkv_rope_store_kernel[(num_tokens,)](
        qkv, positions, cos, sin, q_norm_weight, k_norm_weight, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HALF_PAD=half_pad,
        BLOCK_SIZE=k_cache.shape[1], HAS_QK_NORM=has_qk_norm,
        FP8_CACHE=is_fp8(k_cache.dtype), FP8_MAX=FP8_MAX, USE_PDL=pdl,
        num_warps=_num_warps((num_heads + 2 * num_kv_heads) * half_pad), launch_pdl=pdl,
    )
    return q


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, last dim) with a contiguous last dim (a view whenever possible)."""
    return last_dim_contiguous(x.reshape(-1, x.shape[-1]))

