"""Serving benchmarks' parts: one streamed request, Poisson arrivals, vLLM's serving metrics.

Lesson 13 explains them; `minipaged bench serve` (cli/bench_serve.py) drives them from client
processes (load_client.py), and benchmarks/serve_load.py reuses the request and the prompts.

* `stream_completion` sends one `POST /v1/completions` with `stream: true` to any
  OpenAI-compatible server and times it on the client: TTFT (sent -> first chunk), the gaps
  between chunks (ITL), the end-to-end latency (E2EL), the output tokens (the usage chunk, else
  the chunks).
* `arrival_offsets` is vLLM's `bench serve` request process: gaps drawn from a gamma
  distribution of shape `burstiness` and mean 1/rate (burstiness 1: exponential gaps, a Poisson
  process; below 1 burstier, above 1 more regular), rescaled so the last arrival lands at
  n / rate (vLLM does the same, so a run's length does not depend on the seed's luck).
* `calculate_metrics` gives vLLM's names (`request_throughput`, `output_throughput`,
  `mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, `std_e2el_ms`, `request_goodput`,
  `max_concurrent_requests`, ...), so a result compares with `vllm bench serve`'s directly, and
  adds the vLLM paper's *normalized latency*: each request's end-to-end latency divided by its
  output tokens, in seconds per token (`mean_normalized_latency_s`, the y-axis of its Fig. 12).
  TPOT is per request, (E2EL - TTFT) / (output tokens - 1); ITL is every gap of every request.
  Goodput counts the requests that met every SLO given (`ttft`, `tpot`, `e2el` in ms; a
  one-token request's TPOT is 0), per second of the run.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's --percentile-metrics
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it (vLLM's `RequestFuncOutput`)."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: Optional[float] = None  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # end to end
    start_time: float = 0.0  # time.monotonic() when it was sent
    error: str = ""


async def stream_completion(client, model: str, prompt: list[int], max_tokens: int,
                            temperature: float = 0.0, extra: Optional[dict] = None,
                            exact: bool = True) -> RequestResult:
    """One streamed completion through `client` (an `httpx.AsyncClient` on the server's base
    URL). `ignore_eos` is set, so a server that knows it (vLLM, minipaged) produces exactly
    `max_tokens`; with `exact` fewer is an error. `extra` adds fields (e.g. `priority`)."""
    import httpx
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    res = RequestResult(ok=False, prompt_len=len(prompt), start_time=time.monotonic())
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = res.ttft is not None and (not exact or res.output_tokens == max_tokens)
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens, wanted {max_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


def salted(prompts: list[list[int]], salt: int, vocab_size: int) -> list[list[int]]:
    """Copies of `prompts` whose second token (the first of a one-token prompt) is shifted by
    `salt` inside [3, vocab) (below 3: <unk>, <s>, </s> of small vocabularies), so that prefix
    caching shares no block between runs with different salts. `salt` 0 returns the prompts."""
    if salt == 0:
        return prompts
    low = 3 if vocab_size > 3 else 0
    out = []
    for p in prompts:
        p = list(p)
        j = min(1, len(p) - 1)
        p[j] = low + (p[j] - low + salt) % (vocab_size - low)
        out.append(p)
    return out


def model_info(model: str, vocab_size: Optional[int] = None) -> tuple[int, Optional[int]]:
    """(vocab size, BOS id) of `model` from minipaged's own model resolution (a built-in name,
    a preset, a folder or a cached hub id), unless `vocab_size` is given (BOS then unknown)."""
    if vocab_size is not None:
        return vocab_size, None
    from minipaged.models.loader import resolve_model
    try:
        cfg = resolve_model(model).config
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot find {model!r} locally to read its vocabulary size ({e}); "
                         "pass --vocab-size") from None
    bos = cfg.get("bos_token_id")
    return cfg["vocab_size"], bos if isinstance(bos, int) else None


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent (see the docstring);
    all 0 for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1: Poisson), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t *= (n / request_rate) / t[-1]
    return [float(x) for x in t]


def parse_goodput(items: Optional[list[str]]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {key}: the SLO must be a positive number of "
                             f"milliseconds, got {value!r}")
        out[key] = ms
    return out


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _describe(name: str, xs: list[float], percentiles: list[float], scale: float,
              unit: str) -> dict:
    """mean / median / std / pN of `xs` times `scale`, named like vLLM's (`mean_ttft_ms`)."""
    a = np.asarray(xs if xs else [0.0], dtype=float) * scale
    out = {f"mean_{name}_{unit}": float(a.mean()), f"median_{name}_{unit}": float(np.median(a)),
           f"std_{name}_{unit}": float(a.std())}
    for p in percentiles:
        out[f"p{_percentile_name(p)}_{name}_{unit}"] = float(np.percentile(a, p))
    return out


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (a sweep over [sent, done) intervals, as vLLM's)."""
    events = sorted([(r.start_time, 1) for r in results]
                    + [(r.start_time + r.latency, -1) for r in results])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles: tuple[float, ...] = (50, 90, 99),
                      goodput: Optional[dict[str, float]] = None) -> dict:
    """vLLM's `bench serve` metrics of one run (see the docstring), plus normalized latency."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    all_tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
                 for r in ok]
    e2els = [r.latency for r in ok]
    itls = [x for r in ok for x in r.itl]
    norm = [r.latency / r.output_tokens for r in ok if r.output_tokens]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = None
    if goodput:
        slo = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        keys = list(goodput)
        good = sum(all(slo[k][i] * 1e3 <= goodput[k] for k in keys) for i in range(len(ok)))
    pct = list(percentiles)
    out = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / duration if duration else 0.0,
           "request_goodput": good / duration if good is not None and duration else None,
           "output_throughput": total_out / duration if duration else 0.0,
           "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
           "max_concurrent_requests": peak_concurrency(ok)}
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_describe(name, xs, pct, 1e3, "ms"))
    out.update(_describe("normalized_latency", norm, pct, 1.0, "s"))
    return out


def format_result(m: dict, percentiles: tuple[float, ...] = (50, 90, 99)) -> str:
    """The result block `vllm bench serve` prints, with normalized latency added."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label, value, fmt="{:<12.2f}"):
        lines.append("{:<44} ".format(label) + fmt.format(value))

    row("Successful requests:", m["completed"], "{:<12}")
    row("Failed requests:", m["failed"], "{:<12}")
    if m.get("max_concurrency") is not None:
        row("Maximum request concurrency:", m["max_concurrency"], "{:<12}")
    if m.get("request_rate") not in (None, math.inf):
        row("Request rate configured (RPS):", m["request_rate"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<12}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<12}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Peak concurrent requests:", m["max_concurrent_requests"], "{:<12}")
    heads = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, head in heads.items():
        lines.append("{:-^60}".format(head))
        row(f"Mean {key.upper()} (ms):", m[f"mean_{key}_ms"])
        for p in percentiles:
            row(f"P{_percentile_name(p)} {key.upper()} (ms):",
                m[f"p{_percentile_name(p)}_{key}_ms"])
    lines.append("{:-^60}".format("Normalized latency (vLLM paper: E2EL / output tokens)"))
    row("Mean normalized latency (s/token):", m["mean_normalized_latency_s"], "{:<12.4f}")
    row("Median normalized latency (s/token):", m["median_normalized_latency_s"], "{:<12.4f}")
    if "client_busy_fraction" in m:
        lines.append("{:-^60}".format("Load generator"))
        row("Client processes:", m["num_clients"], "{:<12}")
        row("Busiest client (CPU time / wall time):", m["client_busy_fraction"])
        row("P99 send lag behind the schedule (ms):", m["p99_send_lag_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
