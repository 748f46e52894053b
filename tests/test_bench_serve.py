"""`minipaged bench serve` (cli/bench_serve.py, benchmark/serving.py, benchmark/load_client.py):
the arrival process, vLLM's metrics on hand-made results, the open loop against a mock server,
and a live run against `minipaged serve` (stories260K on the CPU) at two rates whose totals must
equal what the server's own /metrics counters gained."""
from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np
import pytest

from minipaged.benchmark.load_client import Job, run_jobs, split_concurrency
from minipaged.benchmark.serving import (RequestResult, arrival_offsets, calculate_metrics,
                                         parse_goodput, peak_concurrency)
from minipaged.cli import bench_serve
from minipaged.cli.errors import CLIError


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    n, rate = 20000, 4.0
    t = np.array(arrival_offsets(n, rate, 1.0, seed=1))
    assert t[-1] == pytest.approx(n / rate)  # rescaled like vLLM's: the run lasts n / rate
    gaps = np.diff(t)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_have_cv_one_over_sqrt_burstiness(burstiness):
    gaps = np.diff(arrival_offsets(20000, 2.0, burstiness, seed=2))
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_constant_and_infinite_rates_and_bad_values():
    assert arrival_offsets(4, 2.0, math.inf) == [0.5, 1.0, 1.5, 2.0]
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(5, 3.0, seed=7) == arrival_offsets(5, 3.0, seed=7)
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrival_offsets(3, 1.0, -1.0)


def test_metrics_by_hand():
    a = RequestResult(True, 10, 5, ttft=0.1, itl=[0.1] * 4, latency=0.5, start_time=0.0)
    b = RequestResult(True, 20, 1, ttft=0.3, itl=[], latency=0.3, start_time=0.2)
    c = RequestResult(True, 30, 3, ttft=0.2, itl=[0.4, 0.4], latency=1.0, start_time=0.6)
    bad = RequestResult(False, 7, error="HTTP 500")
    m = calculate_metrics([a, b, c, bad], duration=2.0, percentiles=(50, 99),
                          goodput={"ttft": 250, "tpot": 200})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5
    assert m["total_token_throughput"] == 34.5
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200)
    # TPOT per request with more than one token: a (0.5-0.1)/4 = 0.1, c (1.0-0.2)/2 = 0.4
    assert m["mean_tpot_ms"] == pytest.approx(250.0) and m["p50_tpot_ms"] == pytest.approx(250)
    assert m["mean_itl_ms"] == pytest.approx(1.2 / 6 * 1e3)
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    # normalized latency: 0.5/5, 0.3/1, 1.0/3 seconds per token
    assert m["mean_normalized_latency_s"] == pytest.approx((0.1 + 0.3 + 1 / 3) / 3)
    # goodput: a (ttft 100, tpot 100) and b (ttft 300: no) and c (tpot 400: no)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["max_concurrent_requests"] == 2  # a and b overlap, then c alone
    assert calculate_metrics([a], 1.0)["request_goodput"] is None
    assert peak_concurrency([]) == 0


