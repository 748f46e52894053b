"""Small Triton kernels for the sampler's common case on the GPU: temperature sampling.

Lesson 04 draws the sampler's stages with torch ops, one pass over the (rows, vocab) logits
each: divide by the temperature, softmax, draw Exp(1) noise, divide, argmax. For Qwen3's vocabulary
of 151,936 tokens and 256 rows, each pass moves 155 MB, and the sampler reads or writes about
2 GB per decode step; lesson 08 shows that this is a visible share of a step that should
be reading KV cache instead. Here the logits are read once, plus one chunk per row.

It draws from softmax(logits / T) with the Gumbel-max trick, which is the sampler's exponential
race written in logs: argmax(p / E) with E = -log(U), U ~ Uniform(0, 1), equals

    argmax(logits / T - log(-log U))        (the softmax's normaliser is the same for every token)

Drawing one random number per token is what made a one-pass kernel slow (a Philox draw costs
more than reading the logit). So the draw is split in two, which is still exact:

1. `chunk_stats_kernel`: one program per chunk of a row's vocabulary (2,048 tokens) computes the
   chunk's log-sum-exp of logits / T, and its maximum and first argmax (for greedy rows).
2. `pick_kernel`: one program per row. The largest of a set of independent Gumbel-perturbed
   scores is itself Gumbel-distributed around the set's log-sum-exp, so the chunk that holds the
   sampled token is drawn by Gumbel-max over the chunks' log-sum-exps: chunk c wins with
   probability Z_c / Z. Then a Gumbel-max over that chunk's tokens picks token i with
   probability exp(logit_i / T) / Z_c. Together: exp(logit_i / T) / Z, the softmax.

The uniform numbers come from Triton's counter-based generator (Philox, `tl.rand4x(seed,
offset)`: four numbers per draw, one for each token of a quad of 4), so a step needs no noise
tensor: `seed` is drawn once per step from the engine's seeded host generator; tokens and chunks
use disjoint counters. Rows with temperature 0 (`inv_temperature` 0) take the argmax (the first
one, as torch.argmax). The logits arrive in the model's dtype (bf16 on the GPU) and are widened
in registers: a separate fp32 copy of them would cost more than both kernels.

The sampler uses these only when every row is greedy or unseeded with no top-k/top-p/min-p
(tokens banned by min_tokens are -inf logits, which never win); everything else takes the torch
path of `sampler.py`.

Grammar masks (lesson 12; async scheduling's constrained steps, `Sampler.sample_masked`) ride
along: given a `TokenMask`, both kernels read each masked row's
bitmask words (bit t % 32 of word t // 32: token t allowed, xgrammar's layout) beside its logits
and treat forbidden tokens as -inf, so a constrained step costs no extra pass over the logits.
They also report, per row, whether the mask allows any token that is not a stop token: a row
whose grammar has ended allows stop tokens only (structured_output/background.py). A step whose
rows are all greedy takes a third kernel instead, `masked_argmax_kernel`: one program per row
walks its vocabulary once, so the step costs one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged.kernel_launch import CompiledLaunch
from minipaged.sampling.params import TokenMask


@triton.jit
def chunk_stats_kernel(
    logits_ptr,  # (rows, vocab), last dim contiguous; any float dtype, read as fp32
    inv_temperature_ptr,  # (rows,) fp32: 1 / T, or 0 for greedy rows
    lse_ptr,  # (rows, num_chunks) fp32: log of the sum over the chunk of exp(logit / T)
    max_ptr,  # (rows, num_chunks) fp32: the chunk's largest logit ...
    argmax_ptr,  # (rows, num_chunks) int32: ... and the first token holding it
    bitmask_ptr,  # (rows, ceil(vocab / 32)) int32, if HAS_MASK: bit t % 32 of word t // 32
    masked_ptr,  # (rows,) int32: 1 = apply the row's bitmask, 0 = the row is not constrained
    keep_ptr,  # (ceil(vocab / 32),) int32: the bits of every token but the stop tokens
    open_ptr,  # (rows, num_chunks) int32: does the chunk allow a token that is not a stop?
    stride_row, stride_mask, vocab,
    CHUNK: tl.constexpr,  # tokens per chunk (a power of two)
    HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temperature_ptr + row)
    scale = tl.where(inv_t > 0, inv_t, 1.0)  # greedy rows use only the max and argmax
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        x, opened = _apply_mask(x, cols, row, bitmask_ptr, masked_ptr, keep_ptr, stride_mask,
                                vocab)
        tl.store(open_ptr + row * tl.num_programs(1) + chunk, tl.max(opened, axis=0))
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, cols, vocab), axis=0)  # the first maximum, as torch.argmax
    first = tl.minimum(first, vocab - 1)  # NaN logits match nothing: still a valid token id
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of banned (-inf) tokens: no NaN
    total = tl.sum(tl.exp((x - m_safe) * scale), axis=0)  # the largest term is 1
    lse = tl.where(total == 0.0, float("-inf"), m_safe * scale + tl.log(total))
    num_chunks = tl.num_programs(1)
    tl.store(lse_ptr + row * num_chunks + chunk, lse)
    tl.store(max_ptr + row * num_chunks + chunk, m)
    tl.store(argmax_ptr + row * num_chunks + chunk, first)


@triton.jit
def _apply_mask(x, cols, row, bitmask_ptr, masked_ptr, keep_ptr, stride_mask, vocab):
    """x with the tokens `cols` that row's bitmask forbids set to -inf, and per token 1 where it
    is allowed and not a stop token (an unmasked row: x unchanged, every token counts)."""
    if tl.load(masked_ptr + row) != 0:
        in_vocab = cols < vocab
        words = tl.load(bitmask_ptr + row.to(tl.int64) * stride_mask + cols // 32,
                        mask=in_vocab, other=0)
        shift = cols % 32
        allowed = ((words >> shift) & 1) != 0
        keep = tl.load(keep_ptr + cols // 32, mask=in_vocab, other=0)
        opened = ((words & keep) >> shift) & 1
        x = tl.where(allowed, x, float("-inf"))
    else:
        opened = tl.full(cols.shape, 1, tl.int32)
    return x, opened


@triton.jit
def _gumbel(u):
    return -tl.log(-tl.log(u + 1e-20) + 1e-20)  # the epsilons keep u = 0 finite


# `seed` changes every step: specialising on it (Triton does for ints divisible by 16) would compile
# a second variant in the middle of a run.
@triton.jit(do_not_specialize=["seed"])
def pick_kernel(
    logits_ptr, inv_temperature_ptr, lse_ptr, max_ptr, argmax_ptr,  # as above
    bitmask_ptr, masked_ptr, keep_ptr, open_ptr,  # as above, if HAS_MASK
    out_ptr,  # (rows,) int64: the sampled token of each row; if HAS_MASK (2, rows): then
              # 1 where the row's mask allows stop tokens only (its grammar has ended)
    stride_row, stride_mask, vocab, num_chunks, seed,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # num_chunks padded to a power of two
    HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = tl.load(inv_temperature_ptr + row)
    chunks = tl.arange(0, CHUNKS_PAD)
    stats = row * num_chunks + chunks
    valid = chunks < num_chunks
    if HAS_MASK:
        opened = tl.load(open_ptr + stats, mask=valid, other=0)
        tl.store(out_ptr + tl.num_programs(0) + row, (tl.max(opened, axis=0) == 0).to(tl.int64))
    if inv_t > 0:
        # 1. which chunk: Gumbel-max over the chunks' log-sum-exps. Their uniforms sit past
        #    every token's counter: rows * quads_per_row + row * num_chunks + c
        quads_per_row = tl.cdiv(vocab, 4)
        lse = tl.load(lse_ptr + stats, mask=valid, other=float("-inf"))
        u = tl.rand(seed, tl.num_programs(0) * quads_per_row + stats)
        key = tl.where(valid, lse + _gumbel(u), float("-inf"))
        chunk = tl.minimum(tl.argmax(key, axis=0), num_chunks - 1)
        # 2. which token of that chunk: Gumbel-max over its logits / T. The tile is CHUNK
        #    consecutive tokens seen as (CHUNK // 4, 4), token 4 * quad + lane: one Philox draw
        #    (tl.rand4x) gives the four uniforms of a quad.
        quads = tl.arange(0, CHUNK // 4)
        lanes = tl.arange(0, 4)
        cols = chunk * CHUNK + quads[:, None] * 4 + lanes[None, :]  # (CHUNK // 4, 4) token ids
        mask = cols < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask,
                    other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            x, _ = _apply_mask(x, cols, row, bitmask_ptr, masked_ptr, keep_ptr, stride_mask,
                               vocab)
        u0, u1, u2, u3 = tl.rand4x(seed, row * quads_per_row + chunk * (CHUNK // 4) + quads)
        u = tl.where(lanes[None, :] == 0, u0[:, None],  # lane l of each quad takes u_l
                     tl.where(lanes[None, :] == 1, u1[:, None],
                              tl.where(lanes[None, :] == 2, u2[:, None], u3[:, None])))
        key = tl.where(mask, x * inv_t + _gumbel(u), float("-inf"))
        best = tl.max(tl.max(key, axis=1), axis=0)
        token = tl.min(tl.min(tl.where(key == best, cols, vocab), axis=1), axis=0)
        tl.store(out_ptr + row, tl.minimum(token, vocab - 1).to(tl.int64))  # (NaN: see above)
    else:  # greedy: the first chunk holding the row's maximum, and its first argmax
        m = tl.load(max_ptr + stats, mask=valid, other=float("-inf"))
        best = tl.max(m, axis=0)
        chunk = tl.min(tl.where(valid & (m == best), chunks, num_chunks - 1), axis=0)
        token = tl.load(argmax_ptr + row * num_chunks + chunk)
        tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def masked_argmax_kernel(
    logits_ptr, bitmask_ptr, masked_ptr, keep_ptr,  # as above
    out_ptr,  # (2, rows) int64: each row's first allowed maximum; 1 if it allows stop tokens only
    stride_row, stride_mask, vocab,
    BLOCK: tl.constexpr,
):
    """Greedy rows with grammar masks: one program walks a row's vocabulary in blocks."""
    row = tl.program_id(0)
    best = float("-inf")
    best_token = 0
    opened = 0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                    other=float("-inf")).to(tl.float32)
        x, allowed_open = _apply_mask(x, cols, row, bitmask_ptr, masked_ptr, keep_ptr,
                                      stride_mask, vocab)
        m = tl.max(x, axis=0)
        first = tl.min(tl.where(x == m, cols, vocab), axis=0)
        best_token = tl.where(m > best, first, best_token)  # a later block must beat it
        best = tl.maximum(best, m)
        opened = tl.maximum(opened, tl.max(allowed_open, axis=0))
    tl.store(out_ptr + row, tl.minimum(best_token, vocab - 1).to(tl.int64))
    tl.store(out_ptr + tl.num_programs(0) + row, (opened == 0).to(tl.int64))


