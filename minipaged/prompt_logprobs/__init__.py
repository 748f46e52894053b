"""Prompt logprobs: the model's log-probability of every prompt token (lesson 04).

A prefill computes a hidden state at every prompt position, and the engine normally turns only
the last one into logits (it predicts the first new token). `SamplingParams(prompt_logprobs=k)`
keeps the others too: position i's logits score prompt token i + 1, so
`RequestOutput.prompt_logprobs` holds, for every prompt token after the first, a
`{token_id: Logprob}` with that token's own log-probability and rank plus the k most likely
tokens (vLLM's semantics; None at position 0, which nothing predicts). That is what perplexity,
likelihood-scored benchmarks and `/v1/completions` with `echo` need.

    extension.py   the request extension: checks a request, marks it to skip reading the
                   prefix cache until its prompt is scored (a hit has no logits), keeps the
                   requests still being scored
    runner.py      the runner wrapper: a step with such a request computes the logits of its
                   prompt rows too, after the rows that sample, a slice at a time
    compute.py     logits rows -> {token_id: Logprob} per prompt position
    scoring.py     `score_prompts` and `perplexity`: a prompt's negative log-likelihood

Both are attached when the engine is built (engine/build.py) and cost nothing while no request
asks: the runner hands the step to the runner it wraps unchanged.
"""
from minipaged.prompt_logprobs.scoring import PromptScore, perplexity, score_prompts

__all__ = ["PromptScore", "perplexity", "score_prompts"]
