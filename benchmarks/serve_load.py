"""Load test for `minipaged serve` (lesson 07): requests/s, tokens/s, TTFT and ITL percentiles at
several concurrency levels, through the OpenAI completions endpoint with streaming, beside the
offline engine on the same workload in the same run.

    python benchmarks/serve_load.py                        # stories260K on this machine's CPU
    python benchmarks/serve_load.py --model dummy:qwen3-0.6b --workload nanovllm \\
        --concurrency 1,256,64 --repeats 3 --offline --server-args "--block-size 128"
                                                           # the GPU run (dummy weights)
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --model NAME --vocab-size N
                                                           # a server that is already running
    python benchmarks/serve_load.py --workload cpu --num-requests 16 --concurrency 1,8 \\
        --clients 2 --offline --torch-threads 1 --server-args "--device cpu"   # a quick check

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
        (`itl_mean_ms` in the JSON: each request's mean gap, the offline engine's definition)
* preemptions and the peak of running / waiting requests, from the server's /metrics

The load generator must not be what it measures. Reading a server-sent-events stream through
httpx costs the client about 110-130 us of CPU per streamed token (measured on the H200 box), so
one asyncio process saturates near 8,000 tok/s, whatever its number of streams: one process
driving 256 streams was seen at 84-87% of a core. A client that falls behind also reads its
streams in bursts, so the gaps it sees are not the server's (that process measured an ITL p50 of
0.03 ms). So the C workers run in K client *processes* (`--clients`; default min(C, half the
CPUs, 16): 8 on a 16-core H200 box, where 22,000 tok/s is under 40% of a core each), each with
its own event loop and httpx client. Request i goes to client i % K, and each client's
workers take its requests in order (so every request is sent exactly once and the split does not
depend on timing); client k runs C // K workers, one more if k < C % K. The clients connect first,
then start together on one Event; a level lasts from that start to the last client's end (both
on the clock every process shares, CLOCK_MONOTONIC on Linux). Each client reports its own CPU time
over that span: `client_cpu_percent_max` is the busiest client's CPU / wall time, and a warning
says when one passes 70% of a core (raise --clients). When the script starts the server itself it
also reads the CPU time of the server's processes (the API server, then its children such as an
engine core; /proc, Linux) over the level: `server_cpu_percent`, one number per process, where
~100% says that process's Python threads (which share one GIL) are the limit.

`--offline` runs the same workload through the offline engine first, in a subprocess (which gives
the GPU back when it exits, before the server starts) with the engine flags that --server-args
gives the server (parsed by minipaged's own flag declaration, `minipaged.cli.args`; server-only
flags are listed and ignored): all at once exactly as `minipaged bench` does (`lessons.bench.run_minipaged`: output tok/s, TTFT and per-request ITL
from `RequestOutput.metrics`), and once one request at a time on the first --single-requests
prompts (TTFT and ITL of a lone request). The table then gives serve / offline ratios: tok/s and
ITL p99 for every level, TTFT p50 and ITL p50 against the lone request at concurrency 1.
Concurrency-1 levels send the same first --single-requests prompts.

One level is one sample, and the served numbers vary: on an H200, five consecutive C=256 levels
against one server gave 12,100 to 17,000 tok/s. `--repeats N` runs every level (and the offline
batch) N times in a row; the table shows each run, the offline row its median run, and the bars
(printed last: tok/s and ITL p99 at the largest concurrency, TTFT and ITL p50 at concurrency 1)
use the median ratio.

The offline ITL is per request ((finished - first token) / (tokens - 1)); the served ITL is per
gap, whose p99 also catches single slow steps that a per-request mean smooths out. The ratio is
given both ways: per-gap p99 / offline p99 (the bar as stated), and per-request p99 / offline p99
(the same statistic on both sides).

Before the first level, the server is warmed up with each level's shapes, untimed: for every
concurrency C (largest first), the workload's first C requests (`--warmup N`: N) at concurrency
C with their full max_tokens, so that the first level timed, and a concurrency-1 level after a
large one, meets no kernel variant (on a GPU: a Triton compile per variant, chosen by query and
context length in the steps that run eagerly) or buffer for the first time. What each warm-up
sent (requests, tokens, seconds) is printed and written to the JSON ("warmup"). The offline
engine runs the workload's shapes once, untimed, before its first batch (`run_minipaged`;
"warmup" in the offline batch's JSON).

Prefix caching would let a level reuse the KV blocks of the same prompts sent by an earlier level
(or by the warm-up), which the offline run never can. So every run (each offline batch, the offline
lone requests, the warm-up, each level and repeat) changes one token near the start of each prompt by its own salt
(the second token: BOS stays): lengths and costs are those of the workload, and no run finds
another's blocks. Server salts start at a random base per invocation, so a long-running server
(--base-url) does not hit the blocks of a previous invocation either.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The request, the prompts' salts and the client plumbing are `minipaged bench serve`'s
# (minipaged/benchmark/serving.py, load_client.py: light modules, no torch); the rest of
# minipaged (and torch) is imported inside the functions that need it: the client processes
# import this file too.
from minipaged.benchmark.load_client import (MAX_DEFAULT_CLIENTS, ClientReport,  # noqa: E402
                                             checked, default_clients, stop_clients)
from minipaged.benchmark.load_client import collect as _collect  # noqa: E402
from minipaged.benchmark.serving import RequestResult, salted, stream_completion  # noqa: E402
from minipaged.benchmark import serving as _serving  # noqa: E402

CLIENT_CPU_WARN = 70.0  # % of one core
# The bars the served path is judged by, against the offline engine in the same run.
BAR_THROUGHPUT = 0.85  # serve tok/s >= 85% of offline, at the largest concurrency level
BAR_ITL_P99 = 2.0  # serve ITL p99 <= 2x offline ITL p99, same level
BAR_SINGLE = 1.10  # concurrency 1: TTFT p50 and ITL p50 within 10% of a lone offline request


@dataclass
class LevelResult:
    concurrency: int
    clients: int
    num_requests: int
    errors: int
    elapsed_sec: float
    requests_per_sec: float
    output_tokens: int
    output_tokens_per_sec: float
    ttft_ms: dict
    itl_ms: dict
    itl_mean_ms: dict  # percentiles of each request's mean gap (the offline engine's ITL)
    tpot_ms_mean: float
    preemptions: int
    peak_running: int
    peak_waiting: int
    client_cpu_percent: list[float]  # per client process: CPU time / wall time of the level
    client_cpu_percent_max: float
    # The server's processes (the API server first, then its children: an engine core), when
    # this script started it and /proc exists.
    server_cpu_percent: list[float] = field(default_factory=list)
    vs_offline: dict = field(default_factory=dict)  # filled when --offline ran
    repeat: int = 0  # which of --repeats runs of this concurrency


# --- the workload ----------------------------------------------------------------------------
def digest(prompts: list[list[int]], max_tokens: list[int]) -> str:
    """A fingerprint of a workload, to check the server and the offline run got the same one."""
    return hashlib.sha1(json.dumps([prompts, max_tokens]).encode()).hexdigest()[:12]


def build_workload(a: argparse.Namespace, vocab: int, bos: Optional[int],
                   max_model_len: Optional[int]):
    from minipaged.lessons.bench import make_workload
    return make_workload(a.workload, vocab, num_requests=a.num_requests, seed=a.seed,
                         input_len=a.input_len, output_len=a.output_len, bos=bos,
                         max_model_len=max_model_len)


# --- the server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env(torch_threads: Optional[int]) -> dict:
    """The environment of the server subprocess: OMP_NUM_THREADS=N when --torch-threads N."""
    env = dict(os.environ)
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return env


def start_server(model: str, server_args: list[str], timeout: float,
                 torch_threads: Optional[int] = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minipaged.cli", "serve", model, "--port", str(port),
           "--uvicorn-log-level", "warning", *server_args]
    print("starting:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1],
                            env=thread_env(torch_threads))
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


# --- one client process ----------------------------------------------------------------------
async def drive(client: httpx.AsyncClient, model: str, jobs: list[tuple[int, list[int], int]],
                num_workers: int, temperature: float) -> list[tuple[int, RequestResult]]:
    """The closed loop of one client: `num_workers` workers take `jobs` (index, prompt,
    max_tokens) in order, each sending its next request when its previous one has finished."""
    todo = deque(jobs)
    results: list[tuple[int, RequestResult]] = []

    async def worker():
        while todo:
            i, prompt, max_tokens = todo.popleft()
            results.append((i, await stream_completion(client, model, prompt, max_tokens,
                                                       temperature)))

    await asyncio.gather(*(worker() for _ in range(num_workers)))
    return results


async def _client_main(index: int, url: str, headers: dict, model: str, jobs, num_workers: int,
                       temperature: float, ready, start) -> ClientReport:
    limits = httpx.Limits(max_connections=num_workers + 2, max_keepalive_connections=num_workers + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:
        ready.put(index)
        start.wait()  # every client of the level starts on the same Event
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await drive(client, model, jobs, num_workers, temperature)
        return ClientReport(index, results, start=t0, end=time.perf_counter(),
                            cpu_sec=time.process_time() - cpu0)


def client_process(index: int, url: str, headers: dict, model: str, jobs, num_workers: int,
                   temperature: float, ready, start, reports) -> None:
    """Entry point of a client process (multiprocessing, spawn): its own event loop and client."""
    try:
        report = asyncio.run(_client_main(index, url, headers, model, jobs, num_workers,
                                          temperature, ready, start))
    except BaseException as e:  # noqa: BLE001 - the parent must hear about it, not hang
        report = ClientReport(index, [], error=f"{type(e).__name__}: {e}")
        ready.put(index)  # in case it failed before saying it was ready
    reports.put(report)


def split_load(num_requests: int, concurrency: int, clients: int) -> list[tuple[list[int], int]]:
    """(request indices, workers) for each client: request i to client i % K, C // K workers
    each and one more for the first C % K. K is capped at C (a client without a worker would
    have requests and nobody to send them)."""
    k = max(1, min(clients, concurrency))
    return [(list(range(j, num_requests, k)), concurrency // k + (j < concurrency % k))
            for j in range(k)]


# --- one level -------------------------------------------------------------------------------
async def watch_metrics(client: httpx.AsyncClient, peaks: dict, stop: asyncio.Event) -> None:
    from minipaged.server.metrics import parse_metrics
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


def process_tree_cpu(pid: Optional[int]) -> dict[int, float]:
    """User + system CPU seconds of process `pid` and of each of its descendants (every thread
    counted), from /proc: {pid: seconds}, `pid` first; {} without /proc or without a pid."""
    if pid is None or not Path("/proc/self/stat").exists():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:  # after the ")" of the command name: state ppid ... utime(12th) stime(13th)
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)], cpu[int(d.name)] = int(f[1]), (int(f[11]) + int(f[12])) / tick
        except (OSError, ValueError, IndexError):
            continue  # it exited while we looked
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop(0)
        if p in cpu:
            tree[p] = cpu[p]
            todo += sorted(c for c, pp in parent.items() if pp == p)
    return tree


def cpu_percent(before: dict[int, float], after: dict[int, float], wall: float) -> list[float]:
    """Per process of `after` (in its order): CPU % of one core over `wall` seconds."""
    return [round(100 * (t - before.get(p, 0.0)) / wall, 1) for p, t in after.items()]


def preemptions(metrics: dict) -> float:
    return metrics.get("minipaged:num_preemptions_total", metrics.get("vllm:num_preemptions_total", 0))


async def run_level(url: str, headers: dict, model: str, prompts, max_tokens, concurrency: int,
                    clients: int, temperature: float, server_pid: Optional[int] = None,
                    start_timeout: float = 300.0) -> LevelResult:
    """One closed-loop level, its C workers spread over client processes (see the docstring).
    This process only starts them, watches /metrics and gathers their results."""
    from minipaged.server.metrics import parse_metrics
    ctx = mp.get_context("spawn")
    ready, reports, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = []
    for j, (idx, workers) in enumerate(split_load(len(prompts), concurrency, clients)):
        jobs = [(i, prompts[i], max_tokens[i]) for i in idx]
        procs.append(ctx.Process(target=client_process, daemon=True,
                                 args=(j, url, headers, model, jobs, workers, temperature,
                                       ready, start, reports)))
    for p in procs:
        p.start()
    try:
        await asyncio.to_thread(_collect, ready, procs, len(procs), "the clients to start",
                                start_timeout)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            before = parse_metrics((await client.get("/metrics")).text)
            peaks, stop = {"running": 0, "waiting": 0}, asyncio.Event()
            watcher = asyncio.create_task(watch_metrics(client, peaks, stop))
            server_cpu0, t0 = process_tree_cpu(server_pid), time.perf_counter()
            start.set()
            got: list[ClientReport] = await asyncio.to_thread(
                _collect, reports, procs, len(procs), "the clients' results", 24 * 3600)
            server_cpu1, t1 = process_tree_cpu(server_pid), time.perf_counter()
            stop.set()
            await watcher
            after = parse_metrics((await client.get("/metrics")).text)
    finally:
        stop_clients(procs)
    got = checked(got)
    elapsed = max(r.end for r in got) - min(r.start for r in got)
    results = [res for _, res in sorted((x for r in got for x in r.results), key=lambda x: x[0])]
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"  error: {r.error}", file=sys.stderr)
    from minipaged.lessons.bench import percentiles_ms
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    cpu = [round(100 * r.busy_fraction, 1) for r in got]
    return LevelResult(
        concurrency=concurrency, clients=len(got), num_requests=len(results),
        errors=len(results) - len(ok), elapsed_sec=round(elapsed, 3),
        requests_per_sec=round(len(ok) / elapsed, 3),
        output_tokens=tokens, output_tokens_per_sec=round(tokens / elapsed, 1),
        ttft_ms=percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=percentiles_ms([x for r in ok for x in r.itl]),
        itl_mean_ms=percentiles_ms([sum(r.itl) / len(r.itl) for r in ok if r.itl]),
        tpot_ms_mean=round(sum(tpot) / len(tpot) * 1e3, 2) if tpot else 0.0,
        preemptions=int(preemptions(after) - preemptions(before)),
        peak_running=peaks["running"], peak_waiting=peaks["waiting"],
        client_cpu_percent=cpu, client_cpu_percent_max=max(cpu),
        server_cpu_percent=cpu_percent(server_cpu0, server_cpu1, t1 - t0))


def warm_up_levels(a: argparse.Namespace, url: str, headers: dict, model: str, wl, vocab: int,
                   levels_c: list[int], salt: int, server_pid: Optional[int]) -> list[dict]:
    """Each concurrency level's shapes once, untimed (largest first; see the docstring); one
    dict per warm-up: concurrency, requests, tokens, seconds."""
    done = []
    for i, c in enumerate(sorted(set(levels_c), reverse=True)):
        n = min(len(wl.prompts), c if a.warmup is None else a.warmup)
        if n < 1:
            continue
        r = asyncio.run(run_level(url, headers, model, salted(wl.prompts[:n], salt + i, vocab),
                                  wl.max_tokens[:n], min(c, n),
                                  a.clients or default_clients(min(c, n)), a.temperature,
                                  server_pid))
        done.append({"concurrency": min(c, n), "requests": n,
                     "prompt_tokens": sum(map(len, wl.prompts[:n])),
                     "output_tokens": r.output_tokens, "seconds": r.elapsed_sec,
                     "errors": r.errors})
        print(f"  warm-up (untimed) at concurrency {min(c, n)}: {n} requests, "
              f"{r.output_tokens:,} output tokens, {r.elapsed_sec:.2f} s", flush=True)
    return done


# --- the offline reference -------------------------------------------------------------------
def engine_flags(model: str, server_args: list[str]) -> tuple[dict, list[str]]:
    """`LLM(**kwargs)` for the engine flags among `server_args` (minipaged's own declaration,
    as `minipaged serve` parses them), and the arguments that are not engine flags."""
    from minipaged.cli.args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    ns, rest = parser.parse_known_args(server_args)
    if ns.model_arg is not None:  # the value of a server-only flag, taken for MODEL
        rest.append(ns.model_arg)
    ns.model_arg, ns.model = None, model  # `serve MODEL`: the positional model wins
    return engine_kwargs(ns), rest


def median(xs: list) -> Optional[float]:
    """The middle value (the lower of the two middle ones for an even count), Nones left out."""
    xs = sorted(x for x in xs if x is not None)
    return xs[(len(xs) - 1) // 2] if xs else None


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (so its other numbers belong to the same run)."""
    return dict(sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2])


