"""Speculative decoding's verification rule: which proposed tokens to keep, and the one to add.

Lesson 10 (speculative decoding) measures this rule's output distribution. A proposer (an n-gram
lookup or a small draft model) guesses k tokens x_1..x_k; the target model scores all of them in
one forward pass, which gives its distribution p_i at every position (p_{k+1} after the last
guess). Each guess is then tested in order (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"):

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))     (q_i: the proposer's distribution)
    at the first rejection, emit one token drawn from norm(max(0, p_i - q_i)) and stop
    if all k are accepted, emit a bonus token drawn from p_{k+1}

Why the emitted token follows p exactly: the token at position i is x with probability

    P(x) = q(x) min(1, p(x)/q(x))  +  P(reject) * max(0, p(x) - q(x)) / Z
         = min(q(x), p(x))          +  max(0, p(x) - q(x))              = p(x),

because P(reject) = 1 - sum_x min(q(x), p(x)) = sum_x max(0, p(x) - q(x)) = Z. So speculation
changes how many target forwards it takes, never what is sampled (lossless). An n-gram proposer
has no distribution: its q is one-hot at the guess, so x is accepted with probability p(x) and
the residual is p with the guess removed. Greedy rows need no randomness: accept while the guess
equals argmax p_i, then emit argmax p at the first disagreement (or the bonus position).

When the residual is zero everywhere (p == q at the rejected position, which only rounding can
reach), the token is drawn from p itself. Draws use the exponential race, argmax(w / E) with
E ~ Exp(1), which samples from the weights w without normalising them (as sampler.py does).

A row with its own `torch.Generator` (a request with a seed) draws from it alone, one uniform per
own proposal and one vocabulary of exponentials per step, so its tokens do not depend on what
else is in the batch; rows without one share one batched draw.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

PLACEHOLDER_TOKEN_ID = -1  # pads draft_token_ids and output_token_ids


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    greedy_mask: Optional[torch.Tensor] = None,
    generators: Optional[Seq[Optional[torch.Generator]]] = None,
    *,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every row's proposals at once.

    target_probs: (num_rows, max_k + 1, vocab) float, the target's processed probabilities at
        each verified position (temperature, top-k/top-p applied). Position i scores draft i;
        position num_draft_tokens[r] gives the bonus token.
    draft_token_ids: (num_rows, max_k) long, padded with -1 past num_draft_tokens.
    num_draft_tokens: (num_rows,) long, 0..max_k (0: the row is not speculating this step and
        just samples one token from position 0).
    draft_probs: (num_rows, max_k, vocab) float, the proposer's q; None for n-gram proposals
        (q one-hot at the draft token).
    greedy_mask: (num_rows,) bool, rows that take argmax; None: every row samples.
    generators: one entry per row, a `torch.Generator` for a seeded row or None.
    generator: draws for rows without their own (None: torch's default generator).

    Returns (output_token_ids, num_accepted): output_token_ids (num_rows, max_k + 1) long holds
    the accepted drafts then one corrected or bonus token, padded with -1 (row r has
    num_accepted[r] + 1 tokens); num_accepted (num_rows,) long.
    """
    num_rows, max_k = draft_token_ids.shape
    if target_probs.shape[:2] != (num_rows, max_k + 1):
        raise ValueError(f"target_probs must be (num_rows, max_k + 1, vocab) = ({num_rows}, "
                         f"{max_k + 1}, vocab), got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape[:2] != (num_rows, max_k):
        raise ValueError(f"draft_probs must be (num_rows, max_k, vocab) = ({num_rows}, {max_k}, "
                         f"vocab), got {tuple(draft_probs.shape)}")
    device, vocab = target_probs.device, target_probs.shape[-1]
    rows = torch.arange(num_rows, device=device)
    num_draft_tokens = num_draft_tokens.to(device=device, dtype=torch.long)
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.long)
    # A batch of greedy rows only needs no random draw.
    all_greedy = greedy_mask is not None and bool(greedy_mask.all())
    if greedy_mask is None:
        greedy_mask = torch.zeros(num_rows, dtype=torch.bool, device=device)
    greedy_mask = greedy_mask.to(device)

    # 1. Which proposals are accepted. valid: the row really proposed that position.
    positions = torch.arange(max_k, device=device)
    valid = positions[None, :] < num_draft_tokens[:, None]  # (num_rows, max_k)
    safe_ids = draft_token_ids.clamp(min=0)  # -1 padding -> a harmless index
    accept = draft_token_ids == target_probs[:, :max_k].argmax(dim=-1)  # the greedy rule
    if not all_greedy:
        uniforms, noise = _draws(num_rows, max_k, vocab, num_draft_tokens, generators,
                                 generator, device)
        draft_p = target_probs[:, :max_k].gather(-1, safe_ids[..., None]).squeeze(-1).float()
        if draft_probs is None:
            draft_q = torch.ones_like(draft_p)  # n-gram: q(x) = 1 at the guess
        else:
            draft_q = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1).float()
        # u < p/q without dividing (q = 0 at a guess only if the proposer broke its own rule).
        sampled_accept = uniforms * draft_q < draft_p  # (num_rows, max_k)
        accept = torch.where(greedy_mask[:, None], accept, sampled_accept)
    accept &= valid
    # Accepted prefix: stop at the first rejection. cumprod turns 1 1 0 1 into 1 1 0 0.
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # (num_rows,)

    # 2. The one token after the accepted prefix, at position num_accepted of each row.
    p_last = target_probs[rows, num_accepted].float()  # (num_rows, vocab)
    last_token = p_last.argmax(dim=-1)  # greedy rows
    if not all_greedy:
        weights = _correction_weights(p_last, num_accepted, num_draft_tokens, safe_ids,
                                      draft_probs)
        sampled = (weights / noise).argmax(dim=-1)  # exponential race: a draw from norm(weights)
        last_token = torch.where(greedy_mask, last_token, sampled)

    # 3. Accepted drafts, then the last token, then -1.
    output = torch.full((num_rows, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long,
                        device=device)
    kept = positions[None, :] < num_accepted[:, None]
    output[:, :max_k] = torch.where(kept, draft_token_ids, PLACEHOLDER_TOKEN_ID)
    output[rows, num_accepted] = last_token
    return output, num_accepted


def _correction_weights(p_last: torch.Tensor, num_accepted: torch.Tensor,
                        num_draft_tokens: torch.Tensor, safe_ids: torch.Tensor,
                        draft_probs: Optional[torch.Tensor]) -> torch.Tensor:
    """(num_rows, vocab) unnormalised weights of the last token: the residual max(0, p - q) at
    a rejection, p itself after all proposals were accepted (the bonus token)."""
    num_rows, max_k = safe_ids.shape
    if max_k == 0:
        return p_last
    rows = torch.arange(num_rows, device=p_last.device)
    at = num_accepted.clamp(max=max_k - 1)  # the rejected position (rows that rejected one)
    if draft_probs is None:  # residual of a one-hot q: p with the rejected guess removed
        residual = p_last.scatter(-1, safe_ids[rows, at][:, None], 0.0)
    else:
        residual = (p_last - draft_probs[rows, at].float()).clamp(min=0.0)
    # All accepted: the bonus comes from p. p == q leaves nothing: p too (only rounding gets
    # here).
    usable = (num_accepted < num_draft_tokens) & (residual.sum(dim=-1) > 0)
    return torch.where(usable[:, None], residual, p_last)


def _draws(num_rows: int, max_k: int, vocab: int, num_draft_tokens: torch.Tensor,
           generators: Optional[Seq[Optional[torch.Generator]]],
           generator: Optional[torch.Generator], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance uniforms (num_rows, max_k) and race noise (num_rows, vocab) ~ Exp(1).

    Rows without a generator share one batched draw; a seeded row draws from its own
    generator exactly num_draft_tokens[r] uniforms and one vocabulary of noise, so what it
    consumes depends on its own proposals only, not on max_k or its batch neighbours."""
    if generators is not None and len(generators) != num_rows:
        raise ValueError(f"generators must have one entry per row ({num_rows}), "
                         f"got {len(generators)}")
    uniforms = torch.rand((num_rows, max_k), device=device, generator=generator)
    noise = torch.empty((num_rows, vocab), device=device).exponential_(generator=generator)
    seeded = [r for r, g in enumerate(generators or ()) if g is not None]
    if seeded:
        counts = num_draft_tokens.tolist()  # one host sync, only when a row has a seed
        for r in seeded:
            g = generators[r]
            if counts[r]:
                uniforms[r, :counts[r]] = torch.rand(counts[r], device=device, generator=g)
            noise[r] = torch.empty(vocab, device=device).exponential_(generator=g)
    return uniforms, noise
