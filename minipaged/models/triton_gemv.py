"""A GEMV kernel for the linear layers of a decode step: out = x W^T (+ bias) for a few rows.

A decode step multiplies one token per sequence, so with a few sequences running, each linear
layer is a matrix-vector product: x (M, K) with M = 1 or 2 against the weight W (N, K). Every weight
is read once and used M times, so the layer costs what reading W costs: Qwen3-0.6B's gate_up_proj
is 12.6 MB of bf16, 2.6 µs at the H200's 4.8 TB/s. In the one-stream profile
(benchmarks/experiments/decode_step/one_stream_h200.json) matrix multiplies were 910 of a step's
1,375 µs of GPU time, the largest per layer a 12.5 µs cuBLAS kernel; lesson 08
(notebooks/08_benchmark.ipynb) explains the fused layers this kernel joins. `skinny_linear` is
the product written as what it is: each program streams a block of W's rows along K, multiplies
by the M rows of x broadcast over it, and sums over K with `tl.sum` (`tl.dot` needs M >= 16 on
the GPU). `FusedLinear` (fused_layers.py) calls it for M <= SKINNY_MAX_ROWS, `F.linear` otherwise.

    skinny_linear(x, weight, bias=None, config=None) -> out
        x (M, K), 1 <= M <= SKINNY_MAX_ROWS; weight (N, K), rows contiguous (nn.Linear's layout);
        bias (N,) or None; out (M, N) in x.dtype, accumulated in fp32
    skinny_config(n, k, num_sms) -> SkinnyConfig(block_n, block_k, num_warps)

The launch (`skinny_config`), chosen from the weight's shape and the GPU's size alone:

    grid       cdiv(N, BLOCK_N) programs, each owning BLOCK_N output features (rows of W) for all
               M rows of x, so W is read from memory once whatever M is
    BLOCK_N    the largest power of two (at most MAX_BLOCK_N = 8) that still leaves
               PROGRAMS_PER_SM programs per SM: a GEMV has no data reuse to hide memory latency
               behind, only many loads in flight, so every SM needs programs of its own; N = 1024
               (o_proj, down_proj of Qwen3-0.6B) gets BLOCK_N = 2, 512 programs on 132 SMs
    BLOCK_K    fills a tile of TILE_ELEMENTS weights per loop iteration (8 KB of bf16) without
               passing K's next power of two, each row's chunk at least MIN_BLOCK_K = 128
               contiguous values: the more bytes a program asks for at once, the fewer round
               trips to memory
    num_warps  one per 512 weights of the tile (16 per thread), at most 8

On an H200 (benchmarks/experiments/decode_step/skinny_gemm_h200.json) this reads Qwen3-0.6B's
four layers in 16-18 us where cuBLAS takes 27-31 us for one or two rows; from three rows on
cuBLAS is as fast or faster, hence SKINNY_MAX_ROWS = 2. Tiles of 16 or 32 rows of W, or 4 warps
on the N = 1024 layers, were up to 20% slower there.

Determinism: the config depends on (N, K) and the SM count only, never on M or on timings (no
autotune), and each output is one program's fixed-order sum (no split-K, no atomics), so a
layer's result is the same on every run. Each row of x has its own accumulator, filled and
summed in the same order whatever M is, so a row's result does not depend on the others: a
decode step of 1 sequence gives the same bits eager and from the CUDA graph of 2.

All math is fp32 (`.to(tl.float32)` on every load: the CPU interpreter mishandles bf16
arithmetic), rounded once to x's dtype; launch shapes come from tensor shapes only (never
`.item()`), so CUDA graphs capture it. On the CPU it runs under TRITON_INTERPRET=1, set before
this module is imported; `tests/test_triton_gemv.py` checks it against F.linear in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from minipaged.attention.triton_backend import num_sms
from minipaged.kernel_launch import launch_pdl, wait_for_previous_kernel
from minipaged.utils import last_dim_contiguous

SKINNY_MAX_ROWS = 2  # the most rows of x `skinny_linear` takes (CUDA graphs of 1 and 2)
SKINNY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 stays with F.linear
PROGRAMS_PER_SM = 2  # at least this many programs per SM, where N has the rows for them
TILE_ELEMENTS = 4096  # weights one program loads per loop iteration
MIN_BLOCK_K = 128  # a row's chunk per iteration: 256 bytes of bf16, two 128-byte lines
MAX_BLOCK_N = 8  # rows of W per program


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output features (rows of W) per program
    block_k: int  # input features per loop iteration
    num_warps: int


def decoder_linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """The weight shapes (N, K) of a decoder layer's four linear layers (`cfg`: a ModelConfig),
    the shapes `skinny_config` is chosen for; tests and benchmarks read the presets through it."""
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv_proj": (q_size + 2 * kv_size, cfg.hidden_size),
            "o_proj": (cfg.hidden_size, q_size),
            "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}


@lru_cache(maxsize=None)
def skinny_config(n: int, k: int, num_sms: int) -> SkinnyConfig:
    """The launch for a weight of shape (n, k) on a GPU with `num_sms` SMs (module docstring)."""
    target = PROGRAMS_PER_SM * num_sms
    block_n = 1
    while block_n < MAX_BLOCK_N and triton.cdiv(n, 2 * block_n) >= target:
        block_n *= 2
    block_k = max(MIN_BLOCK_K, min(triton.next_power_of_2(k), TILE_ELEMENTS // block_n))
    num_warps = max(1, min(8, block_n * block_k // (32 * 16)))
    return SkinnyConfig(block_n, block_k, num_warps)


@triton.jit
def _fma_row(acc, w, x_ptr, row, M, stride_x, k, k_mask):
    """acc (BLOCK_N, BLOCK_K) + w (BLOCK_N, BLOCK_K) * x[row, k] broadcast over W's rows; a row
    past M reads zeros."""
    x = tl.load(x_ptr + row * stride_x + k, mask=k_mask & (row < M), other=0.0).to(tl.float32)
    return acc + w * x[None, :]


@triton.jit
def _store_row(out_ptr, row, M, stride_out, acc, bias, cols, col_mask):
    """out[row, cols] = the sum over K of acc (BLOCK_N, BLOCK_K), + bias, in out's dtype."""
    out = tl.sum(acc, axis=1) + bias  # (BLOCK_N,)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty),
             mask=col_mask & (row < M))