def offline_reference(model: str, server_args: list[str], workload: dict, vocab: int,
                      bos: Optional[int], single_requests: int, temperature: float,
                      torch_threads: Optional[int], repeats: int = 1) -> dict:
    """The offline engine on the workload (runs in its own process; see the docstring)."""
    from minipaged.lessons.bench import percentiles_ms
    if torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    import torch
    if torch_threads:
        torch.set_num_threads(torch_threads)
    from minipaged import LLM, SamplingParams
    from minipaged.lessons.bench import Warmup, Workload, run_minipaged

    kwargs, ignored = engine_flags(model, server_args)
    llm = LLM(**kwargs)
    wl = build_workload(argparse.Namespace(**workload), vocab, bos, llm.config.max_model_len)
    runs = []
    for r in range(repeats):  # salts: 0 (the workload itself), then 2, 3, ...; 1: the lone runs
        print(f"offline: {len(wl.prompts)} requests at once (run {r + 1} of {repeats}) ...",
              flush=True)
        salt = 0 if r == 0 else 1 + r
        runs.append(asdict(run_minipaged(llm, Workload(wl.name, salted(wl.prompts, salt, vocab),
                                                       wl.max_tokens), temperature,
                                         warmup=r == 0)))  # warmed once, before the first
    print(f"offline: the first run after a {Warmup(**runs[0]['extra']['warmup'])}", flush=True)
    batch = median_run(runs, "tokens_per_sec")
    extra = batch.pop("extra")
    extra["warmup"] = runs[0]["extra"]["warmup"]
    n = len(wl.prompts) if single_requests <= 0 else min(single_requests, len(wl.prompts))
    print(f"offline: {n} requests one at a time ...", flush=True)
    ttft, itl = [], []
    for prompt, m in zip(salted(wl.prompts[:n], 1, vocab), wl.max_tokens[:n]):
        out = llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=m,
                                                    ignore_eos=True, seed=None), use_tqdm=False)[0]
        k = len(out.outputs[0].token_ids)
        ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
        if k > 1:
            itl.append((out.metrics["finished_time"] - out.metrics["first_token_time"]) / (k - 1))
    return {
        "engine_kwargs": kwargs,
        "server_args_not_for_the_engine": ignored,
        "resolved": {f: getattr(llm.config, f) for f in
                     ("device", "dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
                      "max_model_len", "attention_backend", "async_scheduling", "fused_ops")},
        "torch_threads": torch.get_num_threads(),
        "workload_digest": digest(wl.prompts, wl.max_tokens),
        "batch": {"num_requests": batch["num_requests"], "elapsed_sec": batch["elapsed_sec"],
                  "output_tokens": batch["output_tokens"],
                  "output_tokens_per_sec": batch["tokens_per_sec"],
                  "ttft_ms": extra.pop("ttft_ms"),
                  "itl_ms": extra.pop("itl_ms"),
                  "runs_tokens_per_sec": [x["tokens_per_sec"] for x in runs], **extra},
        "single": {"num_requests": n, "ttft_ms": percentiles_ms(ttft), "itl_ms": percentiles_ms(itl)},
    }


