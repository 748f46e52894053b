"""Tests for `minipaged/sampling/sampler.py`: every stage of the sampler against a direct reference.

References are written the slow, obvious way (sort one row in float64, loop over tokens), so
they share no code with the batched implementation they check.
"""
from __future__ import annotations

import math

import pytest
import torch

from minipaged.sampling import Sampler, SamplingParams, apply_penalties, apply_top_k_top_p_min_p
from minipaged.engine.sequence import Sequence

EOS = 2


def make_seq(prompt, output=(), name="r", **params) -> Sequence:
    seq = Sequence(request_id=name, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    return seq


def distinct_logits(gen: torch.Generator, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    """Random logits without ties: a random permutation of a spread-out grid, plus jitter."""
    out = torch.empty(rows, vocab)
    for r in range(rows):
        grid = torch.linspace(-scale, scale, vocab)
        jitter = (torch.rand(vocab, generator=gen) - 0.5) * (2 * scale / vocab) * 0.5
        out[r] = (grid + jitter)[torch.randperm(vocab, generator=gen)]
    return out


# --- top-k / top-p / min-p ------------------------------------------------------------------
def reference_support(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """One row, float64, by the book: top-k, then top-p and min-p on the renormalized top-k."""
    logits = row.double().tolist()
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    k = top_k if top_k > 0 else len(logits)
    kept = order[:k]
    m = max(logits[i] for i in kept)
    z = sum(math.exp(logits[i] - m) for i in kept)
    p = {i: math.exp(logits[i] - m) / z for i in kept}
    support, mass = set(), 0.0
    for i in kept:  # the smallest most-likely set whose probability reaches top_p
        if mass < top_p and p[i] >= min_p * p[kept[0]]:
            support.add(i)
        mass += p[i]
    return support | {kept[0]}


def margin_ok(row: torch.Tensor, top_k: int, top_p: float, min_p: float, eps: float = 1e-4) -> bool:
    """False when a threshold sits so close to a cumulative mass / ratio that fp32 may decide
    either way (those rows are skipped, not compared)."""
    logits = sorted(row.double().tolist(), reverse=True)[:top_k if top_k > 0 else None]
    z = sum(math.exp(x - logits[0]) for x in logits)
    p = [math.exp(x - logits[0]) / z for x in logits]
    cum = 0.0
    for q in p:
        if top_p < 1.0 and abs(cum - top_p) < eps:
            return False
        if min_p > 0 and abs(q - min_p * p[0]) < eps * p[0]:
            return False
        cum += q
    return True


def check_rows(logits, top_k, top_p, min_p):
    out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor(top_k), torch.tensor(top_p),
                                  torch.tensor(min_p))
    assert out.shape == logits.shape
    checked = 0
    for r in range(logits.shape[0]):
        kept = torch.isfinite(out[r])
        # Kept tokens keep their logits exactly; removed ones are -inf.
        assert torch.equal(out[r][kept], logits[r][kept])
        assert torch.all(out[r][~kept] == float("-inf"))
        if not margin_ok(logits[r], top_k[r], top_p[r], min_p[r]):
            continue
        got = set(torch.nonzero(kept).flatten().tolist())
        want = reference_support(logits[r], top_k[r], top_p[r], min_p[r])
        assert got == want, (f"row {r} (top_k={top_k[r]}, top_p={top_p[r]}, min_p={min_p[r]}): "
                             f"kept {sorted(got)}, expected {sorted(want)}")
        checked += 1
    return checked


def test_top_k_top_p_min_p_support_matches_reference_random():
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(40):
        rows, vocab = 12, int(torch.randint(2, 60, (1,), generator=gen))
        logits = distinct_logits(gen, rows, vocab, scale=float(torch.rand(1, generator=gen) * 6 + 0.5))
        top_k = [int(x) for x in torch.randint(0, vocab + 2, (rows,), generator=gen)]
        top_k = [k if k <= vocab or k % 2 else 0 for k in top_k]  # some off, some >= vocab
        top_p = [float(x) for x in torch.rand(rows, generator=gen).clamp_min(1e-3)]
        min_p = [float(x) * 0.5 for x in torch.rand(rows, generator=gen)]
        for r in range(0, 6, 3):  # each filter alone in some rows, combined in the others
            top_p[r], min_p[r] = 1.0, 0.0
        for r in range(1, 6, 3):
            top_k[r], min_p[r] = 0, 0.0
        for r in range(2, 6, 3):
            top_k[r], top_p[r] = 0, 1.0
        checked += check_rows(logits, top_k, top_p, min_p)
    assert checked >= 450  # the margin filter skipped only a few rows


def test_top_k_1_and_tiny_top_p_keep_only_the_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = distinct_logits(gen, 6, 50)
    for top_k, top_p in [(1, 1.0), (0, 1e-6), (3, 1e-6), (1, 0.5)]:
        out = apply_top_k_top_p_min_p(logits.clone(), torch.full((6,), top_k),
                                      torch.full((6,), top_p), torch.zeros(6))
        kept = torch.isfinite(out)
        assert kept.sum(dim=-1).tolist() == [1] * 6
        assert torch.equal(kept.float().argmax(-1), logits.argmax(-1))


def test_top_p_at_midpoints_between_cumulative_masses():
    """top_p strictly between two cumulative masses: exactly one more token than the first
    cumulative mass below it (never a boundary case)."""
    gen = torch.Generator().manual_seed(2)
    logits = distinct_logits(gen, 20, 30, scale=2.0)
    top_p, expected = [], []
    for r in range(20):
        p = logits[r].double().softmax(-1).sort(descending=True).values
        cum = p.cumsum(0)
        j = r % 10
        top_p.append(float((cum[j] + cum[j + 1]) / 2))
        expected.append(j + 2)  # tokens 0..j sum to cum[j] < top_p: token j+1 is needed too
    out = apply_top_k_top_p_min_p(logits.clone(), torch.zeros(20, dtype=torch.long),
                                  torch.tensor(top_p), torch.zeros(20))
    assert torch.isfinite(out).sum(-1).tolist() == expected


def test_top_p_reached_exactly_needs_no_further_token():
    # Probabilities 0.5, 0.25, 0.125, 0.125 are exact in binary floating point.
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0]]) * math.log(2.0)
    probs = logits.softmax(-1)
    assert probs.tolist() == [[0.5, 0.25, 0.125, 0.125]]
    kept = []
    for top_p in (0.5, 0.75, 0.875, 0.5 + 1e-6, 1e-9):
        out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor([0]), torch.tensor([top_p]),
                                      torch.tensor([0.0]))
        kept.append(int(torch.isfinite(out).sum()))
    assert kept == [1, 2, 3, 2, 1]


