"""Tests for `minipaged/spec_decode/ngram_proposer.py`: prompt lookup against a plain-Python
search written independently."""
from __future__ import annotations

import random

import pytest

from minipaged.spec_decode import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The rule in loops: longest n first, most recent earlier start, up to k tokens after."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_finds_the_continuation():
    p = NgramProposer(3, 1, 3)
    #         0  1  2  3  4  5  6
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert p.propose(tokens) == [4, 1, 2]  # "1 2 3" at 0, followed by 4 1 2


def test_no_match_is_empty():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([7]) == []
    assert p.propose([]) == []


def test_most_recent_occurrence_wins():
    p = NgramProposer(2, 2, 2)
    # "2 3" occurs at 1 (then 9) and at 4 (then 7): the later one is proposed.
    assert p.propose([1, 2, 3, 9, 2, 3, 7, 8, 2, 3]) == [7, 8]


def test_longest_n_first():
    # Suffix "5 2 3": n = 3 matches at 4 (then 8); n = 2 "2 3" alone would match at 7 (then 1).
    tokens = [0, 0, 0, 0, 5, 2, 3, 8, 2, 3, 1, 5, 2, 3]
    assert NgramProposer(1, 1, 3).propose(tokens) == [8]
    assert NgramProposer(1, 1, 2).propose(tokens) == [1]


def test_min_n_is_respected():
    # Only the last token repeats: n = 1 matches, n >= 2 does not.
    tokens = [4, 9, 1, 2, 9]
    assert NgramProposer(2, 1, 3).propose(tokens) == [1, 2]
    assert NgramProposer(2, 2, 3).propose(tokens) == []


def test_truncated_at_the_end_of_the_sequence():
    # "5" last seen at 3: only one token follows before the end.
    assert NgramProposer(4, 1, 1).propose([1, 2, 3, 5, 6, 5]) == [6, 5]
    # A run of one token: the nearest match is one step back, one token follows it.
    assert NgramProposer(4, 1, 2).propose([5, 5, 5, 5]) == [5]


def test_the_suffix_itself_is_not_a_match():
    assert NgramProposer(2, 3, 3).propose([1, 2, 3]) == []


def test_matches_the_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        assert NgramProposer(k, lo, hi).propose(tokens) == reference(tokens, k, lo, hi), tokens


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
     "prompt_lookup_max"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        NgramProposer(**kwargs)
