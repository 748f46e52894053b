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
from numpy.lib.stride_tricks import sliding_window_view

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
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]  # (n,)
            # Windows that start at 0 .. L-n-1: every n-gram but the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)  # (L - n, n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence's next token
                return tokens[start:start + self.k].tolist()
        return []
