"""Logprobs of the sampled tokens and each row's top-k, as vLLM returns them (lesson 04).

vLLM returns the *raw* model log-probabilities (before penalties, temperature and top-k/p), each
with its rank in the vocabulary (1 = most likely); a row's dict holds its top `logprobs` tokens
and the sampled one.
"""
from __future__ import annotations

import torch

from minipaged.sampling.params import Logprob, SamplerOutput


def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params, out: SamplerOutput) -> None:
    """Fill `out.logprobs` / `sampled_logprobs` from the raw log-probabilities `raw` (rows, vocab):
    each asking row's top `logprobs` tokens and its sampled token, with ranks (vLLM's)."""
    # At most the whole vocabulary (max_logprobs=-1 lets a request ask for more).
    k_max = min(max(p.logprobs or 0 for p in params if p.logprobs is not None), raw.shape[1])
    sampled_lp = raw.gather(1, tokens[:, None]).squeeze(1)  # (rows,)
    # rank = 1 + number of tokens strictly more likely than the sampled one
    ranks = (raw > sampled_lp[:, None]).sum(dim=-1) + 1
    top_vals, top_ids = raw.topk(k_max, dim=-1) if k_max > 0 else (None, None)
    sampled_lp, ranks = sampled_lp.tolist(), ranks.tolist()
    tokens_list = tokens.tolist()
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.logprobs.append(None)
            out.sampled_logprobs.append(None)
            continue
        d: dict[int, Logprob] = {}
        if p.logprobs > 0:
            for r, (tid, lp) in enumerate(zip(top_ids[row, :p.logprobs].tolist(),
                                              top_vals[row, :p.logprobs].tolist())):
                d[tid] = Logprob(lp, r + 1)
        d.setdefault(tokens_list[row], Logprob(sampled_lp[row], ranks[row]))
        out.logprobs.append(d)
        out.sampled_logprobs.append(sampled_lp[row])
