"""Load test for `minipaged serve` (lesson 07): requests/s, tokens/s, TTFT and ITL percentiles at
several concurrency levels, through the OpenAI completions endpoint with streaming.

    python benchmarks/serve_load.py                        # stories260K on this machine's CPU
    python benchmarks/serve_load.py --model dummy:qwen3-0.6b --workload nanovllm \\
        --concurrency 1,16,64,256                          # the GPU run (dummy weights)
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --model NAME --vocab-size N
                                                           # a server that is already running

Without --base-url the script starts `minipaged serve MODEL` itself on a free port (extra server
flags go in --server-args "...") and stops it at the end. Prompts are token ids (the completions
endpoint's `prompt` as a list of ints), so models without a tokenizer (dummy presets) work; every
request sets `ignore_eos`, so it produces exactly its `max_tokens`. The workloads are minipaged
bench's (`minipaged/lessons/bench.py`): `cpu` = 64 requests, prompt lengths U[4, 64], outputs U[16, 256];
`nanovllm` = 256 requests, prompts U[100, 1024], outputs U[100, 1024].

For each concurrency level C the same requests are sent by C workers, each sending its next
request when the previous one finished (a closed loop, like vLLM's `--max-concurrency`):

* requests/s and output tokens/s  over the level's wall time
* TTFT  time to first token: request sent -> first streamed token
* ITL   inter-token latency: gaps between consecutive streamed tokens of one request
* preemptions and the peak of running / waiting requests, from the server's /metrics
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minipaged.lessons.bench import WORKLOADS, make_workload  # noqa: E402
from minipaged.server.metrics import parse_metrics  # noqa: E402


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    errors: int
    elapsed_sec: float
    requests_per_sec: float
    output_tokens: int
    output_tokens_per_sec: float
    ttft_ms: dict
    itl_ms: dict
    tpot_ms_mean: float
    preemptions: int
    peak_running: int
    peak_waiting: int


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def pick(q):
        return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 2)
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, server_args: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minipaged.cli", "serve", model, "--port", str(port),
           "--uvicorn-log-level", "warning", *server_args]
    print("starting:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy within {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully on Ctrl-C
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int],
                      max_tokens: int, temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False, prompt_len=len(prompt))
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
        res.ok = res.output_tokens == max_tokens
        if not res.ok:
            res.error = f"got {res.output_tokens} tokens, wanted {max_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def watch_metrics(client: httpx.AsyncClient, peaks: dict, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            m = parse_metrics((await client.get("/metrics")).text)
            for key in ("running", "waiting"):
                v = m.get(f"minipaged:num_requests_{key}", m.get(f"vllm:num_requests_{key}", 0))
                peaks[key] = max(peaks[key], int(v))
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


def preemptions(metrics: dict) -> float:
    return metrics.get("minipaged:num_preemptions_total", metrics.get("vllm:num_preemptions_total", 0))


async def run_level(url: str, headers: dict, model: str, prompts, max_tokens, concurrency: int,
                    temperature: float) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:
        before = parse_metrics((await client.get("/metrics")).text)
        todo = list(range(len(prompts)))
        results: list[RequestResult] = []

        async def worker():
            while todo:
                i = todo.pop(0)
                results.append(await one_request(client, model, prompts[i], max_tokens[i],
                                                  temperature))

        peaks, stop = {"running": 0, "waiting": 0}, asyncio.Event()
        watcher = asyncio.create_task(watch_metrics(client, peaks, stop))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        stop.set()
        await watcher
        after = parse_metrics((await client.get("/metrics")).text)
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"  error: {r.error}", file=sys.stderr)
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return LevelResult(
        concurrency=concurrency, num_requests=len(results), errors=len(results) - len(ok),
        elapsed_sec=round(elapsed, 3), requests_per_sec=round(len(ok) / elapsed, 3),
        output_tokens=tokens, output_tokens_per_sec=round(tokens / elapsed, 1),
        ttft_ms=percentiles([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=percentiles([x for r in ok for x in r.itl]),
        tpot_ms_mean=round(sum(tpot) / len(tpot) * 1e3, 2) if tpot else 0.0,
        preemptions=int(preemptions(after) - preemptions(before)),
        peak_running=peaks["running"], peak_waiting=peaks["waiting"])


def table(levels: list[LevelResult]) -> str:
    def trio(d):
        return " / ".join("-" if d[k] is None else f"{d[k]:g}" for k in ("p50", "p90", "p99"))
    rows = ["| concurrency | requests | errors | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
            "| ITL p50 / p90 / p99 (ms) | peak running / waiting | preemptions |",
            "|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for r in levels:
        rows.append(f"| {r.concurrency} | {r.num_requests} | {r.errors} | {r.requests_per_sec:.2f} "
                    f"| {r.output_tokens_per_sec:,.0f} | {trio(r.ttft_ms)} | {trio(r.itl_ms)} "
                    f"| {r.peak_running} / {r.peak_waiting} | {r.preemptions} |")
    return "\n".join(rows)


def model_info(model: str, vocab_size: Optional[int]) -> tuple[int, Optional[int]]:
    """(vocab size, BOS id) from minipaged's own model resolution, unless --vocab-size is given."""
    if vocab_size is not None:
        return vocab_size, None
    from minipaged.models.loader import resolve_model
    try:
        cfg = resolve_model(model).config
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"cannot find {model!r} locally to read its vocab size ({e}); "
                         "pass --vocab-size") from None
    bos = cfg.get("bos_token_id")
    return cfg["vocab_size"], bos if isinstance(bos, int) else None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="stories260K",
                    help="model to serve (and the `model` field of each request)")
    ap.add_argument("--base-url", default=None, help="target a running server instead")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--server-args", default="",
                    help='extra `minipaged serve` flags, e.g. "--max-num-seqs 64 --num-blocks 2048"')
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--workload", default="cpu", choices=WORKLOADS)
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    ap.add_argument("--input-len", type=int, default=128, help="for --workload fixed")
    ap.add_argument("--output-len", type=int, default=128, help="for --workload fixed")
    ap.add_argument("--concurrency", default="1,8,32,64",
                    help="comma-separated in-flight request counts")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: from the model config")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=None,
                    help="requests (of at most 16 tokens) sent at once before measuring, so "
                         "first-use costs (Triton JIT, CUDA graphs, allocator) stay out of the "
                         "numbers; default: the largest concurrency level")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    vocab, bos = model_info(a.model, a.vocab_size)
    proc = None
    if a.base_url:
        url = a.base_url.rstrip("/").removesuffix("/v1")
    else:
        proc, url = start_server(a.model, shlex.split(a.server_args), a.server_timeout)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
        name = a.model if any(m["id"] == a.model for m in models) else models[0]["id"]
        max_model_len = models[0].get("max_model_len")
        wl = make_workload(a.workload, vocab, num_requests=a.num_requests, seed=a.seed,
                           input_len=a.input_len, output_len=a.output_len, bos=bos,
                           max_model_len=max_model_len)
        levels_c = [int(c) for c in a.concurrency.split(",")]
        print(f"model {name!r} ({'dummy weights, ' if a.model.startswith('dummy:') else ''}"
              f"vocab {vocab}, max_model_len {max_model_len}) at {url}; workload {a.workload}: "
              f"{len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt tokens, "
              f"{sum(wl.max_tokens)} output tokens per level; {platform.machine()}, "
              f"{os.cpu_count()} CPUs", flush=True)
        warmup = min(len(wl.prompts), max(levels_c) if a.warmup is None else a.warmup)
        if warmup:
            asyncio.run(run_level(url, headers, name, wl.prompts[:warmup],
                                  [min(m, 16) for m in wl.max_tokens[:warmup]], warmup,
                                  a.temperature))
        levels = []
        for c in levels_c:
            r = asyncio.run(run_level(url, headers, name, wl.prompts, wl.max_tokens, c,
                                      a.temperature))
            levels.append(r)
            print(f"  concurrency {c:4d}: {r.requests_per_sec:7.2f} req/s, "
                  f"{r.output_tokens_per_sec:9,.0f} tok/s, TTFT p50 {r.ttft_ms['p50']} ms, "
                  f"ITL p50 {r.itl_ms['p50']} ms, errors {r.errors}", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    print()
    print(table(levels))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "model": a.model, "workload": a.workload, "server_args": a.server_args,
            "machine": platform.platform(), "levels": [asdict(r) for r in levels]}, indent=1))
        print(f"\nwrote {a.out}")
    return 0 if all(r.errors == 0 for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
