"""Exercise `top_k_top_p` (lesson 04): the mask that keeps each row's top-k / top-p / min-p tokens.

Write `apply_top_k_top_p_min_p` of minipaged/sampling/sampler.py. While the grader runs, your
function replaces the real one everywhere it was imported (the `Sampler` calls it for every row
that asks for top_k, top_p or min_p). Grade it with

    minipaged exercise check top_k_top_p

Batched: no Python loop over rows. One way (the project's): sort each row once, descending; on
the sorted row top-k is a rank test, top-p a test on the probability mass ranked above a token,
min-p a test against the top token's probability; then scatter the sorted row back.
"""
from __future__ import annotations

import torch


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k / top-p / min-p support.

    logits: (rows, vocab), already divided by temperature. top_k: (rows,) int, 0 = off;
    top_p, min_p: (rows,) float. top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p; min-p keeps tokens with p >= min_p * p_max.
    """
    # Details the tests check: top-p and min-p use the probabilities *after* top-k (renormalised
    # over the k kept tokens); the most likely token is always kept; top_p = 1.0 means off (an
    # fp32 cumulative sum can reach 1.0 before the last token); kept logits are unchanged.
    raise NotImplementedError("exercise: write apply_top_k_top_p_min_p")