def test_min_p_keeps_tokens_within_ratio_of_the_top_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.25, 0.25 * 0.99, 0.3, 0.2 + 0.25 * 0.01]]))
    out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]),
                                  torch.tensor([0.2, 0.8]))
    # row 0: 0.12 >= 0.2 * 0.5 kept, 0.08 < 0.1 removed; row 1: p_max 0.3, 0.24 >= 0.8 * 0.3.
    assert torch.isfinite(out).tolist() == [[True, True, True, False], [True, True, True, False]]


def test_disabled_filters_keep_the_whole_vocabulary():
    """A row with top_k=0, top_p=1, min_p=0 keeps every token even when another row in the
    batch turns filtering on, including on a large vocabulary where fp32 cumulative sums
    reach 1.0 before the last tokens (and with one dominant token)."""
    gen = torch.Generator().manual_seed(3)
    vocab = 32000
    logits = torch.randn(4, vocab, generator=gen) * 3
    logits[1, 7] = 40.0  # one token with probability ~1
    out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor([0, 0, 50, 0]),
                                  torch.tensor([1.0, 1.0, 1.0, 0.9]), torch.zeros(4))
    for r in (0, 1):
        lost = int((~torch.isfinite(out[r])).sum())
        assert lost == 0, f"row {r} has top_p=1.0 (off) but lost {lost} of {vocab} tokens"
    assert int(torch.isfinite(out[2]).sum()) == 50  # top-k 50 alone: top_p=1 must not cut it
    assert torch.equal(out[:2], logits[:2])


