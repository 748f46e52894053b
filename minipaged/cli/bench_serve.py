"""`minipaged bench serve`: requests at a rate against any OpenAI-compatible server (lesson 13).

    minipaged serve stories260K --device cpu &                  # or vllm serve, or any server
    minipaged bench serve --model stories260K --request-rate 2,8,32 --num-prompts 200 \\
        --goodput ttft:500 tpot:50 --json rates.json            # rates.png: the curve
    minipaged bench serve --base-url http://gpu-box:8000 --model dummy:qwen3-0.6b \\
        --workload nanovllm --request-rate inf --max-concurrency 64

vLLM's `vllm bench serve`, with its flag and metric names: requests arrive as a Poisson process
at `--request-rate` (requests/s; `inf`: all at once), or with gamma-distributed gaps under
`--burstiness` (1: Poisson; < 1 burstier; > 1 more regular), at most `--max-concurrency` in
flight; prompts are token ids from `minipaged bench`'s workloads (`cpu`, `nanovllm`,
`sharegpt`-like, `alpaca`-like, `fixed`) sent to `/v1/completions` with `stream: true` and
`ignore_eos`, so every request produces exactly its `max_tokens`. It prints vLLM's result block:
request and output-token throughput, TTFT, TPOT, ITL and end-to-end latency (mean and the
`--metric-percentiles`), goodput under `--goodput` SLOs, and the vLLM paper's normalized latency
(seconds per output token). Several rates (`--request-rate 1,2,4`) are a sweep: one run each,
one JSON (`--json`), the curve of normalized latency, TTFT and TPOT against the rate (`--plot`,
default: beside the JSON), and the knee: the rate at which the mean normalized latency crosses
4x its value at the lowest rate (interpolated in log rate).

The load comes from `--num-clients` processes (default: up to half the CPUs) so that the
client is not the bottleneck; it reports each one's busy fraction (CPU time / wall time; above
0.7 it warns) and how late it sent requests against the schedule. Each rate's prompts are salted
(their second token changed) so no run hits another's blocks in a prefix cache. Where the server
has Prometheus counters at /metrics (minipaged's `minipaged:`, vLLM's `vllm:`), the JSON holds
what they gained during each rate ("server_counters": requests, prompt and generation tokens,
preemptions), beside what the client counted.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Optional

from minipaged.cli.args import FlexibleArgumentParser, add_common_args, int_at_least
from minipaged.cli.errors import CLIError, run_command

KNEE_FACTOR = 4.0  # the sweep's knee: where latency reaches 4x its lightly loaded value
COUNTERS = ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
            "num_preemptions_total")


def make_parser() -> FlexibleArgumentParser:
    from minipaged.benchmark.throughput import WORKLOADS
    ap = FlexibleArgumentParser(prog="minipaged bench serve", description=__doc__)
    s = ap.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (its /v1/completions and, if it has one, /metrics)")
    s.add_argument("--model", default=None,
                   help="the `model` of each request; default: the server's first model. Also "
                        "where the vocabulary size comes from (minipaged's model resolution)")
    s.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    s.add_argument("--vocab-size", type=int_at_least(4), default=None,
                   help="token ids are drawn below this; default: the model's config")
    w = ap.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", choices=WORKLOADS,
                   help="prompt and output lengths (minipaged bench's workloads)")
    w.add_argument("--num-prompts", type=int_at_least(1), default=200,
                   help="requests per rate")
    w.add_argument("--input-len", type=int_at_least(1), default=128, help="`fixed` workload")
    w.add_argument("--output-len", type=int_at_least(1), default=128, help="`fixed` workload")
    w.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    w.add_argument("--seed", type=int, default=0, help="lengths, prompts and arrivals")
    a = ap.add_argument_group("arrivals")
    a.add_argument("--request-rate", default="inf",
                   help="requests per second, comma-separated for a sweep (inf: all at once)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps: 1 Poisson, < 1 burstier")
    a.add_argument("--max-concurrency", type=int_at_least(1), default=None,
                   help="most requests in flight; default: no limit")
    a.add_argument("--num-clients", type=int_at_least(1), default=None,
                   help="client processes; default: min(load, half the CPUs, 16)")
    a.add_argument("--num-warmups", type=int_at_least(0), default=0,
                   help="untimed requests before the first rate (after one test request)")
    r = ap.add_argument_group("results")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in milliseconds, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    r.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated")
    r.add_argument("--json", default=None, metavar="FILE", help="write every rate's results")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="the curve (default: the JSON's path with .png, for a sweep)")
    add_common_args(ap)
    return ap


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (r > 0) for r in rates):
        raise CLIError(f"--request-rate takes positive numbers (or inf), comma-separated, got "
                       f"{text!r}")
    return rates


def server_counters(client) -> Optional[dict[str, float]]:
    """The Prometheus counters of /metrics (minipaged's or vLLM's names), or None."""
    try:
        r = client.get("/metrics")
        if r.status_code != 200:
            return None
        from minipaged.server.metrics import parse_metrics
        m = parse_metrics(r.text)
    except Exception:  # noqa: BLE001 - no /metrics, no prometheus_client: no counters
        return None
    for prefix in ("minipaged:", "vllm:"):
        if any(k.startswith(prefix) for k in m):
            return {c: m.get(prefix + c, 0.0) for c in COUNTERS}
    return None


def run_rate(args, url: str, headers: dict, model: str, wl, vocab: int, rate: float,
             salt: int, clients: int, percentiles: tuple, goodput: dict, http) -> dict:
    from minipaged.benchmark.load_client import CLIENT_BUSY_WARN, Job, run_open_loop
    from minipaged.benchmark.serving import arrival_offsets, calculate_metrics, salted
    prompts = salted(wl.prompts, salt, vocab)
    offsets = arrival_offsets(len(prompts), rate, args.burstiness, args.seed)
    jobs = [Job(i, p, m, t) for i, (p, m, t) in enumerate(zip(prompts, wl.max_tokens, offsets))]
    before = server_counters(http)
    results, duration, reports = run_open_loop(url, model, jobs, clients=clients,
                                               max_concurrency=args.max_concurrency,
                                               temperature=args.temperature, headers=headers)
    after = server_counters(http)
    m = {"request_rate": rate, "burstiness": args.burstiness,
         "max_concurrency": args.max_concurrency,
         **calculate_metrics(results, duration, percentiles, goodput)}
    import numpy as np
    lags = [x for r in reports for x in (r.send_lag or [])]
    m.update(num_clients=len(reports),
             client_busy_fraction=max(r.busy_fraction for r in reports),
             client_busy_fractions=[round(r.busy_fraction, 3) for r in reports],
             p99_send_lag_ms=float(np.percentile(lags, 99) * 1e3) if lags else 0.0,
             errors=[r.error for r in results if not r.ok][:10])
    if before is not None and after is not None:
        m["server_counters"] = {k: after[k] - before[k] for k in COUNTERS}
    if m["client_busy_fraction"] > CLIENT_BUSY_WARN:
        print(f"warning: a client process was busy {m['client_busy_fraction']:.0%} of the run: "
              "the load generator may be limiting the numbers; raise --num-clients",
              file=sys.stderr, flush=True)
    return m


def bench_serve(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    rates = parse_rates(args.request_rate)
    if not args.burstiness > 0:
        raise CLIError(f"--burstiness must be > 0 (1: Poisson), got {args.burstiness}")
    try:
        import httpx
    except ImportError:
        raise CLIError("minipaged bench serve needs httpx, which is not installed: pip install "
                       "'minipaged[serve]' (in a clone: pip install -e '.[serve]')") from None

    from minipaged.benchmark.load_client import default_clients
    from minipaged.benchmark.serving import format_result, model_info, parse_goodput
    from minipaged.benchmark.throughput import make_workload
    goodput = parse_goodput(args.goodput)
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise CLIError(f"--metric-percentiles takes numbers in [0, 100], got "
                       f"{args.metric_percentiles!r}") from None
    url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        try:
            models = http.get("/v1/models").json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise CLIError(f"no OpenAI-compatible server at {url} (GET /v1/models: {e}); start "
                           "one (minipaged serve MODEL) or pass --base-url") from None
        name = args.model or models[0]["id"]
        vocab, bos = model_info(args.model or models[0].get("root") or name, args.vocab_size)
        max_model_len = models[0].get("max_model_len")
        wl = make_workload(args.workload, vocab, args.num_prompts, args.seed, args.input_len,
                           args.output_len, bos=None if args.workload == "nanovllm" else bos,
                           max_model_len=max_model_len)
        clients = args.num_clients or default_clients(args.max_concurrency or len(wl.prompts))
        print(f"{url}: model {name!r}, workload {wl.name}: {len(wl.prompts)} requests, "
              f"{wl.num_prompt_tokens} prompt tokens, {sum(wl.max_tokens)} output tokens per "
              f"rate; {clients} client process(es)", flush=True)
        salt = random.SystemRandom().randrange(2, 1 << 20)  # this invocation's prompts only
        warmup = warm_up(args, url, headers, name, wl, vocab, salt, clients)
        runs = []
        for i, rate in enumerate(rates):
            t0 = time.time()
            print(f"request rate {rate:g}/s ({i + 1} of {len(rates)}) ...", flush=True)
            m = run_rate(args, url, headers, name, wl, vocab, rate, salt + 1 + i, clients,
                         percentiles, goodput, http)
            runs.append(m)
            print(format_result(m, percentiles), flush=True)
            print(f"({time.time() - t0:.1f} s)", flush=True)
            write_json(args, argv, name, wl, url, goodput, warmup, runs)
    knee = sweep_knee(runs)
    if knee is not None:
        print(f"knee: {knee['rate']:.2f} req/s (mean normalized latency crosses "
              f"{knee['threshold_s'] * 1e3:.1f} ms/token, {KNEE_FACTOR:g}x its value at the lowest "
              "rate)" if knee["rate"] else "knee: not crossed in this sweep", flush=True)
        write_json(args, argv, name, wl, url, goodput, warmup, runs, knee)
    plot = args.plot or (str(Path(args.json).with_suffix(".png"))
                         if args.json and len(rates) > 1 else None)
    if plot:
        plot_sweep(runs, plot, f"{name}, {wl.name} workload")
        print(f"wrote {plot}")
    failed = sum(m["failed"] for m in runs)
    return 0 if failed == 0 else 1


def warm_up(args, url, headers, model, wl, vocab, salt, clients) -> dict:
    """One test request (vLLM's "initial single prompt test run"), then `--num-warmups`;
    what they sent."""
    from minipaged.benchmark.load_client import Job, run_open_loop
    from minipaged.benchmark.serving import salted
    n = 1 + args.num_warmups
    prompts = salted([wl.prompts[i % len(wl.prompts)] for i in range(n)], salt, vocab)
    jobs = [Job(i, p, wl.max_tokens[i % len(wl.prompts)]) for i, p in enumerate(prompts)]
    first, _, _ = run_open_loop(url, model, jobs[:1], clients=1, headers=headers,
                                temperature=args.temperature)
    if not first[0].ok:
        raise CLIError(f"the test request failed: {first[0].error}")
    if len(jobs) > 1:
        run_open_loop(url, model, jobs[1:], clients=min(clients, len(jobs) - 1),
                      max_concurrency=args.max_concurrency, headers=headers,
                      temperature=args.temperature)
    print(f"warm-up (untimed): {n} request(s)", flush=True)
    return {"requests": n, "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(j.max_tokens for j in jobs)}


def sweep_knee(runs: list[dict]) -> Optional[dict]:
    """Where the sweep's mean normalized latency crosses KNEE_FACTOR x its value at the lowest
    finite rate (interpolated in log rate, as the simulator's sweeps read it); None for fewer
    than two finite rates."""
    from minipaged.simulator.sweep import capacity_rate
    pts = sorted((m for m in runs if not math.isinf(m["request_rate"]) and m["completed"]),
                 key=lambda m: m["request_rate"])
    if len(pts) < 2:
        return None
    threshold = KNEE_FACTOR * pts[0]["mean_normalized_latency_s"]
    return {"rate": capacity_rate(pts, threshold), "threshold_s": threshold,
            "rule": f"{KNEE_FACTOR:g}x the mean normalized latency at the lowest rate"}


def write_json(args, argv, model, wl, url, goodput, warmup, runs,
               knee: Optional[dict] = None) -> None:
    if not args.json:
        return
    from minipaged.benchmark.throughput import environment
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "command": "minipaged bench serve " + " ".join(argv), "base_url": url, "model": model,
        "environment": environment(),
        "workload": {"name": wl.name, "num_prompts": len(wl.prompts), "seed": args.seed,
                     "prompt_tokens": wl.num_prompt_tokens, "output_tokens": sum(wl.max_tokens),
                     "temperature": args.temperature, "ignore_eos": True},
        "goodput_slo_ms": goodput or None, "warmup": warmup, "knee": knee,
        "rates": [json_safe(m) for m in runs]}, indent=1))


def json_safe(m: dict) -> dict:
    """inf (an infinite rate) as the string "inf": JSON has no infinity."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in m.items()}


def plot_sweep(runs: list[dict], path: str, title: str) -> None:
    """Normalized latency, TTFT and TPOT against the request rate (finite rates)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = sorted((m for m in runs if not math.isinf(m["request_rate"])),
                 key=lambda m: m["request_rate"])
    x = [m["request_rate"] for m in pts]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(x, [m["mean_normalized_latency_s"] for m in pts], "o-")
    ax[0].set(ylabel="normalized latency (s/token)", title="mean E2E latency / output tokens")
    for key, style in (("median", "o-"), ("p99", "s--")):
        ax[1].plot(x, [m[f"{key}_ttft_ms"] for m in pts], style, label=key)
        ax[2].plot(x, [m[f"{key}_tpot_ms"] for m in pts], style, label=key)
    ax[1].set(ylabel="TTFT (ms)", title="time to first token")
    ax[2].set(ylabel="TPOT (ms)", title="time per output token")
    for a in ax:
        a.set_xlabel("request rate (req/s)")
        a.grid(alpha=0.3)
    ax[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(bench_serve, argv)


if __name__ == "__main__":
    raise SystemExit(main())
