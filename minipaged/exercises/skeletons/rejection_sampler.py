"""Stage 12, `rejection_sampler` (lesson 10): speculative decoding's verification rule.

Write `rejection_sample`, `_correction_weights` and `_draws` of
minipaged/sampling/rejection_sampler.py.
While the grader runs, your functions replace the real ones everywhere they were imported, so
the engine's verify step (minipaged/spec_decode/verify.py) runs on yours. Grade them with

    minipaged exercise check rejection_sampler

The graders count 20,000 rows of your rule and compare the counts with p by a chi-square test
(the biased rules of lesson 10's section 1 fail it), then run the engine with prompt lookup on
seeded sampled requests, which must draw the same tokens alone or in a batch. (A step whose rows
are all greedy verifies without the rule: it keeps each guess while it equals the argmax.)

Needs from stage 7 (sampler): the same exponential race, argmax(weights / noise), draws the
corrected or bonus token.

Batched: no Python loop over rows or over the vocabulary. `_draws` returns the random
numbers: uniforms (num_rows, max_k) for the acceptance tests and Exp(1) noise (num_rows, vocab)
for one exponential race per row, argmax(weights / noise), which draws from the normalised
weights. One way (the project's): compare every guess at once (u * q(x) < p(x); greedy rows:
x == argmax p), mask the padding, find each row's first rejection with a cumulative product,
gather p (and q) at that position, and scatter the tokens into a -1 filled output.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from minipaged.sampling.rejection_sampler import PLACEHOLDER_TOKEN_ID  # noqa: F401


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
    # Details the tests check: padding (-1) past num_draft_tokens is never accepted, even where
    # p puts all its mass on token 0; a row with num_draft_tokens 0 samples from position 0;
    # max_k may be 0; a greedy row is deterministic; a seeded row's tokens do not depend on its
    # neighbours (let `_draws` do the drawing); shapes are checked with a ValueError that starts
    # with "target_probs must be" / "draft_probs must be".
    raise NotImplementedError("exercise: write rejection_sample")


def _correction_weights(p_last: torch.Tensor, num_accepted: torch.Tensor,
                        num_draft_tokens: torch.Tensor, safe_ids: torch.Tensor,
                        draft_probs: Optional[torch.Tensor]) -> torch.Tensor:
    """(num_rows, vocab) unnormalised weights of the last token: the residual max(0, p - q) at
    a rejection, p itself after all proposals were accepted (the bonus token).
    """
    # safe_ids: the draft tokens (num_rows, max_k) with the -1 padding replaced by 0. n-gram
    # guesses (draft_probs None) have a one-hot q. When the residual is zero everywhere, use p.
    raise NotImplementedError("exercise: write _correction_weights")


def _draws(num_rows: int, max_k: int, vocab: int, num_draft_tokens: torch.Tensor,
           generators: Optional[Seq[Optional[torch.Generator]]],
           generator: Optional[torch.Generator], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance uniforms (num_rows, max_k) and race noise (num_rows, vocab) ~ Exp(1).

    Rows without a generator share one batched draw; a seeded row draws from its own
    generator exactly num_draft_tokens[r] uniforms and one vocabulary of noise, so what it
    consumes depends on its own proposals only, not on max_k or its batch neighbours."""
    # A `generators` list of the wrong length: ValueError "generators must have one entry per
    # row ...". Draw the whole batch from `generator` first, then overwrite the seeded rows.
    raise NotImplementedError("exercise: write _draws")
