"""Tests for `minipaged/sampling/rejection_sampler.py`: speculative decoding's verification rule.

The distribution tests run the rule on many independent rows at once (one toy p and q over 8
tokens), count the first emitted token and compare the counts with p by a chi-square test. The
threshold is shown to reject rules that are close but wrong: accepting every guess, or resampling
from p instead of the residual.
"""
from __future__ import annotations

import pytest
import torch

from minipaged.sampling.rejection_sampler import rejection_sample

VOCAB = 8
ROWS = 20_000
P_VALUE_FLOOR = 1e-3  # a correct rule fails this one time in a thousand; seeds are fixed


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of the counts of `tokens` against `probs` (vocab,), cells with p > 0 only; a token
    outside the support gives 0."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs.double()[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def toy_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a proposer q that disagree: q puts mass where p has little, and misses
    token 7 that p likes."""
    p = torch.tensor([0.05, 0.20, 0.05, 0.10, 0.25, 0.05, 0.10, 0.20])
    q = torch.tensor([0.30, 0.10, 0.15, 0.05, 0.20, 0.15, 0.05, 0.00])
    return p, q


def sample_drafts(q: torch.Tensor, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(q, rows * k, replacement=True, generator=gen).view(rows, k)


def run_toy(k: int, seed: int = 0, n_gram: bool = False):
    """ROWS rows proposing k tokens each from q (or n-gram guesses, uniform), target p at every
    position. Returns (output_token_ids, num_accepted, drafts, p, q)."""
    p, q = toy_pair()
    gen = torch.Generator().manual_seed(seed)
    drafts = sample_drafts(torch.ones(VOCAB) if n_gram else q, ROWS, k, gen)
    target = p.expand(ROWS, k + 1, VOCAB)
    draft_probs = None if n_gram else q.expand(ROWS, k, VOCAB)
    out, acc = rejection_sample(target, drafts, torch.full((ROWS,), k), draft_probs,
                                generator=gen)
    return out, acc, drafts, p, q


# --- the distribution ---------------------------------------------------------------------
def test_first_token_follows_target():
    out, acc, _, p, q = run_toy(k=1)
    assert 0 < acc.float().mean() < 1  # both branches ran
    assert chi_square_p_value(out[:, 0], p) > P_VALUE_FLOOR
    # Accepted with probability sum(min(p, q)) = 0.55 here.
    assert abs(acc.float().mean().item() - torch.minimum(p, q).sum().item()) < 0.02


def test_second_token_follows_target_after_an_acceptance():
    """k = 2: the token after an accepted first guess is a guess (accepted or corrected) or the
    bonus; either way it follows p."""
    out, acc, _, p, _ = run_toy(k=2, seed=1)
    second = out[acc >= 1, 1]
    assert (acc == 2).any() and (acc == 1).any()
    assert chi_square_p_value(second, p) > P_VALUE_FLOOR


def test_bonus_token_follows_the_target_after_the_guesses():
    """All guesses kept: the bonus comes from p at the position after them (here another
    distribution than at the guess), not from a residual."""
    p, q = toy_pair()
    p_next = torch.tensor([0.30, 0.02, 0.18, 0.10, 0.05, 0.15, 0.10, 0.10])
    gen = torch.Generator().manual_seed(4)
    drafts = sample_drafts(q, ROWS, 1, gen)
    target = torch.stack([p, p_next]).expand(ROWS, 2, VOCAB)
    out, acc = rejection_sample(target, drafts, torch.ones(ROWS, dtype=torch.long),
                                q.expand(ROWS, 1, VOCAB), generator=gen)
    assert chi_square_p_value(out[acc == 1, 1], p_next) > P_VALUE_FLOOR
    assert chi_square_p_value(out[acc == 0, 0], (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
                              ) > P_VALUE_FLOOR  # and a correction from the residual


def test_threshold_rejects_biased_rules():
    """The same test fails rules that are nearly right, so passing it means something."""
    out, acc, drafts, p, q = run_toy(k=1)
    # Accept every guess: the output follows q.
    assert chi_square_p_value(drafts[:, 0], p) < P_VALUE_FLOOR
    # Keep the real acceptances but resample from p instead of the residual max(0, p - q).
    gen = torch.Generator().manual_seed(5)
    from_p = torch.multinomial(p, ROWS, replacement=True, generator=gen)
    biased = torch.where(acc == 1, drafts[:, 0], from_p)
    assert chi_square_p_value(biased, p) < P_VALUE_FLOOR


def test_one_hot_rule_is_lossless_for_any_guess():
    """The n-gram rule (accept with p(x), correct from p without x) keeps p whatever produced the
    guess, here q's samples: each fixed guess is lossless, so any mixture of guesses is. A draft
    model's q only raises how often guesses are kept (sum min(p, q) instead of sum p q)."""
    p, q = toy_pair()
    gen = torch.Generator().manual_seed(3)
    drafts = sample_drafts(q, ROWS, 1, gen)
    out, acc = rejection_sample(p.expand(ROWS, 2, VOCAB), drafts,
                                torch.ones(ROWS, dtype=torch.long), None, generator=gen)
    assert chi_square_p_value(out[:, 0], p) > P_VALUE_FLOOR
    assert abs(acc.float().mean().item() - (p * q).sum().item()) < 0.02