# --- penalties ------------------------------------------------------------------------------
def reference_penalties(logits: list[float], prompt, output, rep, freq, pres) -> list[float]:
    out = list(logits)
    for t in set(prompt) | set(output):  # HF repetition penalty over prompt + output
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):  # OpenAI: frequency per occurrence, presence once, output only
        out[t] -= freq * output.count(t) + pres
    return out


@pytest.mark.parametrize("rep, freq, pres", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0),
                                             (1.0, 0.0, 1.5), (1.0, -0.4, -0.3), (1.8, 0.9, 0.6)])
def test_penalties_match_reference(rep, freq, pres):
    gen = torch.Generator().manual_seed(4)
    vocab = 20
    seqs, refs = [], []
    logits = torch.randn(5, vocab, generator=gen) * 2
    for r in range(5):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, 8, (r * 3,), generator=gen).tolist()  # row 0: no output yet
        seqs.append(make_seq(prompt, output, repetition_penalty=rep, frequency_penalty=freq,
                             presence_penalty=pres))
        refs.append(reference_penalties(logits[r].tolist(), prompt, output, rep, freq, pres))
    assert any(len(set(s.output_token_ids)) < s.num_output_tokens for s in seqs)  # repeats
    got = apply_penalties(logits.clone(), seqs)
    torch.testing.assert_close(got, torch.tensor(refs), rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, logits)  # the penalty did something


def test_penalties_touch_only_their_rows():
    logits = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0]])
    seqs = [make_seq([0, 1], [2, 2], repetition_penalty=2.0, frequency_penalty=0.5),
            make_seq([0, 1], [2, 2])]
    got = apply_penalties(logits.clone(), seqs)
    assert got.tolist() == [[0.5, -2.0, 1.0 - 1.0], [1.0, -1.0, 2.0]]


def test_sampler_applies_penalties_before_greedy_argmax():
    logits = torch.tensor([[5.0, 4.0, 0.0, 3.0]])
    seq = make_seq([1], [0, 0], temperature=0.0, frequency_penalty=1.5)
    # 5 - 2 * 1.5 = 2 < 4: token 1 wins although it is in the prompt (frequency is output-only).
    assert Sampler()(logits.clone(), [seq]).token_ids == [1]
    seq = make_seq([1], [0, 0], temperature=0.0, repetition_penalty=2.0)
    # 5 / 2 = 2.5, 4 / 2 = 2: token 3 wins.
    assert Sampler()(logits.clone(), [seq]).token_ids == [3]


