"""One Triton kernel for the sampler's common case on the GPU: temperature sampling, nothing else.

Lesson 04 draws the sampler's stages with torch ops, one pass over the (rows, vocab) logits
each: divide by the temperature, softmax, draw Exp(1) noise, divide, argmax. For Qwen3's vocabulary
of 151,936 tokens and 256 rows, each pass moves 155 MB, and the sampler reads or writes about
2 GB per decode step; lesson 08 shows that this is a visible share of a step that should
be reading KV cache instead. This kernel reads each logit once.

It draws from softmax(logits / T) with the Gumbel-max trick, which is the sampler's exponential
race written in logs: argmax(p / E) with E = -log(U), U ~ Uniform(0, 1), equals

    argmax(logits / T - log(-log U))        (the softmax's normaliser is the same for every token)

One program walks one row's vocabulary in tiles, keeping the best key and its index. The uniform
numbers come from Triton's counter-based generator (`tl.rand(seed, offset)`), so a step needs no
noise tensor: `seed` is drawn once per step from the engine's seeded host generator. Rows with
temperature 0 (`inv_temperature` 0) take the plain argmax.

The sampler uses it only when every row is unseeded and has no top-k/top-p/min-p, no penalties
and no banned tokens; everything else takes the torch path of `sampling.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# `seed` changes every step: specialising on it (Triton does for ints divisible by 16) would compile
# a second variant in the middle of a run.
@triton.jit(do_not_specialize=["seed"])
def gumbel_argmax_kernel(
    logits_ptr,  # (rows, vocab), last dim contiguous; any float dtype, read as fp32
    inv_temperature_ptr,  # (rows,) fp32: 1 / T, or 0 for greedy rows
    out_ptr,  # (rows,) int64: the sampled token of each row
    stride_row, vocab, seed,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = tl.load(inv_temperature_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best_key = float("-inf")
    best_idx = 0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * vocab + cols)  # one independent uniform per (row, token)
        gumbel = -tl.log(-tl.log(u + 1e-20) + 1e-20)  # the epsilons keep u = 0 finite
        sampled = inv_t > 0
        key = x * tl.where(sampled, inv_t, 1.0) + tl.where(sampled, gumbel, 0.0)
        key = tl.where(mask, key, float("-inf"))
        tile_best = tl.max(key, axis=0)
        tile_idx = tl.argmax(key, axis=0) + start
        better = tile_best > best_key  # strict: the first maximum wins, as in torch.argmax
        best_idx = tl.where(better, tile_idx, best_idx)
        best_key = tl.where(better, tile_best, best_key)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab) from softmax(logits * inv_temperature);
    argmax where inv_temperature is 0. Returns (rows,) int64 on the logits' device."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    interpret = logits.device.type == "cpu"
    block = min(triton.next_power_of_2(vocab), 1024 if interpret else 4096)
    gumbel_argmax_kernel[(rows,)](logits, inv_temperature, out, logits.stride(0), vocab, seed,
                                  BLOCK=block, num_warps=8)
    return out
