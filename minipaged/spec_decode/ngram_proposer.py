"""Prompt lookup (n-gram) proposals: the cheapest draft there is, no model at all.

Lesson 10 (speculative decoding) measures how often stories260K accepts them. Text repeats
itself (names, phrases, code identifiers), so the tokens that followed an earlier occurrence of
the sequence's last n tokens are a good guess for what comes next:

    tokens:  ... the  cat  sat  on  the  mat  .  The  cat  sat  |  ?
    suffix (n = 2):  "cat sat"  -> found earlier, followed by "on the mat ."
    proposal (k = 3):  on  the  mat

vLLM's rule: try n from prompt_lookup_max down to prompt_lookup_min and take the first n whose
suffix occurs earlier. This proposer takes the suffix's most recent earlier occurrence (the
nearest context; vLLM's V0 worker took the first one), and returns up to k tokens after it,
fewer where the sequence ends first, [] when no n matches.
"""
from __future__ import annotations

import numpy as np

from minipaged.validation import check_int


class NgramProposer:
    """`propose(token_ids)` -> up to `num_speculative_tokens` guessed next tokens."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4):
        self.k = check_int("num_speculative_tokens", num_speculative_tokens, 1)
        self.min_n = check_int("prompt_lookup_min", prompt_lookup_min, 1)
        self.max_n = check_int("prompt_lookup_max", prompt_lookup_max, self.min_n,
                               note=" (at least prompt_lookup_min)")

    def propose(self, token_ids) -> list[int]:
        """token_ids: the whole sequence so far (prompt + output), a list or 1-d array."""
        tokens = np.asarray(token_ids, dtype=np.int64)  # (L,)
        length = len(tokens)
        if length < 2:
            return []
        # Every earlier n-gram that matches the suffix ends with the last token: the candidates
        # are the positions before the last that hold it (L - 1 excluded: the suffix itself).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # (candidates,)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            cand = ends[ends >= n - 1]  # room for n - 1 tokens before the end
            match = np.ones(len(cand), dtype=bool)
            for back in range(1, n):  # compare the suffix's other tokens, right to left
                match &= tokens[cand - back] == tokens[length - 1 - back]
            if match.any():
                start = int(cand[match][-1]) + 1  # after the most recent occurrence
                return tokens[start:start + self.k].tolist()
        return []
