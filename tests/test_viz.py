"""The accounting behind the lessons' pictures (minipaged/lessons/viz.py; replay helpers in trace.py)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minipaged.lessons import viz  # noqa: E402
from minipaged.engine.block_manager import BlockManager  # noqa: E402
from minipaged.engine.block_usage import block_usage  # noqa: E402
from minipaged.sampling import SamplingParams  # noqa: E402
from minipaged.engine.sequence import Sequence  # noqa: E402
from minipaged.engine.trace import ScheduledEntry, StepRecord  # noqa: E402
from minipaged.lessons.timeline import (RequestState as S, request_timeline,  # noqa: E402
                                        tokens_in_cache)

W, P, D, X, R, I, A, PAD = S.WAITING, S.PREFILL, S.DECODE, S.PREEMPTED, S.REQUEUED, S.STALLED, \
    S.ABSENT, S.PADDING


def rec(step, scheduled, preempted=(), finished=()):
    return StepRecord(step=step, start_time=0.0, duration=0.0,
                      scheduled=[ScheduledEntry(rid, 0, p, d, before)
                                 for rid, p, d, before in scheduled],
                      preempted=list(preempted), finished=list(finished), num_waiting=0,
                      num_running=0, num_blocks_used=0, num_blocks_free=0, num_blocks_cached=0,
                      num_batched_tokens=0)


# (request, prefill tokens, decode tokens, tokens cached before the step)
TRACE = [
    rec(0, [("a", 4, 0, 0), ("b", 2, 0, 0)]),  # a prefills 4, b a first chunk of 2
    rec(1, [("a", 0, 1, 4), ("b", 3, 0, 2)]),  # b's last chunk
    rec(2, [("b", 0, 1, 5)], preempted=["a"]),  # a loses its blocks
    rec(3, [("b", 0, 1, 6), ("c", 3, 0, 0)], finished=["b"]),
    rec(4, [("a", 6, 0, 0)]),  # a recomputes its 5 tokens + the one it had sampled; c stalls
    rec(5, [("a", 0, 1, 6), ("c", 0, 1, 3)], finished=["a", "c"]),
]


def test_request_timeline_states():
    states = request_timeline(TRACE, ["a", "b", "c"])
    assert states == [
        [P, D, X, R, P, D],
        [P, P, D, D, A, A],
        [W, W, W, P, I, D],
    ]


def test_tokens_in_cache_replays_the_trace():
    assert tokens_in_cache(TRACE, 0) == {"a": 4, "b": 2}
    assert tokens_in_cache(TRACE, 2) == {"b": 6}  # a was preempted: nothing cached
    assert tokens_in_cache(TRACE, 3) == {"c": 3}
    assert tokens_in_cache(TRACE, 4) == {"a": 6, "c": 3}
    assert tokens_in_cache(TRACE, 5) == {}


def test_static_batching_timeline_by_hand():
    st = viz.static_batching_timeline([2, 3, 1], [1, 3, 2], batch_size=2)
    # batch 0 runs 3 passes (its longest output); request 0 finished after the prefill
    assert st == [
        [P, PAD, PAD, A, A],
        [P, D, D, A, A],
        [W, W, W, P, D],
    ]
    u = viz.gantt_utilisation(st)
    assert u == {"steps": 5, "useful": 6, "padding": 2, "waiting": 3, "preempted": 0}


def _seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def test_block_table_view_counts_shared_blocks_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(range(10, 20))  # 10 tokens: 3 blocks, the last one half full
    bm.allocate(a, [], a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    b = _seq(range(10, 20))
    bm.fork(a, b)
    v = viz.view_from_block_manager(bm)
    assert v.shared_blocks == set(bm.block_tables[a.seq_id])
    assert v.num_tokens_stored == block_usage(bm).num_tokens_stored == 10
    assert [v.fill(f"seq {a.seq_id}", i) for i in range(3)] == [4, 4, 2]
    # copy-on-write: b writes its 11th token into a private copy of the shared last block
    copies = bm.append_slots(b, 1)
    assert len(copies) == 1
    v = viz.view_from_block_manager(bm)
    assert len(v.shared_blocks) == 2
    assert v.num_tokens_stored == block_usage(bm).num_tokens_stored
    plt.close(viz.plot_block_tables(bm))


@pytest.fixture(scope="module")
def engine_trace():
    from minipaged import LLM
    from minipaged.lessons.bench import make_workload
    wl = make_workload("cpu", 512, 8, seed=0, bos=1, max_model_len=128)
    wl.max_tokens = [m // 8 for m in wl.max_tokens]
    llm = LLM("stories260K", num_blocks=20, block_size=8, max_model_len=128,
              max_num_batched_tokens=48, record_block_tables=True)
    llm.generate(wl.prompts, [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0)
                              for m in wl.max_tokens], use_tqdm=False)
    return wl, llm.trace


def test_trace_views_agree_with_the_engine(engine_trace):
    wl, trace = engine_trace
    assert sum(len(r.preempted) for r in trace) > 0
    for pos, r in enumerate(trace):
        v = viz.view_from_trace(trace, pos)
        # block counts follow from the replayed token counts ...
        for rid, table in v.tables.items():
            assert len(table) == -(-v.num_tokens[rid] // 8)
        # ... and the picture's totals are the engine's own usage
        assert v.num_tokens_stored == r.usage.num_tokens_stored
    states = request_timeline(trace)
    # every request ran exactly as many decode steps as it sampled tokens after the first
    decodes = sorted(row.count(S.DECODE) for row in states)
    assert decodes == sorted(m - 1 for m in wl.max_tokens)


def test_plots_draw(engine_trace):
    from minipaged.lessons.memory_waste import compare_strategies, make_trace
    wl, trace = engine_trace
    figs = [viz.plot_block_tables(trace, 5), viz.plot_batch_gantt(trace),
            viz.plot_kv_utilization(trace),
            viz.plot_static_vs_continuous(trace, [len(p) for p in wl.prompts], wl.max_tokens,
                                          max(len(r.scheduled) for r in trace), more_seats=trace),
            viz.plot_throughput({"minipaged": 10.0, "hf-static": 5.0}, baseline="hf-static"),
            viz.plot_kv_cache_size({"x": 1280}, max_tokens=1024, budget_gib=0.001)]
    res = compare_strategies(make_trace("alpaca", 20, max_model_len=256), 512, block_sizes=(16,),
                             max_model_len=256)
    figs += [viz.plot_memory_waste(res), viz.plot_waste_over_time(res[-1])]
    rows = viz.block_size_tradeoff(make_trace("alpaca", 20, max_model_len=256), 512,
                                   block_sizes=(1, 16), max_model_len=256)
    assert rows[0]["internal_fragmentation"] == 0.0
    assert rows[0]["mean_table_entries"] > rows[1]["mean_table_entries"]
    figs.append(viz.plot_block_size_tradeoff(rows))
    for f in figs:
        assert f.axes
        plt.close(f)


def test_static_vs_continuous_refuses_different_seat_counts(engine_trace):
    """Static batches of B against an engine that ran more than B at once would credit the
    scheduler with the gain of more seats: the chart refuses, naming the knob."""
    wl, trace = engine_trace
    seats = max(len(r.scheduled) for r in trace)
    assert seats > 2
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        viz.plot_static_vs_continuous(trace, [len(p) for p in wl.prompts], wl.max_tokens, 2)


def test_sampling_stages_mask_what_the_sampler_masks():
    import torch
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    st = viz.sampling_stages(logits, temperature=1.0, top_k=2, top_p=0.7, min_p=0.2)
    assert int((st["top_k 2"] > 0).sum()) == 2
    assert int((st["top_p 0.7"] > 0).sum()) == 2  # p = .64, .24, ...: .64 < .7 so keep two
    assert int((st["min_p 0.2"] > 0).sum()) == 2  # .24/.64 >= .2, .09/.64 < .2
    for p in st.values():
        assert float(p.sum()) == pytest.approx(1.0)


def _total_variation(drawn, expected) -> float:
    return 0.5 * float((drawn - expected).abs().sum())


def test_engine_draws_what_sampling_stages_computes():
    """Lesson 04, section 5, as a test: 2000 one-token requests of one prompt through the engine
    (temperature 0.7, top_p 0.8) land only on the support `viz.sampling_stages` computes, within
    three times the total variation distance sampling noise gives on average (over engine seeds
    0-7 the ratio ranged 0.7-1.9), with a chi-square below 30 (8 degrees of freedom: p < 1e-3);
    the same check rejects the distribution without top_p and the one at T = 1."""
    import math

    import torch

    from minipaged import LLM
    from minipaged.lessons import figures
    llm = LLM("stories260K", max_model_len=256, max_logprobs=-1, seed=0)
    logits = figures.next_token_logits(llm, figures.SAMPLING_PROMPT)
    n = 2000
    outs = llm.generate([figures.SAMPLING_PROMPT] * n,
                        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=1), use_tqdm=False)
    drawn = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]),
                           minlength=len(logits)).float() / n
    expected = viz.sampling_stages(logits, temperature=0.7, top_p=0.8)["top_p 0.8"]
    support = torch.nonzero(expected > 0).flatten().tolist()
    assert 1 < len(support) < len(logits)
    assert float(drawn[expected == 0].sum()) == 0.0
    noise = 0.5 * sum(math.sqrt(2 / math.pi) * math.sqrt(float(expected[i]) * (1 - float(expected[i])) / n)
                      for i in support)
    assert _total_variation(drawn, expected) < 3 * noise
    counts, e = drawn[support] * n, expected[support] * n
    assert len(support) == 9 and float(((counts - e) ** 2 / e).sum()) < 30.0
    for wrong in (viz.sampling_stages(logits, temperature=0.7)["temperature 0.7"],
                  viz.sampling_stages(logits)["raw (T=1)"]):
        assert _total_variation(drawn, wrong) > 6 * noise


def test_token_distribution_outlines_are_the_raw_distribution():
    """The dotted outlines are the raw (T = 1) probabilities, never the first stage drawn."""
    import torch
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    st = viz.sampling_stages(logits, temperature=0.5)
    temps = {"temperature 0.5": st["temperature 0.5"]}
    fig = viz.plot_token_distributions(temps, list("abcde"), top=5, raw=st["raw (T=1)"])
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches
                     if p.get_facecolor()[3] == 0 and p.get_linestyle() == ":")
    assert heights == sorted(round(float(x), 6) for x in st["raw (T=1)"])
    plt.close(fig)
    fig = viz.plot_token_distributions(temps, list("abcde"), top=5)  # no raw: no outline
    assert not [p for p in fig.axes[0].patches if p.get_linestyle() == ":"]
    plt.close(fig)


def test_widgets_build_headless(engine_trace):
    _, trace = engine_trace
    w = viz.trace_explorer(trace, start=3)
    assert w is not None and w.children
    from minipaged.lessons.memory_waste import make_trace
    w = viz.block_size_explorer(make_trace("alpaca", 10, max_model_len=256), 512,
                                block_sizes=(8, 16), start=16, max_model_len=256)
    assert w is not None
    plt.close("all")


def test_decode_breakdown_figure_from_the_stored_h200_run():
    """Lesson 08's decode-step picture: the stored run adds up (kernel families + idle = wall
    time per step) and draws; the busy-time union the script computes ignores overlaps."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    step = root / "benchmarks" / "experiments" / "decode_step"
    data = json.loads((step / "decode_breakdown_h200.json").read_text())
    for r in data["rows"]:
        assert sum(r["ms"].values()) + r["idle_ms"] == pytest.approx(r["wall_ms"], rel=0.05)
        assert 0 < r["attention_tbs"] < data["read_ceiling"]["triton_read_tbs"] * 1.05
    fig = viz.plot_decode_breakdown(data)
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 6 * len(data["rows"])
    plt.close(fig)
    spec = importlib.util.spec_from_file_location("decode_breakdown", step / "decode_breakdown.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.busy_time([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert mod.family("paged_attention_kernel") == "attention"
    assert mod.family("nvjet_sm90_tst_128x64_64x4_1x2_h_bz_coopA_TNT") == "matmul"