@triton.jit
def skinny_linear_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K), rows contiguous
    bias_ptr,  # (N,); unused without HAS_BIAS
    out_ptr,  # (M, N)
    M, N, K,
    stride_x, stride_w, stride_out,  # row strides; the last dims are contiguous
    BLOCK_M: tl.constexpr,  # next power of two >= M: 1 or 2 (one accumulator per row)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernel_launch.py)
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (rows of W)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w  # (BLOCK_N, 1)
    # The first tile of W is read before waiting for the kernel that wrote x: no kernel of a step
    # writes weights, so with PDL the weight stream starts while that kernel finishes. Each
    # iteration then asks for the next tile before it multiplies this one.
    w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < K)[None, :],
                other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_K), read once for every row of x
    wait_for_previous_kernel(USE_PDL)
    # Per row of x, the products summed element-wise over the K loop and reduced once at the
    # end: the loop body is loads and multiply-adds only, nothing waits on another thread.
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        next_k = k + BLOCK_K  # past K on the last iteration: fully masked, nothing is read
        w_next = tl.load(w_rows + next_k[None, :], mask=col_mask[:, None] & (next_k < K)[None, :],
                         other=0.0).to(tl.float32)
        acc0 = _fma_row(acc0, w, x_ptr, 0, M, stride_x, k, k_mask)
        if BLOCK_M > 1:
            acc1 = _fma_row(acc1, w, x_ptr, 1, M, stride_x, k, k_mask)
        w = w_next
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    _store_row(out_ptr, 0, M, stride_out, acc0, bias, cols, col_mask)
    if BLOCK_M > 1:
        _store_row(out_ptr, 1, M, stride_out, acc1, bias, cols, col_mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  config: Optional[SkinnyConfig] = None) -> torch.Tensor:
    """x W^T + bias for x (M, K) with 1 <= M <= SKINNY_MAX_ROWS, weight (N, K) (nn.Linear's
    layout, rows contiguous), bias (N,) or None -> (M, N) in x.dtype.

    `config`: the launch (benchmarks and tests try others); default `skinny_config` of the
    weight's shape and the GPU's SM count."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be (M, K) and "
                         "(N, K) with the same K")
    m, (n, k) = x.shape[0], weight.shape
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ValueError(f"x has {m} rows; skinny_linear takes 1 to SKINNY_MAX_ROWS = "
                         f"{SKINNY_MAX_ROWS} (use F.linear for more)")
    if weight.stride(1) != 1:
        raise ValueError(f"weight must have contiguous rows; got strides {tuple(weight.stride())}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({n},)")
    x = last_dim_contiguous(x)
    config = config or skinny_config(n, k, num_sms(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = launch_pdl(x.device)
    skinny_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None, USE_PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl)
    return out
