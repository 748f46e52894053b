"""Logits rows -> vLLM's per-position logprob dicts (prompt logprobs, lesson 04).

Row r scores `target_ids[r]`, the prompt token that follows the row's position. Its entry is a
`{token_id: Logprob}` with the k most likely tokens (ranks 1..k) and the target token (with its
own rank: 1 + the tokens strictly more likely), the same shape as the sampler's logprobs
(sampling/sampler.py). The log-softmax is taken in float32 over the raw logits (no penalties,
no temperature): vLLM's raw logprobs.
"""
from __future__ import annotations

import torch

from minipaged.sampling import Logprob
from minipaged.utils import to_device


def logprob_entries(logits: torch.Tensor, target_ids: list[int],
                    ks: list[int]) -> list[dict[int, Logprob]]:
    """logits: (rows, vocab) in the model's dtype; `ks[r]`: top tokens row r keeps."""
    logprobs = logits.float().log_softmax(dim=-1)  # (rows, vocab)
    targets = to_device(target_ids, logits.device, torch.long)  # (rows,)
    target_lp = logprobs.gather(1, targets[:, None]).squeeze(1)  # (rows,)
    ranks = (logprobs > target_lp[:, None]).sum(dim=-1) + 1  # (rows,)
    k_max = min(max(ks), logprobs.shape[1])
    top_ids = top_vals = None
    if k_max > 0:
        top_vals, top_ids = logprobs.topk(k_max, dim=-1)  # (rows, k_max) each
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    target_lp, ranks = target_lp.tolist(), ranks.tolist()
    entries = []
    for r, (token, k) in enumerate(zip(target_ids, ks)):
        entry: dict[int, Logprob] = {}
        if k > 0:
            entry = {tid: Logprob(lp, rank + 1)
                     for rank, (tid, lp) in enumerate(zip(top_ids[r][:k], top_vals[r][:k]))}
        entry.setdefault(token, Logprob(target_lp[r], ranks[r]))
        entries.append(entry)
    return entries
