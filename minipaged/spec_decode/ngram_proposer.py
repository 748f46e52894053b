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

One pass finds it: every matching n-gram ends with the sequence's last token, so the proposer
walks the earlier positions of that token from the most recent back, measures how far each
match reaches (up to prompt_lookup_max), and keeps the first with the longest match. About 15 us
for 1,500 tokens (3x a numpy sliding-window search, whose conversion of the list alone costs
more), which matters when every sequence of a batch of 256 proposes at every step.
"""
from __future__ import annotations

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
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        length = len(tokens)
        max_n = min(self.max_n, length - 1)
        if max_n < self.min_n:
            return []
        # Every earlier n-gram that matches the suffix ends with the last token. Walk those
        # positions from the most recent back (list.index on the reversed list runs in C), and
        # keep the first one with the longest match: that is the longest n, most recent start.
        reversed_tokens = tokens[::-1]  # reversed_tokens[r] is tokens[length - 1 - r]
        best_n, best_end = 0, -1
        r = 0
        while True:
            try:
                r = reversed_tokens.index(tokens[-1], r + 1)
            except ValueError:
                break
            end = length - 1 - r  # an earlier position holding the last token
            n = 1  # how many tokens, ending at `end`, equal the suffix's
            while n < max_n and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == max_n:
                    break  # nothing longer is allowed
        if best_n < self.min_n:
            return []
        return tokens[best_end + 1:best_end + 1 + self.k]
