"""What chunked prefill buys the requests already decoding (lesson 03, section 4), measured.

    measure_decode_itl(...)   decodes running while long prompts arrive, chunked prefill on (a
                              small max_num_batched_tokens) against off (the whole prompt in one
                              step); the inter-token latency of the running decodes from the
                              engine's trace, p50 / p99, best of `repeats`
    plot_decode_itl(result)   each run's gaps between a decode's tokens, step by step, and the
                              percentiles side by side

The loop is `LLMEngine.step()` driven by hand so prompts can arrive while others decode (as they
do in a server): `num_decodes` short requests start first; once all of them decode, a long prompt
arrives every `arrival_every` steps. Each step's time is its CPU time (`time.process_time`
around `step()`: another program on the cores does not count), and a decode's inter-token
latency is the time from the step that gave it a token to the next one that did, read from
`StepRecord.scheduled`. benchmarks/experiments/chunked_prefill/chunked_prefill_itl.py runs it at
larger sizes.
"""
from __future__ import annotations

import time
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np

from minipaged import LLM, SamplingParams
from minipaged.lessons.bench import Warmup

CONFIGS = {"chunked prefill on": True, "chunked prefill off": False}


def _percentile(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


def _one_run(llm: LLM, num_decodes: int, decode_tokens: int, num_long: int, long_len: int,
             arrival_every: int, seed: int) -> dict:
    eng = llm.engine
    rng = np.random.default_rng(seed)
    vocab = eng.model_config.vocab_size
    decode = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = len(eng.trace)
    for i in range(num_decodes):
        eng.add_request(f"d{i}", [1] + rng.integers(3, vocab, 8).tolist(), decode)
    cpu: list[float] = []  # CPU seconds of each step
    arrivals: dict[str, int] = {}
    steps = 0
    while eng.has_unfinished_requests():
        long_sent = len(arrivals)
        if steps >= 2 and long_sent < num_long and (steps - 2) % arrival_every == 0:
            name = f"long{long_sent}"
            eng.add_request(name, [1] + rng.integers(3, vocab, long_len - 1).tolist(), prefill)
            arrivals[name] = len(cpu)
        t0 = time.process_time()
        eng.step()
        cpu.append(time.process_time() - t0)
        steps += 1
    trace = eng.trace[first:]
    assert len(trace) == len(cpu)
    ends = np.cumsum(cpu)
    token_steps: dict[str, list[int]] = {}
    long_steps: dict[str, list[int]] = {}
    for i, rec in enumerate(trace):
        for e in rec.scheduled:
            if e.request_id.startswith("d") and e.num_decode_tokens:
                token_steps.setdefault(e.request_id, []).append(i)
            elif e.request_id.startswith("long") and e.num_prefill_tokens:
                long_steps.setdefault(e.request_id, []).append(i)
    itl, itl_steps = [], []  # one entry per decode token after the first
    window_end = max(s[-1] for s in long_steps.values()) if long_steps else len(cpu) - 1
    for steps_of in token_steps.values():
        for a, b in zip(steps_of, steps_of[1:]):
            if b <= window_end + 1:  # while long prompts arrive (and one step after)
                itl.append(ends[b] - ends[a])
                itl_steps.append(b)
    ttft = [ends[s[-1]] - (ends[arrivals[n] - 1] if arrivals[n] else 0.0)
            for n, s in long_steps.items()]
    return {"steps": len(cpu), "step_cpu_ms": [round(1e3 * c, 4) for c in cpu],
            "itl_ms": [round(1e3 * float(x), 4) for x in itl], "itl_step": itl_steps,
            "itl_p50_ms": 1e3 * _percentile(itl, 50), "itl_p99_ms": 1e3 * _percentile(itl, 99),
            "itl_max_ms": 1e3 * float(max(itl)), "long_prompt_ttft_ms": 1e3 * float(np.mean(ttft)),
            "max_tokens_in_a_step": max(r.num_batched_tokens for r in trace)}


def measure_decode_itl(model: str = "stories260K", num_decodes: int = 8,
                       decode_tokens: int = 96, num_long: int = 4, long_len: int = 448,
                       arrival_every: int = 20, max_num_batched_tokens: int = 64,
                       max_model_len: int = 512, repeats: int = 3, device: str = "cpu",
                       seed: int = 0) -> dict:
    """Both ways on one workload, interleaved `repeats` times; each way keeps the run with the
    lowest p99 (best of N). Chunked prefill on uses `max_num_batched_tokens`; off must fit a
    whole prompt in one step, so its budget is `max_model_len` (the smallest it accepts)."""
    engines = {name: LLM(model, device=device, seed=seed, max_model_len=max_model_len,
                         enable_chunked_prefill=on, enable_prefix_caching=False,
                         max_num_batched_tokens=max_num_batched_tokens if on else max_model_len)
               for name, on in CONFIGS.items()}
    args = dict(num_decodes=num_decodes, decode_tokens=decode_tokens, num_long=num_long,
                long_len=long_len, arrival_every=arrival_every, seed=seed)
    warmups = {}
    for name, llm in engines.items():  # warm-up: first steps of a fresh engine are slower
        # Every kind of step the timed runs make (short prefills, decodes, a long prompt's
        # chunks or whole prefill beside them), a few tokens each, untimed.
        warm = dict(args, decode_tokens=8, num_long=1)
        t0 = time.perf_counter()
        steps = _one_run(llm, **warm)["steps"]
        warmups[name] = Warmup(
            num_decodes + 1, num_decodes * 9 + long_len, num_decodes * 8 + 4,
            time.perf_counter() - t0, steps, what=f"{num_decodes} decodes of 8 tokens and one "
            f"long prompt arriving, as the timed runs (untimed)").to_dict()
    best: dict[str, Optional[dict]] = {name: None for name in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            r = _one_run(llm, **args)
            if best[name] is None or r["itl_p99_ms"] < best[name]["itl_p99_ms"]:
                best[name] = r
    for name, on in CONFIGS.items():
        best[name]["max_num_batched_tokens"] = max_num_batched_tokens if on else max_model_len
        best[name]["warmup"] = warmups[name]
    on, off = best["chunked prefill on"], best["chunked prefill off"]
    return {"model": model, "device": device, "workload": dict(args, max_model_len=max_model_len),
            "repeats": repeats, "timing": "CPU time per step (time.process_time), best of "
            "repeats by ITL p99", "runs": best,
            "p99_off_over_on": off["itl_p99_ms"] / on["itl_p99_ms"],
            "p50_off_over_on": off["itl_p50_ms"] / on["itl_p50_ms"],
            "ttft_on_over_off": on["long_prompt_ttft_ms"] / off["long_prompt_ttft_ms"]}


def plot_decode_itl(result: dict):
    """Left: every gap between two tokens of a running decode, at the step it ended, for both
    runs. Right: p50 and p99 of those gaps, and the long prompts' mean time to first token."""
    runs = result["runs"]
    colors = {"chunked prefill on": "#2ca02c", "chunked prefill off": "#d62728"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    for name, r in runs.items():
        a.scatter(r["itl_step"], r["itl_ms"], s=7, color=colors[name], alpha=0.6,
                  label=f"{name} (max_num_batched_tokens={r['max_num_batched_tokens']})")
    a.set(xlabel="engine step", ylabel="gap between a decode's tokens (ms CPU)",
          title="inter-token latency of the running decodes while long prompts arrive")
    a.set_ylim(0, None)
    a.legend(fontsize=8)
    names = list(runs)
    x = np.arange(3)
    for k, name in enumerate(names):
        r = runs[name]
        vals = [r["itl_p50_ms"], r["itl_p99_ms"], r["long_prompt_ttft_ms"]]
        bars = b.bar(x + (k - 0.5) * 0.38, vals, 0.38, color=colors[name], label=name)
        for bar, v in zip(bars, vals):
            b.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom",
                   fontsize=7)
    b.set_xticks(x)
    b.set_xticklabels(["decode ITL\np50", "decode ITL\np99", "long prompt\nTTFT"], fontsize=8)
    b.set_ylabel("ms (CPU time)")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig
