"""One Triton kernel for the sampler's common case on the GPU: temperature sampling, nothing else.

Lesson 04 draws the sampler's stages with torch ops, one pass over the (rows, vocab) logits
each: divide by the temperature, softmax, draw Exp(1) noise, divide, argmax. For Qwen3's vocabulary
of 151,936 tokens and 256 rows, each pass moves 155 MB, and the sampler reads or writes about
2 GB per decode step; lesson 08 shows that this is a visible share of a step that should
be reading KV cache instead. This kernel reads each logit once.

It draws from softmax(logits / T) with the Gumbel-max trick, which is the sampler's exponential
race written in logs: argmax(p / E) with E = -log(U), U ~ Uniform(0, 1), equals

    argmax(logits / T - log(-log U))        (the softmax's normaliser is the same for every token)

A program walks a chunk of one row's vocabulary in tiles, keeping the best key and its index;
one small argmax then picks each row's best chunk. The uniform numbers come from Triton's
counter-based generator (Philox, `tl.rand4x(seed, offset)`: four numbers per draw, one for each
token of a quad of 4), so a step needs no noise tensor, and a token's number does not depend on
how the vocabulary is chunked: `seed` is drawn once per step from the engine's seeded host
generator. Rows with temperature 0 (`inv_temperature` 0) take the argmax.

The logits arrive in the model's dtype (bf16 on the GPU) and are widened in registers: a separate
fp32 copy of a (256, 151,936) logits tensor would cost more than this kernel.

The sampler uses it only when every row is greedy or unseeded with no top-k/top-p/min-p (tokens
banned by min_tokens are -inf logits, which never win); everything else takes the torch path of
`sampling.py`.
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
    best_key_ptr,  # (rows, num_chunks) fp32: the best key of each chunk of the vocabulary ...
    best_idx_ptr,  # (rows, num_chunks) int64: ... and its token id
    stride_row, vocab, seed,
    CHUNK: tl.constexpr,  # tokens per program (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # tokens per loop iteration (a multiple of 4)
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temperature_ptr + row)
    sampled = inv_t > 0
    base = logits_ptr + row.to(tl.int64) * stride_row
    # The tile is BLOCK consecutive tokens seen as (BLOCK // 4, 4): token 4 * quad + lane. One
    # Philox draw (tl.rand4x) gives the four uniforms of a quad; drawing one number per token
    # (tl.rand) would run the generator four times as often, and it is what bounds this kernel.
    quads = tl.arange(0, BLOCK // 4)
    lanes = tl.arange(0, 4)
    quads_per_row = tl.cdiv(vocab, 4)
    best_key = float("-inf")
    best_idx = chunk * CHUNK
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), BLOCK):
        cols = start + quads[:, None] * 4 + lanes[None, :]  # (BLOCK // 4, 4) token ids
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u0, u1, u2, u3 = tl.rand4x(seed, row * quads_per_row + start // 4 + quads)
        u = tl.where(lanes[None, :] == 0, u0[:, None],  # lane l of each quad takes u_l
                     tl.where(lanes[None, :] == 1, u1[:, None],
                              tl.where(lanes[None, :] == 2, u2[:, None], u3[:, None])))
        gumbel = -tl.log(-tl.log(u + 1e-20) + 1e-20)  # the epsilons keep u = 0 finite
        key = x * tl.where(sampled, inv_t, 1.0) + tl.where(sampled, gumbel, 0.0)
        key = tl.where(mask, key, float("-inf"))
        tile_best = tl.max(tl.max(key, axis=1), axis=0)
        # the first token holding the maximum, as torch.argmax picks (greedy rows can tie)
        tile_idx = tl.min(tl.min(tl.where(key == tile_best, cols, vocab), axis=1), axis=0)
        better = tile_best > best_key  # strict: an earlier tile wins a tie
        best_idx = tl.where(better, tile_idx, best_idx)
        best_key = tl.where(better, tile_best, best_key)
    num_chunks = tl.num_programs(1)
    tl.store(best_key_ptr + row * num_chunks + chunk, best_key)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                  chunk: int | None = None) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab) from softmax(logits * inv_temperature);
    argmax where inv_temperature is 0. Returns (rows,) int64 on the logits' device.

    Each row's vocabulary is cut into chunks of `chunk` tokens, one program each, so that even a
    few rows fill the GPU (Qwen3's 151,936 tokens: 10 programs per row); the best of each chunk is
    then chosen with one small argmax (ties: the first chunk, as torch.argmax)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    interpret = logits.device.type == "cpu"
    block = min(max(16, triton.next_power_of_2(vocab)), 1024 if interpret else 2048)
    chunk = chunk or (block if interpret else 8 * block)
    chunk = triton.cdiv(chunk, block) * block
    num_chunks = triton.cdiv(vocab, chunk)
    keys = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, num_chunks), dtype=torch.int64, device=logits.device)
    gumbel_argmax_kernel[(rows, num_chunks)](
        logits, inv_temperature, keys, idx, logits.stride(0), vocab, seed,
        CHUNK=chunk, BLOCK=block, num_warps=4 if interpret else 8)
    if num_chunks == 1:
        return idx[:, 0]
    return idx.gather(1, keys.argmax(dim=1, keepdim=True)).squeeze(1)  # (rows,)
