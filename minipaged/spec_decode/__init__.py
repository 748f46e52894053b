"""Speculative decoding (lesson 10): proposers guess the next tokens, the target verifies them.

`NgramProposer` (prompt lookup) finds the sequence's last n tokens earlier in the sequence and
proposes what followed them; the verification rule lives in `minipaged/sampling/
rejection_sampler.py`.
"""
from minipaged.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer"]
