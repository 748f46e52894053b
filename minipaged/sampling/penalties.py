"""Penalties and min_tokens, the sampler's first stage after the raw logprobs (lesson 04).

Repetition (HF's rule: divide a seen token's positive logit by the penalty, multiply a negative
one, over prompt + output), then frequency and presence (OpenAI's rule: subtract per count and
once per token seen, over the output only); min_tokens bans EOS and the stop ids (-inf) until a
row has that many output tokens. Rows are read through `sampler.SamplingRow`'s fields.
"""
from __future__ import annotations

import torch

from minipaged.utils import to_device


def apply_penalties(logits: torch.Tensor, seqs) -> torch.Tensor:
    """In place. Repetition (HF's rule, over prompt + output), then frequency and presence
    (OpenAI's rule, over output tokens only)."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.sampling_params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = to_device(sorted(set(seq.token_ids)), logits.device, torch.long)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                            vals * p.repetition_penalty)
        if seq.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            out = to_device(seq.output_token_ids, logits.device, torch.long)
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def penalize(logits: torch.Tensor, seqs, eos_token_ids) -> torch.Tensor:
    """Penalties, then min_tokens' bans (EOS and stop ids to -inf), on a copy of `logits`
    if any row has one; else `logits` itself."""
    banned_rows = [i for i, s in enumerate(seqs)
                   if s.num_output_tokens < s.sampling_params.min_tokens]
    if not banned_rows and not any(s.sampling_params.has_penalties for s in seqs):
        return logits
    logits = apply_penalties(logits.clone(), seqs)
    for i in banned_rows:
        ban = list(seqs[i].sampling_params.stop_token_ids)
        if not seqs[i].sampling_params.ignore_eos:
            ban += list(eos_token_ids)
        if ban:
            logits[i, to_device(ban, logits.device, torch.int64)] = float("-inf")
    return logits