def run_offline(a: argparse.Namespace, vocab: int, bos: Optional[int]) -> dict:
    """`offline_reference` in a fresh process (spawn), which gives the GPU back when it exits,
    before the server takes it."""
    workload = {k: getattr(a, k) for k in ("workload", "num_requests", "seed", "input_len",
                                           "output_len")}
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(offline_reference, a.model, shlex.split(a.server_args), workload,
                           vocab, bos, a.single_requests, a.temperature, a.torch_threads,
                           a.repeats).result()


def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return round(x / y, 3) if x is not None and y else None


def compare(level: LevelResult, offline: dict) -> dict:
    b, s = offline["batch"], offline["single"]
    out = {"tokens_per_sec": ratio(level.output_tokens_per_sec, b["output_tokens_per_sec"]),
           "itl_p99": ratio(level.itl_ms["p99"], b["itl_ms"]["p99"]),
           "itl_p99_per_request": ratio(level.itl_mean_ms["p99"], b["itl_ms"]["p99"])}
    if level.concurrency == 1:
        out["single_ttft_p50"] = ratio(level.ttft_ms["p50"], s["ttft_ms"]["p50"])
        out["single_itl_p50"] = ratio(level.itl_ms["p50"], s["itl_ms"]["p50"])
    return out


def bars(levels: list[LevelResult]) -> list[dict]:
    """The served path's bars, judged on this run's own offline numbers: the median ratio over
    the --repeats runs of the largest concurrency (throughput, ITL p99) and of concurrency 1."""
    def bar(text, rows, key, ok):
        values = [r.vs_offline.get(key) for r in rows]
        v = median(values)
        return {"bar": text, "value": v, "values": values, "met": v is not None and ok(v)}

    out = []
    top_c = max(r.concurrency for r in levels)
    top = [r for r in levels if r.concurrency == top_c]
    if top_c > 1:
        out.append(bar(f"concurrency {top_c}: serve tok/s >= {BAR_THROUGHPUT:.0%} of offline",
                       top, "tokens_per_sec", lambda v: v >= BAR_THROUGHPUT))
        out.append(bar(f"concurrency {top_c}: serve ITL p99 <= {BAR_ITL_P99:g}x offline ITL p99",
                       top, "itl_p99", lambda v: v <= BAR_ITL_P99))
    ones = [r for r in levels if r.concurrency == 1]
    if ones:
        for key, what in (("single_ttft_p50", "TTFT p50"), ("single_itl_p50", "ITL p50")):
            out.append(bar(f"concurrency 1: {what} <= {BAR_SINGLE:g}x a lone offline request's",
                           ones, key, lambda v: v <= BAR_SINGLE))
    return out


