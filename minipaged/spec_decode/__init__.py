"""Speculative decoding (lesson 10): proposers guess the next tokens, the target verifies them.

Reading order:

    config.py          `speculative_config` (vLLM's dict) checked, and what it cannot combine with
    request_checks.py  the requests it refuses (beam search, n > 1)
    ngram_proposer.py  prompt lookup: the tokens that followed the sequence's last n tokens before
    draft_proposer.py  a smaller model with the target's vocabulary guesses k tokens greedily
    scheduler.py       a decode with proposals runs 1 + k tokens, slots reserved up front
    step_loop.py       the engine's step loop (engine/step_loop.py's seam): propose, verify, roll back
    verify.py          the target's logits at every proposed position -> the tokens a step emits
    cuda_graphs.py     CUDA graphs for verify steps (k + 1 query tokens per sequence)

The rule that keeps a guess or replaces it lives in `minipaged/sampling/rejection_sampler.py`.
"""
from minipaged.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer"]
