"""The shrink and expand of punica.py as Triton kernels: the CUDA path of multi-LoRA (lesson 11).

punica.py gathers every token's A and B, which reads an adapter's weights once *per token*. Here
the tokens are taken in slot order and cut into tiles of at most TILE_TOKENS tokens of one slot
(PunicaWrapper.update), so a program reads a tile of its slot's weights once for all the tile's
tokens and multiplies with `tl.dot` (punica's segmented SGMV, as vLLM's lora_shrink /
lora_expand kernels do):

    shrink   grid (tiles * n_blocks, SPLIT_K)
             partial[split, rows, n] = x[rows, K_split] @ lora_a[slot, n, K_split].T
    expand   grid (tiles * out_blocks,)
             y[rows, out] += (sum_split partial[:, rows, :]) @ lora_b[slot, out, :].T
                             * scaling[slot]

`rows` are a tile's token indices, gathered from `sorted_token_ids`. The shrink splits its long
reduction (the layer's input width) over SPLIT_K programs, each writing its own partial sums,
which the expand adds up: a decode step has few tiles, and without the split a handful of
programs would each walk the whole width. Tokens without an adapter are in no tile and are left
untouched; unused tiles (slot -1) return at once. The grids depend only on the step's token count,
and every per-step number is read from device buffers, so a decode step replays from a CUDA graph.
Per the DESIGN notes: power-of-two tiles, indices widened to int64 before a stride multiply,
tiles of at least 16 for `tl.dot` on a GPU; fp32 inputs are multiplied in full precision
("ieee"), half-precision ones on the tensor cores with fp32 sums. On the CPU the kernels run
under TRITON_INTERPRET=1 (set before this module is imported).

`TritonPunicaWrapper` (below) is punica.py's `PunicaWrapper` calling these kernels; the LoRA
manager picks it on CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged.lora.punica import TILE_TOKENS, PunicaWrapper


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, t_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr,
                        tile_len_ptr, N, K, K_PER_SPLIT, stride_xm, stride_al, stride_an,
                        stride_ts, stride_tm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_N_BLOCKS: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tile = pid // NUM_N_BLOCKS
    pid_n = pid % NUM_N_BLOCKS
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:  # an unused tile
        return
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
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
    t_ptrs = t_ptr + split.to(tl.int64) * stride_ts + rows[:, None] * stride_tm + offs_n[None, :]
    tl.store(t_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, y_ptr, scale_ptr, sorted_ptr, tile_slot_ptr,
                        tile_start_ptr, tile_len_ptr, OUT, N, stride_ts, stride_tm, stride_tl,
                        stride_bl, stride_bo, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_N_BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // NUM_N_BLOCKS
    pid_n = pid % NUM_N_BLOCKS
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_o = offs_o < OUT
    b_base = b_ptr + slot.to(tl.int64) * stride_bl
    t_base = t_ptr + slot.to(tl.int64) * stride_tl  # stacked: the slot's own columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < N
        t_mask = mask_m[:, None] & mask_k[None, :]
        t = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # the shrink's partial sums
            t += tl.load(t_base + s * stride_ts + rows[:, None] * stride_tm + offs_k[None, :],
                         mask=t_mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_K)
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


def _split(k: int) -> tuple[int, int, int]:
    """(BLOCK_K, SPLIT_K, K_PER_SPLIT) of the shrink's reduction over the input width k."""
    bk = _pow2(k)
    split_k = 1 if k < 512 else min(8, k // 256)
    return bk, split_k, triton.cdiv(triton.cdiv(k, split_k), bk) * bk


def _num_tiles(num_tokens: int, max_loras: int, tile_slot: torch.Tensor) -> int:
    """Tiles that num_tokens tokens can make (PunicaWrapper.max_tiles for this step's length)."""
    return min(triton.cdiv(num_tokens, TILE_TOKENS) + min(max_loras, num_tokens),
               tile_slot.shape[0])


def shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_token_ids, tile_slot, tile_start,
           tile_len) -> torch.Tensor:
    """Each tile's x @ its slot's A.T: (SPLIT_K, num_tokens, n) fp32 partial sums, one per
    split of the input width."""
    num_tokens, k = x.shape
    max_loras, n, _ = lora_a.shape
    bk, split_k, k_per_split = _split(k)
    t = torch.empty(split_k, num_tokens, n, dtype=torch.float32, device=x.device)
    bn = _pow2(n)
    tiles = _num_tiles(num_tokens, max_loras, tile_slot)
    _lora_shrink_kernel[(tiles * triton.cdiv(n, bn), split_k)](
        x, lora_a, t, sorted_token_ids, tile_slot, tile_start, tile_len, n, k, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), t.stride(0), t.stride(1),
        BLOCK_M=TILE_TOKENS, BLOCK_N=bn, BLOCK_K=bk, NUM_N_BLOCKS=triton.cdiv(n, bn),
        IEEE=x.dtype == torch.float32)
    return t


def expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
           sorted_token_ids, tile_slot, tile_start, tile_len) -> torch.Tensor:
    """y += t @ each tile's slot's B.T * its scaling, in place; returns y. t is the shrink's
    (SPLIT_K, num_tokens, n) partial sums, or, stacked, (num_tokens, max_loras * n): every
    slot's shrink of every token, as `stacked_shrink_and_base` leaves it."""
    max_loras, out, n = lora_b.shape
    if t.dim() == 3:  # partial sums
        split_k, num_tokens = t.shape[:2]
        strides = (t.stride(0), t.stride(1), 0)
    else:  # stacked: slot s of token i at t[i, s * n:(s + 1) * n]
        split_k, num_tokens = 1, t.shape[0]
        strides = (0, t.stride(0), n)
    tiles = _num_tiles(num_tokens, max_loras, tile_slot)
    bo, bk = _pow2(out, hi=256), _pow2(n)  # wide output tiles: fewer programs per token tile
    _lora_expand_kernel[(tiles * triton.cdiv(out, bo),)](
        t, lora_b, y, scaling, sorted_token_ids, tile_slot, tile_start, tile_len, out, n,
        *strides, lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=TILE_TOKENS, BLOCK_N=bo, BLOCK_K=bk, NUM_N_BLOCKS=triton.cdiv(out, bo),
        SPLIT_K=split_k, IEEE=y.dtype == torch.float32)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, sorted_token_ids: torch.Tensor, tile_slot: torch.Tensor,
             tile_start: torch.Tensor, tile_len: torch.Tensor) -> torch.Tensor:
    """punica.add_lora with the tokens given as tiles of one slot each: y += deltas in place.

    x: (num_tokens, in); y: (num_tokens, out); lora_a: (max_loras, n, in); lora_b: (max_loras,
    out, n), last dimensions contiguous; scaling: (max_loras,) fp32; the rest from
    PunicaWrapper.update."""
    if x.shape[0] == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    tiles = (sorted_token_ids, tile_slot, tile_start, tile_len)
    return expand(y, shrink(x, lora_a, *tiles), lora_b, scaling, *tiles)


def stacked_shrink_and_base(x: torch.Tensor, w_cat: torch.Tensor, b_cat: torch.Tensor | None,
                            out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One GEMM for the base layer and every slot's shrink: `w_cat` is the base weight (out, in)
    with each slot's A stacked under it (layers.py). Returns y (num_tokens, out) and t
    (num_tokens, max_loras * n), views of one (num_tokens, out + max_loras * n) output."""
    full = torch.nn.functional.linear(x, w_cat, b_cat)
    return full[:, :out], full[:, out:]


class TritonPunicaWrapper(PunicaWrapper):
    """The same mapping, computed by the Triton kernels (this file's): the CUDA variant.

    An eager step launches them only if one of its tokens has an adapter. A CUDA graph records
    them unconditionally (their grid depends only on the token count), so a captured decode
    step replays whatever adapters the next steps bring; only the second set of decode graphs
    that lora/runner.py captures for steps without adapter tokens leaves them out
    (`capturing_base`). A layer whose slots' A are stacked under its base weight (layers.py,
    `w_cat`) gets the base output and every slot's shrink from one GEMM, then the expand."""

    capturing_base = False

    def _launches(self, x: torch.Tensor) -> bool:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return not self.capturing_base
        return self.any_lora

    def forward(self, layer, x: torch.Tensor) -> torch.Tensor:
        if not self._launches(x) or x.shape[0] == 0:
            return layer.base_layer(x)
        if layer.w_cat is None:
            return self.add_lora(layer.base_layer(x), x, layer.lora_a, layer.lora_b)
        y, t = stacked_shrink_and_base(x, layer.w_cat, layer.b_cat, layer.lora_b.shape[1])
        return expand(y, t, layer.lora_b, self.scaling, self.sorted_token_ids, self.tile_slot,
                      self.tile_start, self.tile_len)

    def add_lora(self, y, x, lora_a, lora_b):
        if not self._launches(x):
            return y
        return add_lora(y, x, lora_a, lora_b, self.scaling, self.sorted_token_ids,
                        self.tile_slot, self.tile_start, self.tile_len)