# --- report ----------------------------------------------------------------------------------
def trio(d: dict) -> str:
    return " / ".join("-" if d.get(k) is None else f"{d[k]:g}" for k in ("p50", "p90", "p99"))


def fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(levels: list[LevelResult], offline: Optional[dict] = None) -> str:
    head = ("| concurrency | clients | requests | errors | req/s | output tok/s "
            "| TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | peak running / waiting "
            "| preemptions | client CPU max | server CPU per process |")
    align = "|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|"
    if offline:
        head += (" tok/s / offline | ITL p99 / offline (gaps; per request) "
                 "| TTFT p50 / lone offline | ITL p50 / lone offline |")
        align += "---:|---:|---:|---:|"
    rows = [head, align]
    repeated = any(r.repeat for r in levels)
    for r in levels:
        row = (f"| {r.concurrency}{f' #{r.repeat + 1}' if repeated else ''} | {r.clients} | {r.num_requests} | {r.errors} "
               f"| {r.requests_per_sec:.2f} | {r.output_tokens_per_sec:,.0f} | {trio(r.ttft_ms)} "
               f"| {trio(r.itl_ms)} | {r.peak_running} / {r.peak_waiting} | {r.preemptions} "
               f"| {r.client_cpu_percent_max:.0f}% "
               f"| {' + '.join(f'{x:.0f}%' for x in r.server_cpu_percent) or '-'} |")
        if offline:
            v = r.vs_offline
            row += (f" {fmt(v['tokens_per_sec'])} | {fmt(v['itl_p99'])}; "
                    f"{fmt(v['itl_p99_per_request'])} | {fmt(v.get('single_ttft_p50'))} "
                    f"| {fmt(v.get('single_itl_p50'))} |")
        rows.append(row)
    return "\n".join(rows)


