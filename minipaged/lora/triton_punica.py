"""The shrink and expand of punica.py as Triton kernels: the CUDA path of multi-LoRA (lesson 11).

punica.py gathers every token's A and B, which reads an adapter's weights once *per token*. Here
the tokens are taken in slot order (PunicaWrapper.update sorts them), so a program owns a tile
of BLOCK_M tokens of one slot and reads each tile of that slot's weights once for all of them,
with `tl.dot` (the segmented SGMV of punica, as vLLM's lora_shrink / lora_expand kernels do):

    grid = (m_tiles * n_tiles, max_loras)     axis 1 = the slot; a program whose tile holds no
                                              token of its slot returns at once
    shrink   t[rows, n]   = x[rows, :] @ lora_a[slot, n, :].T               (fp32)
    expand   y[rows, out] += (t[rows, :] @ lora_b[slot, out, :].T) * scaling[slot]

`rows` are the tile's token indices, gathered from `sorted_token_ids`. Tokens without an adapter
are in no slot's segment and are left untouched. The grid depends only on the step's token
count and `max_loras`, and every per-step number is read from device buffers, so a decode step
replays from a CUDA graph. Per DESIGN notes: power-of-two tiles, slot and row indices widened to
int64 before the stride multiply, tiles of at least 16 for `tl.dot` on a GPU; fp32 inputs are
multiplied in full precision ("ieee"), half-precision ones on the tensor cores with fp32 sums.
On the CPU the kernels run under TRITON_INTERPRET=1 (set before this module is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, t_ptr, sorted_ptr, count_ptr, start_ptr,
                        N, K, stride_xm, stride_al, stride_an, stride_tm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_N_BLOCKS: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    pid_m = pid // NUM_N_BLOCKS
    pid_n = pid % NUM_N_BLOCKS
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:  # this slot has fewer tokens than this tile starts at
        return
    start = tl.load(start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        a = tl.load(a_base + offs_n[None, :].to(tl.int64) * stride_an + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(t_ptr + rows[:, None] * stride_tm + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, y_ptr, scale_ptr, sorted_ptr, count_ptr, start_ptr,
                        OUT, N, stride_tm, stride_bl, stride_bo, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_N_BLOCKS: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    pid_m = pid // NUM_N_BLOCKS
    pid_n = pid % NUM_N_BLOCKS
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_o = offs_o < OUT
    b_base = b_ptr + slot.to(tl.int64) * stride_bl
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < N
        t = tl.load(t_ptr + rows[:, None] * stride_tm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K) fp32
        b = tl.load(b_base + offs_o[None, :].to(tl.int64) * stride_bo + offs_k[:, None],
                    mask=mask_k[:, None] & mask_o[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if IEEE:
            acc += tl.dot(t, b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(t.to(b.dtype), b)
    acc = acc * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_o[None, :]
    mask = mask_m[:, None] & mask_o[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _pow2(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, sorted_token_ids: torch.Tensor,
             num_tokens_per_slot: torch.Tensor, slot_start: torch.Tensor) -> torch.Tensor:
    """punica.add_lora with the tokens given in slot order: y (num_tokens, out) += deltas.

    x: (num_tokens, in); lora_a: (max_loras, n, in); lora_b: (max_loras, out, n), last
    dimensions contiguous; scaling: (max_loras,) fp32; the other three from PunicaWrapper."""
    num_tokens, k = x.shape
    max_loras, n, _ = lora_a.shape
    out = lora_b.shape[1]
    if num_tokens == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    ieee = x.dtype == torch.float32
    block_m = 16 if num_tokens <= 256 else 64
    m_tiles = triton.cdiv(num_tokens, block_m)
    t = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)  # (num_tokens, n)
    bn, bk = _pow2(n), _pow2(k)
    _lora_shrink_kernel[(m_tiles * triton.cdiv(n, bn), max_loras)](
        x, lora_a, t, sorted_token_ids, num_tokens_per_slot, slot_start, n, k,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, NUM_N_BLOCKS=triton.cdiv(n, bn), IEEE=ieee)
    bo, bk = _pow2(out, hi=128 if num_tokens > 256 else 64), _pow2(n)
    _lora_expand_kernel[(m_tiles * triton.cdiv(out, bo), max_loras)](
        t, lora_b, y, scaling, sorted_token_ids, num_tokens_per_slot, slot_start, out, n,
        t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=bo, BLOCK_K=bk, NUM_N_BLOCKS=triton.cdiv(out, bo), IEEE=ieee)
    return y