def test_ngram_guesses_follow_target():
    """draft_probs=None: q is one-hot at the guess, accepted with probability p(guess)."""
    out, acc, drafts, p, _ = run_toy(k=1, seed=2, n_gram=True)
    assert chi_square_p_value(out[:, 0], p) > P_VALUE_FLOOR
    # Uniform guesses are accepted with probability mean(p) = 1/8.
    assert abs(acc.float().mean().item() - 1 / VOCAB) < 0.01
    # A rejected guess is never emitted in its place (the residual removes it).
    rejected = acc == 0
    assert not (out[rejected, 0] == drafts[rejected, 0]).any()


def test_zero_residual_falls_back_to_target():
    """p == q and a guess outside both (q(x) = 0): rejected, the residual is zero everywhere,
    the token comes from p (here all on token 3)."""
    p = torch.zeros(VOCAB)
    p[3] = 1.0
    out, acc = rejection_sample(p.expand(4, 2, VOCAB), torch.full((4, 1), 5),
                                torch.ones(4, dtype=torch.long), p.expand(4, 1, VOCAB))
    assert acc.tolist() == [0] * 4
    assert out[:, 0].tolist() == [3] * 4


# --- greedy rows ---------------------------------------------------------------------------
def greedy_target(argmaxes: list[list[int]]) -> torch.Tensor:
    """(rows, positions, VOCAB) probabilities whose argmax at each position is given."""
    t = torch.full((len(argmaxes), len(argmaxes[0]), VOCAB), 0.5 / (VOCAB - 1))
    for r, row in enumerate(argmaxes):
        for i, a in enumerate(row):
            t[r, i, a] = 0.5
    return t


def test_greedy_accepts_while_argmax_agrees():
    target = greedy_target([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [6, 2, 3]])
    out, acc = rejection_sample(target, drafts, torch.tensor([3, 3, 3]),
                                greedy_mask=torch.ones(3, dtype=torch.bool))
    assert acc.tolist() == [3, 1, 0]
    assert out.tolist() == [[1, 2, 3, 4],  # all accepted, bonus = argmax at position 3
                            [1, 2, -1, -1],  # rejected at 1: the target's argmax there
                            [1, -1, -1, -1]]


def test_greedy_ignores_draft_probs_and_randomness():
    target = greedy_target([[1, 2, 3]])
    drafts = torch.tensor([[1, 2]])
    q = torch.full((1, 2, VOCAB), 1.0 / VOCAB)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        out, acc = rejection_sample(target, drafts, torch.tensor([2]), q,
                                    torch.tensor([True]), generator=gen)
        assert out.tolist() == [[1, 2, 3]] and acc.tolist() == [2]


def test_mixed_greedy_and_sampled_rows():
    """A greedy row keeps its argmax rule beside sampled rows in one call."""
    target = greedy_target([[1, 2, 3], [1, 2, 3]])
    target[1] = torch.zeros(3, VOCAB).index_fill_(1, torch.tensor([4]), 1.0)  # sampled: all on 4
    drafts = torch.tensor([[1, 7], [4, 4]])
    out, acc = rejection_sample(target, drafts, torch.tensor([2, 2]),
                                greedy_mask=torch.tensor([True, False]))
    assert out.tolist() == [[1, 2, -1], [4, 4, 4]]
    assert acc.tolist() == [1, 2]


# --- padding and rows without proposals ------------------------------------------------------
def test_padding_is_never_accepted():
    """Row 0 proposes 1 of max_k = 3; its padding (-1) would clamp to token 0, which is the
    target's argmax at position 1: still not accepted, the bonus comes from position 1."""
    target = greedy_target([[1, 0, 0, 0], [1, 0, 0, 0]])
    drafts = torch.tensor([[1, -1, -1], [1, 0, 0]])
    out, acc = rejection_sample(target, drafts, torch.tensor([1, 3]),
                                greedy_mask=torch.ones(2, dtype=torch.bool))
    assert acc.tolist() == [1, 3]
    assert out.tolist() == [[1, 0, -1, -1], [1, 0, 0, 0]]