# --- greedy, min_tokens ---------------------------------------------------------------------
def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(5)
    logits = distinct_logits(gen, 12, 40)
    seqs = []
    for r in range(12):
        if r % 2 == 0:
            seqs.append(make_seq([1], temperature=0.0))
        else:
            seqs.append(make_seq([1], temperature=1.5, top_k=5 if r % 3 else 0, top_p=0.9,
                                 seed=r if r % 4 == 1 else None))
    sampler = Sampler(seed=0)
    for _ in range(5):
        tokens = sampler(logits, seqs).token_ids
        for r in range(0, 12, 2):
            assert tokens[r] == int(logits[r].argmax())
    # An all-greedy batch takes the fast path: the same answer.
    greedy = [make_seq([1], temperature=0.0) for _ in range(12)]
    assert sampler(logits, greedy).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_token_ids(temperature):
    vocab = 8
    logits = torch.zeros(200, vocab)
    logits[:, EOS] = 10.0  # EOS and the stop ids are by far the most likely tokens
    logits[:, 5] = 9.0
    logits[:, 6] = 8.0
    sampler = Sampler(seed=0, eos_token_ids=[EOS])
    params = dict(temperature=temperature, min_tokens=3, stop_token_ids=[5, 6])
    young = make_seq([1], [3, 3], **params)  # 2 outputs < min_tokens
    tokens = sampler(logits.clone(), [young] * 200).token_ids
    assert not {EOS, 5, 6} & set(tokens)
    if temperature == 0.0:
        assert set(tokens) == {0}  # the argmax among the allowed tokens (ties: the first)
    else:
        assert len(set(tokens)) == 5  # all other tokens, uniformly likely, show up
    old = make_seq([1], [3, 3, 3], **params)  # min_tokens reached: EOS allowed again
    tokens = sampler(logits.clone(), [old] * 200).token_ids
    assert EOS in tokens
    # ignore_eos: the engine will not stop on EOS, so only the stop ids are banned.
    lax = make_seq([1], [3], ignore_eos=True, **params)
    assert EOS in sampler(logits.clone(), [lax] * 200).token_ids
    assert not {5, 6} & set(sampler(logits.clone(), [lax] * 200).token_ids)


# --- seeds and distributions ----------------------------------------------------------------
def test_seeded_requests_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(6)
    vocab, steps = 64, 6
    step_logits = [distinct_logits(gen, 1, vocab, scale=1.0)[0] for _ in range(steps)]
    params = dict(temperature=1.3, top_p=0.95, seed=1234)

    def run(batch_maker, sampler_seed):
        target = make_seq([1, 2], name="target", **params)
        sampler = Sampler(seed=sampler_seed)
        tokens = []
        for step in range(steps):
            others = batch_maker(step)
            pos = step % (len(others) + 1)
            seqs = others[:pos] + [target] + others[pos:]
            logits = torch.randn(len(seqs), vocab, generator=gen)
            logits[pos] = step_logits[step]
            token = sampler(logits, seqs).token_ids[pos]
            target.append_token(token)
            tokens.append(token)
        return tokens

    alone = run(lambda step: [], 0)
    mixes = [
        lambda step: [make_seq([3], temperature=1.0), make_seq([4], temperature=0.0)],
        lambda step: [make_seq([3], temperature=0.7, seed=99, top_k=3)] * (step + 1),
        lambda step: [make_seq([3], temperature=2.0, min_p=0.1) for _ in range(5)]
        + [make_seq([4], seed=1234, temperature=1.3)],
    ]
    for i, mix in enumerate(mixes):
        assert run(mix, sampler_seed=i + 1) == alone, f"batch mix {i} changed a seeded request"
    # A different seed gives a different stream (the seed is really used).
    other = make_seq([1, 2], temperature=1.3, top_p=0.95, seed=4321)
    sampler = Sampler()
    diff = []
    for step in range(steps):
        diff.append(sampler(step_logits[step][None].clone(), [other]).token_ids[0])
        other.append_token(diff[-1])
    assert diff != alone


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0])
    n = 60_000
    seq = make_seq([1], temperature=temperature)
    tokens = Sampler(seed=7)(logits.repeat(n, 1), [seq] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    probs = (logits.double() / temperature).softmax(-1)
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5. The fixed seed makes the test deterministic.
    assert chi_square(counts, probs) < 30.0, (counts / n, probs)
    # The bound has power: the distribution at another temperature is rejected by far.
    wrong = (logits.double() / (temperature * 1.5)).softmax(-1)
    assert chi_square(counts, wrong) > 100.0


def test_top_k_sampling_matches_the_truncated_softmax():
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0])
    n = 40_000
    seq = make_seq([1], temperature=0.8, top_k=3)
    tokens = Sampler(seed=8)(logits.repeat(n, 1), [seq] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1, 3}
    probs = (logits[[0, 1, 3]].double() / 0.8).softmax(-1)
    assert chi_square(counts[[0, 1, 3]], probs) < 25.0