def _checked(mask: TokenMask, rows: int, vocab: int) -> TokenMask:
    """`mask`, once it is known to cover `rows` x `vocab` (the kernels index it unchecked)."""
    bitmask, _, keep = mask
    assert bitmask.shape[0] >= rows and bitmask.shape[1] * 32 >= vocab, bitmask.shape
    assert bitmask.stride(1) == 1 and keep.shape[0] >= bitmask.shape[1]
    return mask


def masked_argmax(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """What `gumbel_sample(logits, zeros, seed, mask=mask)` returns for all-greedy rows, in one
    launch: (2, rows) int64, the first maximum among each row's allowed tokens, then 1 for each
    masked row that allows stop tokens only."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty((2, rows), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    bitmask, masked, keep = _checked(mask, rows, vocab)
    interpret = logits.device.type == "cpu"
    # One program per row walks its row in blocks; wider blocks with more warps were faster on
    # the H200 (64 rows of 151,936 bf16 logits: 50.4 us in blocks of 4,096 with 8 warps, 30.6 us
    # in 16,384 with 16; benchmarks/experiments/structured_outputs/masked_argmax_blocks.py), and
    # the host waits for it.
    block = min(max(16, triton.next_power_of_2(vocab)), 1024 if interpret else 16384)
    _masked_argmax_launch((rows,), logits, bitmask, masked, keep, out, logits.stride(0),
                          bitmask.stride(0), vocab, BLOCK=block,
                          num_warps=1 if interpret else max(1, min(16, block // 1024)))
    return out


_masked_argmax_launch = CompiledLaunch(masked_argmax_kernel)


def gumbel_sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int,
                  chunk: int | None = None, mask: TokenMask | None = None) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab) from softmax(logits * inv_temperature);
    argmax where inv_temperature is 0. Returns (rows,) int64 on the logits' device.

    `chunk`: tokens per chunk (a power of two, at least 16; default 2,048, Qwen3's 151,936
    tokens make 75 chunks per row). Any chunking draws from the same distribution; the tokens
    drawn for a given seed depend on it.

    With a `mask`, each masked row draws from its allowed tokens only, and the result is
    (2, rows) int64: the tokens, then 1 for each masked row that allows stop tokens only. A row
    that allows no token at all gets a token id all the same (and 1)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty((rows,) if mask is None else (2, rows), dtype=torch.int64,
                      device=logits.device)
    if rows == 0:
        return out
    interpret = logits.device.type == "cpu"
    chunk = chunk or min(max(16, triton.next_power_of_2(vocab)), 1024 if interpret else 2048)
    assert chunk >= 16 and chunk & (chunk - 1) == 0, f"chunk={chunk}: a power of two >= 16"
    num_chunks = triton.cdiv(vocab, chunk)
    lse = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    maxes = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    argmax = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    warps = 1 if interpret else 4
    if mask is None:
        bitmask = masked = keep = opened = lse  # not read (HAS_MASK=False)
        stride_mask = 0
    else:
        bitmask, masked, keep = _checked(mask, rows, vocab)
        opened = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
        stride_mask = bitmask.stride(0)
    _chunk_stats_launch(
        (rows, num_chunks), logits, inv_temperature, lse, maxes, argmax, bitmask, masked, keep,
        opened, logits.stride(0), stride_mask, vocab, CHUNK=chunk, HAS_MASK=mask is not None,
        num_warps=warps)
    _pick_launch(
        (rows,), logits, inv_temperature, lse, maxes, argmax, bitmask, masked, keep, opened, out,
        logits.stride(0), stride_mask, vocab, num_chunks, seed, CHUNK=chunk,
        CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)), HAS_MASK=mask is not None,
        num_warps=warps)
    return out


_chunk_stats_launch = CompiledLaunch(chunk_stats_kernel)
_pick_launch = CompiledLaunch(pick_kernel)
