"""Stage 7, `sampler` (lesson 04): from logits to the next token, every row its own parameters.

Write `apply_top_k_top_p_min_p` and `Sampler._sample` of minipaged/sampling/sampler.py. While
the grader runs, your functions replace the real ones everywhere they were imported (the engine's
`Sampler` calls both for every batch with a sampled row). Grade them with

    minipaged exercise check sampler

Needs: nothing from earlier stages: logits in, tokens out. `Sampler.sample` (given) widens the
logits to fp32, applies penalties and min_tokens, and takes a batch of greedy rows' argmax
itself; every other batch comes to `_sample`. What you can use there: `s.sampling_params`
(`temperature`, `greedy`, `top_k`, `top_p`, `min_p`, `seed`) and `s.index`, `s.generator` of
each row `s`; `self.engine_generator(device)` (the engine's generator, for rows without a seed);
`to_device(values, device, dtype)`.

Batched: no Python loop over rows in the mask. One way (the project's): sort each row once,
descending; on the sorted row top-k is a rank test, top-p a test on the probability mass ranked
above a token, min-p a test against the top token's probability; then scatter the sorted row
back. Sampling is an exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
"""
from __future__ import annotations

import torch

from minipaged.sampling.sampler import Rows, Sampler  # noqa: F401  (what `self` is)
from minipaged.utils import to_device  # noqa: F401


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


def _sample(self, logits: torch.Tensor, seqs: Rows) -> torch.Tensor:
    # logits: (rows, vocab) fp32, at least one row not greedy. Returns (rows,) token ids.
    # Divide each row by its temperature (a greedy row by 1); truncate when any row asks for
    # top-k / top-p / min-p (top_k above the vocabulary keeps every token); softmax; then one
    # exponential race per row. Rows without a seed draw their noise from the engine's
    # generator, in one draw for all of them; a seeded row from its own generator, made on its
    # first draw as torch.Generator(device).manual_seed(seed + s.index) and kept in
    # s.generator, so its tokens do not depend on its batch. Greedy rows take the argmax of
    # the logits.
    raise NotImplementedError("exercise: write Sampler._sample")
