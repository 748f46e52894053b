"""benchmarks/serve_load.py: the split of a level over client processes, the prompt salts, the
engine flags of the offline reference, one client's closed loop (against a mock transport), and
one small end-to-end run on stories260K (server, two client processes, offline reference)."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))  # spawned client processes import `serve_load` by this path too
import serve_load as sl  # noqa: E402


def test_split_load_sends_every_request_once_and_spreads_the_workers():
    for n, c, k in [(256, 256, 4), (256, 64, 1), (16, 8, 3), (10, 2, 5), (5, 7, 2)]:
        shares = sl.split_load(n, c, k)
        assert len(shares) == min(k, c)
        assert sum(w for _, w in shares) == c
        assert sorted(i for idx, _ in shares for i in idx) == list(range(n))
        for j, (idx, _) in enumerate(shares):
            assert all(i % len(shares) == j for i in idx)
    assert [w for _, w in sl.split_load(100, 10, 4)] == [3, 3, 2, 2]
    assert [sl.default_clients(c, cpus=16) for c in (1, 4, 64, 256)] == [1, 4, 8, 8]
    assert sl.default_clients(64, cpus=2) == 1 and sl.default_clients(256, cpus=128) == 16


def test_salts_change_one_early_token_and_keep_lengths():
    prompts = [[1, 5, 7, 9], [1, 511], [4]]
    assert sl.salted(prompts, 0, 512) is prompts
    a, b = sl.salted(prompts, 3, 512), sl.salted(prompts, 4, 512)
    assert [len(p) for p in a] == [len(p) for p in prompts]
    assert a[0][0] == 1 and a[0][2:] == [7, 9] and a[0][1] != 5  # BOS kept, token 1 salted
    assert a[1][1] == 3 + (511 - 3 + 3) % 509  # wraps inside [3, vocab)
    assert all(3 <= p[min(1, len(p) - 1)] < 512 for p in a + b)
    assert all(x != y for x, y in zip(a, b))
    assert prompts == [[1, 5, 7, 9], [1, 511], [4]]  # the originals are untouched


def test_engine_flags_are_minipaged_serves():
    kwargs, rest = sl.engine_flags("dummy:qwen3-0.6b", [
        "--block-size", "128", "--served-model-name", "tiny", "--no-enable-prefix-caching",
        "--max_num_seqs", "64", "--api-key", "k"])
    assert kwargs["model"] == "dummy:qwen3-0.6b"
    assert kwargs["block_size"] == 128 and kwargs["max_num_seqs"] == 64
    assert kwargs["enable_prefix_caching"] is False
    assert set(rest) == {"--served-model-name", "tiny", "--api-key", "k"}


def test_process_tree_cpu_reads_this_process_and_its_children():
    if sys.platform != "linux":
        pytest.skip("/proc")
    import os
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t0 = sl.process_tree_cpu(os.getpid())
        sum(i * i for i in range(2_000_000))
        t1 = sl.process_tree_cpu(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert list(t1)[0] == os.getpid() and child.pid in t1
    assert sl.cpu_percent(t0, t1, 1.0)[0] > 0
    assert sl.process_tree_cpu(None) == {}


def _sse_server(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    n = body["max_tokens"]
    events = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(n)]
    events.append({"choices": [], "usage": {"completion_tokens": n}})
    lines = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, content=lines.encode(), headers={"content-type": "text/event-stream"})


def test_one_client_runs_its_jobs_in_a_closed_loop():
    jobs = [(i, [1, 2, 3][: i % 3 + 1], 3 + i) for i in range(0, 10, 2)]  # client 0 of 2

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_sse_server),
                                     base_url="http://test") as client:
            return await sl.drive(client, "m", jobs, 2, 0.0)

    results = asyncio.run(go())
    assert sorted(i for i, _ in results) == [0, 2, 4, 6, 8]
    for i, r in results:
        assert r.ok and r.output_tokens == 3 + i and len(r.itl) == 2 + i and r.ttft is not None


def test_ratios_table_and_bars():
    offline = {"batch": {"num_requests": 4, "output_tokens_per_sec": 1000.0,
                         "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0},
                         "itl_ms": {"p50": 1.0, "p90": 1.5, "p99": 2.0}},
               "single": {"num_requests": 2, "ttft_ms": {"p50": 2.0, "p90": 2.0, "p99": 2.0},
                          "itl_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}}}

    def level(c, tok_s, itl_p99, ttft_p50, itl_p50):
        p = {"p50": itl_p50, "p90": itl_p50, "p99": itl_p99}
        return sl.LevelResult(c, 1, 4, 0, 1.0, 4.0, 100, tok_s, {"p50": ttft_p50, "p90": 1, "p99": 1},
                              p, p, 1.0, 0, c, 0, [12.0], 12.0)

    levels = [level(1, 300.0, 1.5, 2.1, 1.05), level(8, 900.0, 5.0, 3.0, 1.0)]
    for r in levels:
        r.vs_offline = sl.compare(r, offline)
    assert levels[0].vs_offline["single_ttft_p50"] == 1.05
    assert levels[1].vs_offline == {"tokens_per_sec": 0.9, "itl_p99": 2.5,
                                    "itl_p99_per_request": 2.5}
    assert [b["met"] for b in sl.bars(levels)] == [True, False, True, True]
    again = level(8, 700.0, 3.0, 3.0, 1.0)  # a second and a third run of concurrency 8
    third = level(8, 800.0, 4.0, 3.0, 1.0)
    for i, r in enumerate((again, third), 1):
        r.vs_offline, r.repeat = sl.compare(r, offline), i
    verdicts = sl.bars(levels + [again, third])
    assert verdicts[0]["value"] == 0.8 and verdicts[0]["values"] == [0.9, 0.7, 0.8]
    assert verdicts[1]["value"] == 2.0 and verdicts[1]["met"]
    assert "| 8 #2 |" in sl.table(levels + [again, third], offline)
    assert sl.median_run([{"t": 3}, {"t": 1}, {"t": 2}, {"t": 4}], "t") == {"t": 2}
    text = sl.table(levels, offline)
    assert "| 0.90 | 2.50; 2.50 | - | - |" in text and "tok/s / offline" in text
    assert "offline" not in sl.table(levels) and "12%" in sl.table(levels)


@pytest.mark.timeout(300)
def test_end_to_end_on_stories260k(tmp_path):
    out = tmp_path / "serve_load.json"
    rc = sl.main(["--num-requests", "6", "--concurrency", "1,4", "--clients", "2",
                  "--single-requests", "2", "--warmup", "2", "--offline", "--torch-threads", "1",
                  "--repeats", "2",
                  "--server-args", "--device cpu --max-model-len 256", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    one, one_again, four, four_again = data["levels"]
    assert (one["clients"], one["num_requests"], four["clients"], four["num_requests"]) == (1, 2, 2, 6)
    assert (one["repeat"], one_again["repeat"], four_again["concurrency"]) == (0, 1, 4)
    assert len(data["offline"]["batch"]["runs_tokens_per_sec"]) == 2
    assert len(four["client_cpu_percent"]) == 2 and four["client_cpu_percent_max"] > 0
    if sys.platform == "linux":  # the server's CPU time comes from /proc
        assert four["server_cpu_percent"] and four["server_cpu_percent"][0] > 0
    assert data["offline"]["batch"]["num_requests"] == 6
    # warmed up untimed: each level's concurrency (--warmup 2 requests), the offline batch once
    assert [(w["concurrency"], w["requests"]) for w in data["warmup"]["levels"]] == [(2, 2),
                                                                                    (1, 2)]
    assert data["offline"]["batch"]["warmup"]["requests"] == 6
    assert data["offline"]["single"]["num_requests"] == 2
    assert data["offline"]["engine_kwargs"]["max_model_len"] == 256
    assert set(one["vs_offline"]) >= {"tokens_per_sec", "itl_p99", "single_ttft_p50"}