def test_padding_is_never_accepted_by_sampled_rows():
    """Sampled rows look up p at the clamped padding id 0; p puts all its mass there."""
    p = torch.zeros(2, 4, VOCAB)
    p[:, :, 0] = 1.0
    p[:, 0] = 0.0
    p[:, 0, 1] = 1.0  # position 0: all on token 1
    drafts = torch.tensor([[1, -1, -1], [1, 0, 0]])
    out, acc = rejection_sample(p, drafts, torch.tensor([1, 3]))
    assert acc.tolist() == [1, 3]
    assert out.tolist() == [[1, 0, -1, -1], [1, 0, 0, 0]]


def test_row_without_proposals_samples_from_position_zero():
    p = torch.zeros(2, 3, VOCAB)
    p[:, 0, 6] = 1.0  # position 0 all on token 6; later positions all on 2
    p[:, 1:, 2] = 1.0
    out, acc = rejection_sample(p, torch.tensor([[-1, -1], [2, 2]]), torch.tensor([0, 2]))
    assert acc.tolist() == [0, 0]  # row 1's guess 2 has p = 0 at position 0: rejected
    assert out.tolist() == [[6, -1, -1], [6, -1, -1]]


def test_no_speculation_at_all():
    """max_k = 0: one token per row from position 0, as a plain sampler."""
    p = torch.zeros(3, 1, VOCAB)
    p[:, 0, 5] = 1.0
    out, acc = rejection_sample(p, torch.empty(3, 0, dtype=torch.long), torch.zeros(3))
    assert out.tolist() == [[5]] * 3 and acc.tolist() == [0] * 3


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample(torch.ones(2, 2, VOCAB), torch.zeros(2, 2, dtype=torch.long),
                         torch.ones(2))
    with pytest.raises(ValueError, match="generators must have one entry per row"):
        rejection_sample(torch.ones(2, 3, VOCAB), torch.zeros(2, 2, dtype=torch.long),
                         torch.ones(2), generators=[None])


# --- seeds ---------------------------------------------------------------------------------
def seeded_call(seed: int, neighbours: int, max_k: int, neighbour_seed: int):
    """Row 0 has its own generator and proposes 2 tokens; the neighbours and the padding
    (max_k) vary between calls."""
    p, q = toy_pair()
    gen = torch.Generator().manual_seed(neighbour_seed)
    rows = 1 + neighbours
    drafts = torch.full((rows, max_k), -1)
    drafts[:, :2] = torch.tensor([4, 0])
    drafts[1:] = sample_drafts(q, neighbours, max_k, gen) if neighbours else drafts[1:]
    num = torch.full((rows,), max_k)
    num[0] = 2
    gens = [torch.Generator().manual_seed(seed)] + [None] * neighbours
    return rejection_sample(p.expand(rows, max_k + 1, VOCAB), drafts, num,
                            q.expand(rows, max_k, VOCAB), generators=gens, generator=gen)


def test_seeded_rows_replay_whatever_the_batch():
    runs = [seeded_call(7, neighbours, max_k, ns)
            for neighbours, max_k, ns in [(0, 2, 0), (5, 4, 1), (9, 3, 2)]]
    first = [out[0, :acc[0] + 1].tolist() for out, acc in runs]
    assert first[0] == first[1] == first[2]
    # Different seeds give different tokens somewhere (the row is random, not fixed).
    others = {tuple(seeded_call(s, 2, 3, 0)[0][0].tolist()) for s in range(20)}
    assert len(others) > 1


# --- on a GPU ------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_rule_follows_the_target_and_seeds_replay():
    p, q = (t.cuda() for t in toy_pair())
    gen = torch.Generator(device="cuda").manual_seed(0)
    drafts = torch.multinomial(q, ROWS, replacement=True, generator=gen)[:, None]
    out, acc = rejection_sample(p.expand(ROWS, 2, VOCAB), drafts,
                                torch.ones(ROWS, dtype=torch.long, device="cuda"),
                                q.expand(ROWS, 1, VOCAB), generator=gen)
    assert chi_square_p_value(out[:, 0].cpu(), p.cpu()) > P_VALUE_FLOOR
    seeded = []
    for neighbours in (0, 5):
        rows = 1 + neighbours
        gens = [torch.Generator(device="cuda").manual_seed(7)] + [None] * neighbours
        o, a = rejection_sample(p.expand(rows, 3, VOCAB), torch.tensor([[4, 0]] * rows).cuda(),
                                torch.full((rows,), 2, device="cuda"),
                                q.expand(rows, 2, VOCAB), generators=gens, generator=gen)
        seeded.append(o[0, :a[0] + 1].tolist())
    assert seeded[0] == seeded[1]
