"""Verification: the target's logits at every proposed position -> the tokens a step emits.

Lesson 10 walks through it. A speculating sequence ran its newest token and its k proposals in
one query, so the model runner returned k + 1 logits rows for it (position i scores proposal i;
the last one gives the bonus token). Each row gets its request's own processing, the sampler's
(temperature, top-k, top-p, min-p), which turns the logits into the target's probabilities
p_1..p_{k+1}; `rejection_sample` (sampling/rejection_sampler.py) then keeps the proposals the
rule accepts and adds one corrected or bonus token. Proposals are deterministic here (prompt
lookup, or a draft model's argmax), so their q is one-hot and no draft probabilities are needed.

A step whose speculating rows are all greedy needs none of that (`verify_greedy`): the target's
argmax at every position, read once, decides it on the host (keep guesses while they equal it,
then emit it), exactly what the sampler's greedy rows take, with no softmax, no draws and no
rejection-sampling kernels.

Which requests speculate (`can_speculate`): plain ones. A request that needs something a
verified position cannot give it yet (logprobs, penalties, min_tokens not reached, a grammar)
decodes one token at a time in the same batch, through the ordinary sampler.
"""
from __future__ import annotations

import torch

from minipaged.engine.scheduler import ScheduledSeq
from minipaged.engine.sequence import Sequence
from minipaged.sampling.rejection_sampler import rejection_sample
from minipaged.sampling.sampler import apply_top_k_top_p_min_p
from minipaged.utils import to_device


def can_speculate(seq: Sequence) -> bool:
    """A request whose tokens depend on nothing but the target's processed probabilities."""
    p = seq.sampling_params
    return (seq.group is None and p.logprobs is None and not p.has_penalties
            and seq.num_output_tokens >= p.min_tokens and p.structured_outputs is None)


def num_proposals_allowed(seq: Sequence, k: int, max_model_len: int) -> int:
    """At most k, and never so many that the step could pass max_tokens or max_model_len (a
    step emits up to proposals + 1 tokens; its K/V slots end at num_tokens + proposals)."""
    p = seq.sampling_params
    left = max_model_len - seq.num_tokens - 1
    if p.max_tokens is not None:
        left = min(left, p.max_tokens - seq.num_output_tokens - 1)
    return max(0, min(k, left))


def target_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (rows, positions, vocab) -> the target's probabilities after each row's
    temperature / top-k / top-p / min-p, in fp32 (greedy rows: softmax at temperature 1; the
    rejection rule takes their argmax)."""
    rows, positions, vocab = logits.shape
    params = [s.sampling_params for s in seqs]
    device = logits.device
    temps = to_device([1.0 if p.greedy else p.temperature for p in params], device,
                      torch.float32)
    scaled = logits.float() / temps[:, None, None]  # (rows, positions, vocab)
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        def per_position(values, dtype):  # one entry per (row, position), row-major
            return to_device(values, device, dtype).repeat_interleave(positions)
        flat = apply_top_k_top_p_min_p(
            scaled.reshape(rows * positions, vocab),  # (rows * positions, vocab)
            per_position([min(p.top_k, vocab) for p in params], torch.int64),
            per_position([p.top_p for p in params], torch.float32),
            per_position([p.min_p for p in params], torch.float32))
        scaled = flat.view(rows, positions, vocab)
    return scaled.softmax(dim=-1)


def verify(logits: torch.Tensor, entries: list[ScheduledSeq], starts: list[int],
           engine_generator: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """Decide every verified row of the step at once.

    logits: (step rows, vocab), the step's logits; entry r's k_r + 1 positions are rows
    starts[r] .. starts[r] + k_r (k_r = 0: a greedy row without proposals, just its argmax).
    Returns each entry's emitted tokens (accepted proposals, then the corrected or bonus token)
    and its number of accepted proposals.
    """
    seqs = [s.seq for s in entries]
    if all(seq.sampling_params.greedy for seq in seqs):
        return verify_greedy(logits, entries, starts)
    device = logits.device
    ks = [len(s.spec_token_ids) for s in entries]
    max_k = max(ks)
    # (rows, max_k + 1) indices into logits; a shorter row repeats its last position (unread).
    index = [[start + min(i, k) for i in range(max_k + 1)] for start, k in zip(starts, ks)]
    probs = target_probs(logits[to_device(index, device, torch.long)], seqs)
    drafts = to_device([s.spec_token_ids + [-1] * (max_k - len(s.spec_token_ids))
                        for s in entries], device, torch.long)  # (rows, max_k), -1 padded
    greedy = [s.sampling_params.greedy for s in seqs]
    generators = []
    for seq, g in zip(seqs, greedy):
        p = seq.sampling_params
        if p.seed is not None and not g:  # a seeded request draws from its own generator
            if seq.generator is None:
                seq.generator = torch.Generator(device=device).manual_seed(p.seed + seq.index)
            generators.append(seq.generator)
        else:
            generators.append(None)
    greedy_mask = to_device(greedy, device, torch.bool) if any(greedy) else None
    output, num_accepted = rejection_sample(
        probs, drafts, to_device(ks, device, torch.long), None, greedy_mask, generators,
        generator=engine_generator)
    rows = torch.cat([num_accepted[:, None], output], dim=1).tolist()  # one host sync
    return [row[1:row[0] + 2] for row in rows], [row[0] for row in rows]


def verify_greedy(logits: torch.Tensor, entries: list[ScheduledSeq], starts: list[int]
                  ) -> tuple[list[list[int]], list[int]]:
    """`verify` for greedy rows: keep each guess while it equals the target's argmax at its
    position, then emit the argmax after the last kept one (corrected or bonus token).

    The argmax of the raw logits is the token the sampler's greedy rows take, so the output is
    the plain greedy decode's. (Rows of `logits` that no entry reads are argmaxed too: one
    kernel over every row costs less than gathering the verified ones first.)"""
    targets = logits.argmax(dim=-1).tolist()  # (step rows,), the step's one host read
    tokens, accepted = [], []
    for s, start in zip(entries, starts):
        drafts = s.spec_token_ids
        a = 0
        while a < len(drafts) and drafts[a] == targets[start + a]:
            a += 1
        tokens.append(targets[start:start + a + 1])  # the kept guesses equal the argmax
        accepted.append(a)
    return tokens, accepted
