"""Scoring text with the engine: a prompt's log-likelihood and perplexity (lesson 04).

    scores = score_prompts(llm, ["Once upon a time, there was a cat."])
    scores[0].token_logprobs   # [None, log p(t1 | t0), log p(t2 | t0 t1), ...]
    scores[0].nll              # -sum of them: the negative log-likelihood, in nats
    perplexity(scores)         # exp(total nll / scored tokens), over all the prompts

Each prompt runs as a request with `prompt_logprobs=0` and `max_tokens=1`: one prefill (the
one sampled token is not counted). The first token is not scored: nothing comes before it (a
prompt that starts with BOS scores everything after BOS). This is what an evaluation harness's
"loglikelihood" request asks for: the log-probabilities of a continuation after a context are
the entries of `token_logprobs` at the continuation's positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from minipaged.sampling import SamplingParams


@dataclass
class PromptScore:
    token_ids: list[int]
    token_logprobs: list[Optional[float]]  # per prompt token; None at position 0

    @property
    def num_scored(self) -> int:
        return len(self.token_ids) - 1

    @property
    def nll(self) -> float:
        """Negative log-likelihood of tokens 1.. given the ones before them, in nats."""
        return -math.fsum(self.token_logprobs[1:])

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.num_scored) if self.num_scored else float("nan")


def score_prompts(llm, prompts, lora_request=None, use_tqdm: bool = False) -> list[PromptScore]:
    """The log-probability of every token of each prompt (text, token ids, or a list of
    either) under `llm`'s model, one prefill per prompt (`LLM.generate`)."""
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0, detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
    return [PromptScore(o.prompt_token_ids,
                        [None] + [entry[t].logprob for entry, t in
                                  zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
            for o in outs]


def perplexity(scores: list[PromptScore]) -> float:
    """exp(total negative log-likelihood / total scored tokens) over all the prompts: the
    corpus perplexity (each token weighs the same, whichever prompt it is in)."""
    num_tokens = sum(s.num_scored for s in scores)
    if num_tokens == 0:
        raise ValueError("no token to score: every prompt has a single token")
    return math.exp(math.fsum(s.nll for s in scores) / num_tokens)