def offline_table(offline: dict) -> str:
    b, s = offline["batch"], offline["single"]
    every = b.get("runs_tokens_per_sec", [])
    runs = f" (median of {', '.join(f'{x:,.0f}' for x in every)})" if len(every) > 1 else ""
    rows = ["| offline engine | requests | output tok/s | TTFT p50 / p90 / p99 (ms) "
            "| ITL per request p50 / p90 / p99 (ms) |",
            "|---|---:|---:|---|---|",
            f"| all at once (minipaged bench) | {b['num_requests']} "
            f"| {b['output_tokens_per_sec']:,.0f}{runs} | {trio(b['ttft_ms'])} "
            f"| {trio(b['itl_ms'])} |",
            f"| one at a time | {s['num_requests']} | - | {trio(s['ttft_ms'])} "
            f"| {trio(s['itl_ms'])} |"]
    return "\n".join(rows)


def model_info(model: str, vocab_size: Optional[int]) -> tuple[int, Optional[int]]:
    try:
        return _serving.model_info(model, vocab_size)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def main(argv: Optional[list[str]] = None) -> int:
    from minipaged.lessons.bench import WORKLOADS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="stories260K",
                    help="model to serve (and the `model` field of each request)")
    ap.add_argument("--base-url", default=None, help="target a running server instead")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--server-args", default="",
                    help='extra `minipaged serve` flags, e.g. "--max-num-seqs 64 --num-blocks 2048"; '
                         "their engine flags are also the offline engine's")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--workload", default="cpu", choices=WORKLOADS)
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    ap.add_argument("--input-len", type=int, default=128, help="for --workload fixed")
    ap.add_argument("--output-len", type=int, default=128, help="for --workload fixed")
    ap.add_argument("--concurrency", default="1,8,32,64",
                    help="comma-separated in-flight request counts")
    ap.add_argument("--clients", type=int, default=None,
                    help=f"client processes per level (at most the concurrency); default: "
                         f"min(concurrency, half the CPUs, {MAX_DEFAULT_CLIENTS})")
    ap.add_argument("--single-requests", type=int, default=16,
                    help="concurrency-1 levels and the offline one-at-a-time run send the first "
                         "N requests of the workload (0: all)")
    ap.add_argument("--offline", action="store_true",
                    help="first run the same workload through the offline engine (same engine "
                         "flags), for the serve / offline ratios")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each concurrency level (and the offline batch) N times; the bars "
                         "use the medians")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch CPU threads of the server and the offline engine "
                         "(OMP_NUM_THREADS); default: torch's")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: from the model config")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=None,
                    help="requests sent untimed before measuring, at each concurrency level "
                         "(with their full max_tokens), so first-use costs (Triton JIT, CUDA "
                         "graphs, allocator) stay out of the numbers; default: the level's "
                         "concurrency; 0: no warm-up")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.clients is not None and a.clients < 1:
        ap.error("--clients must be at least 1")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")

    vocab, bos = model_info(a.model, a.vocab_size)
    levels_c = [int(c) for c in a.concurrency.split(",")]
    offline = None
    if a.offline:
        offline = run_offline(a, vocab, bos)
        if offline["server_args_not_for_the_engine"]:
            print("offline: not engine flags (server only), ignored:",
                  " ".join(offline["server_args_not_for_the_engine"]), flush=True)
        print(offline_table(offline), flush=True)
    # level j uses salt + 1 + j; the warm-ups salt + 1 + (number of levels) + i
    salt = random.SystemRandom().randrange(2, 1 << 20)
    proc = None
    if a.base_url:
        url = a.base_url.rstrip("/").removesuffix("/v1")
    else:
        proc, url = start_server(a.model, shlex.split(a.server_args), a.server_timeout,
                                 a.torch_threads)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    server_pid = proc.pid if proc is not None else None
    levels = []
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
        name = a.model if any(m["id"] == a.model for m in models) else models[0]["id"]
        max_model_len = models[0].get("max_model_len")
        wl = build_workload(a, vocab, bos, max_model_len)
        if offline and offline["workload_digest"] != digest(wl.prompts, wl.max_tokens):
            print("warning: the offline engine built a different workload (another "
                  "max_model_len?): the ratios compare different requests", file=sys.stderr)
        print(f"model {name!r} ({'dummy weights, ' if a.model.startswith('dummy:') else ''}"
              f"vocab {vocab}, max_model_len {max_model_len}) at {url}; workload {a.workload}: "
              f"{len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt tokens, "
              f"{sum(wl.max_tokens)} output tokens per level; {platform.machine()}, "
              f"{os.cpu_count()} CPUs", flush=True)
        runs = [(c, i) for c in levels_c for i in range(a.repeats)]
        warmups = warm_up_levels(a, url, headers, name, wl, vocab, levels_c,
                                 salt + 1 + len(runs), server_pid)
        for j, (c, i) in enumerate(runs):
            n = len(wl.prompts)
            if c == 1 and a.single_requests > 0:
                n = min(n, a.single_requests)
            k = a.clients or default_clients(c)
            r = asyncio.run(run_level(url, headers, name, salted(wl.prompts[:n], salt + 1 + j, vocab),
                                      wl.max_tokens[:n], c, k, a.temperature, server_pid))
            r.repeat = i
            if offline:
                r.vs_offline = compare(r, offline)
            levels.append(r)
            print(f"  concurrency {c:4d}: {r.requests_per_sec:7.2f} req/s, "
                  f"{r.output_tokens_per_sec:9,.0f} tok/s, TTFT p50 {r.ttft_ms['p50']} ms, "
                  f"ITL p50 {r.itl_ms['p50']} ms, errors {r.errors}, {r.clients} client(s) at "
                  f"most {r.client_cpu_percent_max:.0f}% CPU"
                  + (", server " + " + ".join(f"{x:.0f}%" for x in r.server_cpu_percent)
                     + " CPU" if r.server_cpu_percent else ""), flush=True)
            if r.client_cpu_percent_max > CLIENT_CPU_WARN:
                print(f"  warning: a client process used {r.client_cpu_percent_max:.0f}% of a core "
                      f"at concurrency {c}: the load generator may be limiting the numbers; "
                      "raise --clients", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    print()
    if offline:
        print(offline_table(offline))
        print()
    print(table(levels, offline))
    verdicts = bars(levels) if offline and levels else []
    for b in verdicts:
        spread = [v for v in b["values"] if v is not None]
        print(f"{'meets ' if b['met'] else 'misses'}  {b['bar']}: {fmt(b['value'])}"
              + (f" (median of {', '.join(fmt(v) for v in spread)})" if len(spread) > 1 else ""))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "model": a.model, "workload": a.workload, "server_args": a.server_args,
            "clients": a.clients, "single_requests": a.single_requests, "repeats": a.repeats,
            "torch_threads": a.torch_threads, "prompt_salt_base": salt,
            "warmup": {"what": "before the first level, untimed: each concurrency level's first "
                               "requests (as many as the level's concurrency, or --warmup) at "
                               "that concurrency, full max_tokens, prompts salted",
                       "levels": warmups},
            "machine": platform.platform(), "offline": offline, "bars": verdicts,
            "levels": [asdict(r) for r in levels]}, indent=1))
        print(f"\nwrote {a.out}")
    return 0 if all(r.errors == 0 for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