def test_goodput_and_rates_parsing():
    assert parse_goodput(["ttft:200", "tpot:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    for bad in (["itl:3"], ["ttft"], ["ttft:-1"], ["e2el:x"], ["tpot:inf"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert bench_serve.parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "a", "", "1,-2", "nan"):
        with pytest.raises(CLIError, match="--request-rate"):
            bench_serve.parse_rates(bad)
    assert split_concurrency(10, 4) == [3, 3, 2, 2] and split_concurrency(None, 2) == [None] * 2


class MockServer:
    """Streams `max_tokens` chunks after `delay` seconds; counts requests in flight."""

    def __init__(self, delay: float):
        self.delay, self.now, self.peak, self.sent = delay, 0, 0, []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.sent.append(time.monotonic())
        await asyncio.sleep(self.delay)
        self.now -= 1
        n = json.loads(request.content)["max_tokens"]
        events = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(n)]
        events.append({"choices": [], "usage": {"completion_tokens": n}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(),
                              headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("limit", [None, 2])
def test_open_loop_sends_on_schedule_and_caps_what_is_in_flight(limit):
    server = MockServer(delay=0.15)
    jobs = [Job(i, [1, 2, 3], 3 + i, offset=0.02 * i) for i in range(6)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server),
                                     base_url="http://test") as client:
            start = time.monotonic() + 0.05
            return start, await run_jobs(client, "m", jobs, start, limit, 0.0)

    start, done = asyncio.run(go())
    assert [i for i, _, _ in done] == list(range(6))
    for i, res, lag in done:
        assert res.ok and res.output_tokens == 3 + i and len(res.itl) == 2 + i
        assert res.start_time >= start + jobs[i].offset - 1e-3  # never early
    if limit is None:  # an open loop: all six in flight before the first answer
        assert server.peak == 6
    else:
        assert server.peak == 2
        assert server.sent[2] - start >= 0.15  # the third waited for a free slot


@pytest.mark.timeout(300)
def test_live_against_minipaged_serve_matches_the_servers_counters(tmp_path):
    from minipaged.lessons.server import InProcessServer
    from minipaged.server.metrics import parse_metrics
    out = tmp_path / "rates.json"
    keys = {"requests": 'minipaged:request_success_total{finished_reason="length"}',
            "prompt": "minipaged:prompt_tokens_total",
            "generated": "minipaged:generation_tokens_total"}
    with InProcessServer("stories260K", "--device", "cpu", "--num-blocks", "512",
                         "--max-num-seqs", "16") as server:
        def counters():
            m = parse_metrics(httpx.get(server.url + "/metrics").text)
            return {k: m.get(v, 0.0) for k, v in keys.items()}

        before = counters()
        rc = bench_serve.main(["--base-url", server.url, "--model", "stories260K",
                               "--workload", "cpu", "--num-prompts", "8", "--request-rate",
                               "4,16", "--num-clients", "2", "--goodput", "ttft:5000",
                               "tpot:1000", "--json", str(out)])
        after = counters()
    assert rc == 0
    data = json.loads(out.read_text())
    rates = data["rates"]
    assert [r["request_rate"] for r in rates] == [4.0, 16.0]
    warm = data["warmup"]
    assert warm["requests"] == 1
    got = {k: after[k] - before[k] for k in keys}
    assert got["requests"] == sum(r["completed"] for r in rates) + warm["requests"] == 17
    assert got["generated"] == sum(r["total_output_tokens"] for r in rates) + warm["output_tokens"]
    assert got["prompt"] == sum(r["total_input_tokens"] for r in rates) + warm["prompt_tokens"]
    for r in rates:
        assert r["failed"] == 0 and r["completed"] == 8 and r["num_clients"] == 2
        c = r["server_counters"]  # what the command itself read around each rate
        assert c["request_success_total"] == r["completed"]
        assert c["generation_tokens_total"] == r["total_output_tokens"]
        assert c["prompt_tokens_total"] == r["total_input_tokens"]
        assert 0 < r["client_busy_fraction"] < 1 and len(r["client_busy_fractions"]) == 2
        assert r["request_goodput"] is not None and r["request_goodput"] <= r["request_throughput"]
        for key in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms",
                    "output_throughput", "mean_normalized_latency_s"):
            assert r[key] > 0, key
        # duration covers the arrivals (n / rate) and the last answer
        assert r["duration"] >= 8 / r["request_rate"]
    assert (tmp_path / "rates.png").stat().st_size > 0
    knee = data["knee"]
    assert knee["threshold_s"] == pytest.approx(4 * rates[0]["mean_normalized_latency_s"])
    low, high = (r["mean_normalized_latency_s"] for r in rates)
    assert (knee["rate"] is None) == (high <= knee["threshold_s"])


def test_the_command_exists_and_a_missing_server_is_one_line(capsys):
    from minipaged.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--help"])
    assert e.value.code == 0 and "--request-rate" in capsys.readouterr().out
    from minipaged.lessons.server import free_port
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: no OpenAI-compatible server at") and err.count("\n") == 1
    assert main(["bench", "serve", "--request-rate", "0"]) == 2
    assert "--request-rate takes positive numbers" in capsys.readouterr().err