# --- logprobs -------------------------------------------------------------------------------
def test_logprobs_hold_top_k_and_the_sampled_token():
    gen = torch.Generator().manual_seed(9)
    vocab = 30
    logits = distinct_logits(gen, 6, vocab)
    seqs = [make_seq([1], logprobs=3, temperature=1.0),
            make_seq([1, 4, 4], [4], logprobs=5, temperature=0.0, repetition_penalty=3.0),
            make_seq([1], temperature=1.0),  # no logprobs asked
            make_seq([1], logprobs=0, temperature=5.0),
            make_seq([1], logprobs=1, temperature=5.0, seed=3),
            make_seq([1], logprobs=2, temperature=5.0, seed=4)]
    raw = logits.double().log_softmax(-1)
    seen_outside_top = False
    sampler = Sampler(seed=0)
    for _ in range(10):
        out = sampler(logits.clone(), seqs)
        assert out.logprobs[2] is None and out.sampled_logprobs[2] is None
        for r, seq in enumerate(seqs):
            k = seq.sampling_params.logprobs
            if k is None:
                continue
            d, tok = out.logprobs[r], out.token_ids[r]
            order = raw[r].argsort(descending=True).tolist()
            top = order[:k]
            assert set(d) == set(top) | {tok}
            for tid, lp in d.items():
                assert lp.rank == order.index(tid) + 1
                assert lp.logprob == pytest.approx(float(raw[r, tid]), abs=1e-5)
            assert out.sampled_logprobs[r] == pytest.approx(float(raw[r, tok]), abs=1e-5)
            seen_outside_top |= tok not in top
    assert seen_outside_top  # the "sampled token outside the top-k" case was exercised
    # Row 1 is greedy after a repetition penalty on token 4: the logprobs are still the raw ones.
    assert out.token_ids[1] == int(apply_penalties(logits[1:2].clone(), seqs[1:2]).argmax())


# --- SamplingParams validation ---------------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("n", 0, ["n", "0"]),
    ("presence_penalty", 2.5, ["presence_penalty", "2.5"]),
    ("presence_penalty", -3.0, ["presence_penalty", "-3.0"]),
    ("frequency_penalty", -2.1, ["frequency_penalty", "-2.1"]),
    ("repetition_penalty", 0.0, ["repetition_penalty", "0.0"]),
    ("repetition_penalty", -1.0, ["repetition_penalty", "-1.0"]),
    ("temperature", -0.5, ["temperature", "-0.5"]),
    ("top_p", 0.0, ["top_p", "0.0"]),
    ("top_p", 1.2, ["top_p", "1.2"]),
    ("top_k", -2, ["top_k", "-2"]),
    ("min_p", 1.5, ["min_p", "1.5"]),
    ("min_p", -0.1, ["min_p", "-0.1"]),
    ("max_tokens", 0, ["max_tokens", "0"]),
    ("min_tokens", -1, ["min_tokens", "-1"]),
    ("logprobs", -1, ["logprobs", "-1"]),
    ("stop", ["ok", ""], ["stop", "empty"]),
])
def test_sampling_params_validation_messages(field, value, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError) as info:
        SamplingParams(min_tokens=9, max_tokens=4)
    msg = str(info.value)
    assert "min_tokens" in msg and "max_tokens" in msg and "9" in msg and "4" in msg


def test_sampling_params_edge_values_are_accepted_and_normalized():
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=2.0,
                       frequency_penalty=-2.0, max_tokens=None, min_tokens=5, logprobs=0, stop="x",
                       stop_token_ids=None)
    assert p.greedy and p.top_k == 0 and p.stop == ["x"] and p.stop_token_ids == []
    assert p.has_penalties
    assert not SamplingParams().has_penalties and not SamplingParams().greedy
