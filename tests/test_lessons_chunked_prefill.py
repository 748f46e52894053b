"""Lesson 03's chunked-prefill measurement (minipaged/lessons/chunked_prefill.py): the gaps it
reports are the running decodes' own, read from the engine's trace, and each way runs the
engine it says it runs."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from minipaged.lessons.chunked_prefill import measure_decode_itl, plot_decode_itl  # noqa: E402


def test_decode_itl_both_ways():
    res = measure_decode_itl(num_decodes=3, decode_tokens=40, num_long=2, long_len=200,
                             arrival_every=10, max_num_batched_tokens=32, max_model_len=256,
                             repeats=1)
    on, off = res["runs"]["chunked prefill on"], res["runs"]["chunked prefill off"]
    assert on["max_num_batched_tokens"] == 32 and off["max_num_batched_tokens"] == 256
    assert on["max_tokens_in_a_step"] <= 32  # the prompt went in chunks
    assert off["max_tokens_in_a_step"] == 200 + 3  # a whole prompt beside the 3 decodes
    for r in (on, off):
        # one gap per decode token after the first, up to the step after the last prefill
        assert 0 < len(r["itl_ms"]) == len(r["itl_step"]) <= 3 * 39
        assert r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
        assert r["warmup"]["requests"] == 3 + 1 and r["warmup"]["seconds"] > 0
        assert abs(r["itl_max_ms"] - max(r["itl_ms"])) < 1e-3
        # a gap is the CPU time of the steps it spans: never less than its last step's
        steps = r["step_cpu_ms"]
        assert all(gap >= steps[s] - 1e-3 for gap, s in zip(r["itl_ms"], r["itl_step"]))
    # off: the largest gap of a running decode ends in a step that took a whole prompt
    worst = off["itl_step"][off["itl_ms"].index(max(off["itl_ms"]))]
    assert off["step_cpu_ms"][worst] == max(off["step_cpu_ms"][s] for s in off["itl_step"])
    plt.close(plot_decode_itl(res))
