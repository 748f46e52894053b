"""Lesson 10's helpers (minipaged/lessons/spec_decode.py, spec_decode_measure.py) against the
engine they describe: the greedy replay predicts the engine's proposed / accepted counts, the
recorded step is the engine's, the distribution check tells right from wrong."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lessons import spec_decode as sd  # noqa: E402
from minipaged.lessons import spec_decode_measure as sdm  # noqa: E402
from minipaged.sampling.rejection_sampler import rejection_sample  # noqa: E402
from minipaged.spec_decode import NgramProposer  # noqa: E402
from tests.helpers import exercise_cell

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "10_speculative_decoding.ipynb"
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def spec_llm(k: int, **kw) -> LLM:
    return LLM("stories260K", device="cpu", speculative_config=sdm.ngram_config(k), **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_replay_predicts_the_engines_counts(k):
    prompts = sdm.story_prompts(3)
    llm = spec_llm(k)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    plain = LLM("stories260K", device="cpu").generate(prompts, GREEDY, use_tqdm=False)
    replays = []
    for o, ref in zip(outs, plain):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids  # lossless under greedy
        r = sd.replay_greedy(NgramProposer(k, 1, 4), o.prompt_token_ids, o.outputs[0].token_ids)
        assert (sum(r.proposed), sum(r.accepted)) == (o.metrics["spec_num_draft_tokens"],
                                                      o.metrics["spec_num_accepted_tokens"])
        assert r.num_tokens == len(o.outputs[0].token_ids)
        replays.append(r)
    rows = sd.acceptance_rows(replays)
    assert rows["accepted"] > 0 and rows["tokens_per_step"] > 1.0
    assert sd.engine_rows(llm, outs) == rows  # forwards, tokens, counts, per position
    along = sd.tokens_per_forward_along_text(replays, bucket=16)
    assert len(along) == 4 and all(t >= 1.0 for t in along)


def test_acceptance_per_position_matches_the_trace():
    k = 4
    llm = spec_llm(k)
    outs = llm.generate(sdm.story_prompts(2), GREEDY, use_tqdm=False)
    replays = [sd.replay_greedy(NgramProposer(k, 1, 4), o.prompt_token_ids,
                                o.outputs[0].token_ids) for o in outs]
    trace = llm.engine.trace
    for i in range(k):
        tried = sum(r.accepted_at(i)[0] for r in replays)
        kept = sum(r.accepted_at(i)[1] for r in replays)
        assert tried == sum(t.num_draft_tokens_per_pos[i] for t in trace
                            if t.num_draft_tokens_per_pos)
        assert kept == sum(t.num_accepted_tokens_per_pos[i] for t in trace
                           if t.num_accepted_tokens_per_pos)


def test_recorded_steps_are_the_engines():
    k, bs = 4, 4
    llm = spec_llm(k, block_size=bs)
    steps = sd.record_spec_steps(llm, "Tom had a red ball.", GREEDY)
    assert steps
    proposer = NgramProposer(k, 1, 4)
    for s in steps:
        assert s.proposal == proposer.propose(s.token_ids)[:len(s.proposal)]
        assert s.num_computed == len(s.token_ids) - 1  # a decode: only the newest token pending
        # Slots for the pending token and every guess were reserved for the forward.
        assert len(s.block_table) * bs >= s.num_computed + 1 + len(s.proposal)
        assert s.block_table[:len(s.block_table_after)] == s.block_table_after or s.finished
        if not s.finished:  # the rollback keeps just the blocks the kept tokens need
            kept = s.num_computed + 1 + s.num_accepted
            assert len(s.block_table_after) == -(-kept // bs)
    assert any(s.freed_blocks and not s.finished for s in steps)  # the lesson draws such a step


def test_step_picture_marks_each_slot():
    fig = sd.plot_spec_step([3, 7, 2, 9], 4, 9, ["a", "b", "c", "d"], 1, "p", "z",
                            freed_blocks=[9], context=[str(i) for i in range(9)])
    verify_row = fig.axes[1]
    colours = [p.get_facecolor()[:3] for p in verify_row.patches if isinstance(p, Rectangle)]
    rejected = matplotlib.colors.to_rgb(sd.REJECTED_COLOR)
    assert sum(c == rejected for c in colours) == 3  # k - kept
    plt.close(fig)
    with pytest.raises(ValueError, match="the step needs"):
        sd.plot_spec_step([3], 4, 2, ["a", "b"], 0, "p", "z")


def test_distribution_check_tells_right_from_wrong():
    p, q = sd.toy_pair()
    assert sd.distribution_check(p, q, "rejection").p_value > 1e-3
    assert sd.distribution_check(p, None, "rejection").p_value > 1e-3
    assert sd.distribution_check(p, q, "accept_all").p_value < 1e-3
    assert sd.distribution_check(p, q, "resample_p").p_value < 1e-3
    with pytest.raises(ValueError, match="rule must be one of"):
        sd.distribution_check(p, q, "nope")


def test_compare_reports_both_sides():
    runs = sdm.compare("stories260K", 2, ks=(0, 2), max_tokens=24, repeats=1, device="cpu")
    off, on = runs
    assert (off.setting, on.setting) == ("off", "ngram k=2")
    assert off.output_tokens == on.output_tokens == 48
    assert off.proposed == 0 and on.proposed > 0
    for r in runs:  # each engine warmed up on the timed requests' shapes, untimed
        assert r.warmup["requests"] == 2 and r.warmup["output_tokens"] == 48
        assert r.step_ms["steps"] == r.steps
    assert on.steps < off.steps or on.accepted == 0
    assert "ngram k=2" in sdm.format_runs(runs)
    assert len(set(sdm.story_prompts(64))) == 64
    plt.close(sdm.plot_runs(runs))


def test_the_graded_exercise_runs_in_ci_and_checks_when_filled():
    src = exercise_cell(NOTEBOOK)
    assert "if ANSWER is not None:" in src
    env = {"torch": torch, "rejection_sample": rejection_sample}
    exec(src, dict(env))  # unanswered: runs, checks nothing
    exec(src.replace("ANSWER = None", "ANSWER = (0.6, [0.75, 0.0, 0.25, 0.0])", 1), dict(env))
    for wrong in ("(0.6, [0.5, 0.3, 0.2, 0.0])", "(0.5, [0.75, 0.0, 0.25, 0.0])"):
        with pytest.raises(AssertionError, match="not yet"):
            exec(src.replace("ANSWER = None", f"ANSWER = {wrong}", 1), dict(env))


def test_a_timed_round_is_the_median_of_passes_lasting_min_sec(monkeypatch):
    """`compare(min_sec=...)` (the --h200 runs: a pass of stories260K takes ~0.1 s there) times
    passes back to back until min_sec has been timed and keeps the median one; min_sec 0 keeps
    the single pass."""
    from minipaged.lessons import spec_decode_measure as sdm
    times = iter([0.03, 0.01, 0.02, 0.5])
    monkeypatch.setattr(sdm, "_run_once", lambda llm, prompts, params, setting: sdm.SpecRun(
        setting, 1, 10, next(times), 0.0, 0.0, 10, 0, 0))
    run = sdm.median_pass(None, ["p"], None, "off", min_sec=0.05)
    assert (run.passes, run.elapsed_sec) == (3, 0.02)
    run = sdm.median_pass(None, ["p"], None, "off", min_sec=0.0)
    assert (run.passes, run.elapsed_sec) == (1, 0.5)
