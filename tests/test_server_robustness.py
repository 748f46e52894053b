"""Serving that holds: `minipaged serve` as a user runs it (API server + engine-core process),
attacked with what used to break it. Lesson 07 explains the design.

Each test here reproduces a failure of the one-process server: a poison field that killed the
engine thread for everyone, NaN accepted, stop strings cutting text produced before min_tokens,
a lone surrogate answered with a reset connection, a 10 MB prompt or a heavy chat template
stalling /health, SIGTERM cutting streams without `[DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minipaged.server.metrics import parse_metrics

PROMPT = "Once upon a time"
TEMPLATE = "{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
BODY_LIMIT = 1_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m minipaged serve stories260K ARGS` on a free port, one CPU thread."""

    def __init__(self, *args: str):
        self.port = _free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minipaged.cli", "serve", "stories260K", "--device", "cpu",
             "--port", str(self.port), "--uvicorn-log-level", "warning", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.time() + 120
        while True:
            assert self.proc.poll() is None, "server exited:\n" + "".join(self.log)
            assert time.time() < deadline, "server did not start:\n" + "".join(self.log)
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=kw.pop("timeout", 60), **kw)

    def raw_post(self, path: str, content: bytes, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + path, content=content, timeout=timeout,
                          headers={"content-type": "application/json"})

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (m["minipaged:kv_cache_blocks_used"] == 0 and m["minipaged:num_requests_running"] == 0
                    and m["minipaged:num_requests_waiting"] == 0):
                return m
            assert time.time() < deadline, f"not idle: {m}"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def stream_text(url: str, body: dict, timeout: float = 120) -> tuple[str, list[dict], bool]:
    """POST a streaming completion; (text, events, ended with [DONE])."""
    text, events, done = "", [], False
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            events.append(event)
            for c in event.get("choices", []):
                text += c["text"]
    return text, events, done


@pytest.fixture(scope="module")
def server():
    s = ServeProcess("--num-blocks", "96", "--max-num-seqs", "64", "--chat-template", TEMPLATE,
                     "--max-request-body-bytes", str(BODY_LIMIT))
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def idle_text(server):
    """The greedy story, as the server tells it with nothing else running."""
    def text(max_tokens: int = 40, prompt: str = PROMPT) -> str:
        r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0})
        return r.json()["choices"][0]["text"]
    return text


# --- a request's fault stays its own -----------------------------------------------------------
POISON = [
    ({"seed": 2**64 - 1, "n": 2}, "seed"),  # sample 1 would draw from seed + 1 = 2**64
    ({"seed": 2**70}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt": [1.5, 2.0]}, "prompt"),
    ({"prompt": None}, "prompt"),
]


@pytest.mark.parametrize("fields,param", POISON, ids=[p for _, p in POISON])
def test_poison_fields_are_400_and_disturb_no_one(server, idle_text, fields, param):
    expected = idle_text(60)
    bystander: dict = {}

    def run_bystander():
        bystander["result"] = stream_text(server.url, {"prompt": PROMPT, "max_tokens": 60,
                                                       "temperature": 0})
    t = threading.Thread(target=run_bystander)
    t.start()
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8} | fields)
    t.join(120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in err["message"] and err["type"] == "invalid_request_error"
    text, _, done = bystander["result"]
    assert done and text == expected  # the stream next to it went on untouched
    assert httpx.get(server.url + "/health").status_code == 200
    assert idle_text(60) == expected
    server.wait_idle()


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_nan_is_refused(server, field):
    # Python's json (and so FastAPI) reads the non-standard token NaN as float("nan")
    body = f'{{"prompt": "{PROMPT}", "max_tokens": 4, "{field}": NaN}}'.encode()
    r = server.raw_post("/v1/completions", body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] and "nan" in r.json()["error"]["message"].lower()


def test_lone_surrogate_is_400_naming_the_field(server):
    r = server.raw_post("/v1/completions", b'{"prompt": "Once \\ud800 upon", "max_tokens": 4}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "U+D800" in r.json()["error"]["message"]
    r = server.raw_post("/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(server.url + "/health").status_code == 200


# --- stop strings: searched in the new text only, after min_tokens -----------------------------
def test_stop_string_before_min_tokens_does_not_cut_later(server, idle_text):
    from minipaged import LLM, SamplingParams
    story = idle_text(60)
    stop = "Lily"
    assert stop in story[:40]  # the greedy story names Lily early...
    # ...so min_tokens past that point means the first "Lily" must not end or cut the text
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stop": [stop],
            "min_tokens": 20}
    full = server.post("/v1/completions", body).json()
    text = full["choices"][0]["text"]
    streamed, events, done = stream_text(server.url, body)
    assert done and streamed == text
    early = story.index(stop) + len(stop)
    assert text.startswith(story[:early])  # the early Lily stays in the text...
    assert stop not in text[early:]  # ...and a later one would have ended it
    assert text == story or full["choices"][0]["finish_reason"] == "stop"
    offline = LLM("stories260K", num_blocks=64, device="cpu").generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=60, stop=[stop], min_tokens=20),
        use_tqdm=False)[0].outputs[0]
    assert offline.text == text
    assert len(offline.token_ids) >= 20
    if full["choices"][0]["finish_reason"] == "stop":
        assert full["choices"][0]["stop_reason"] == stop


def test_streamed_text_equals_full_text_over_many_seeds(server):
    rng = random.Random(7)
    prompts = ["Once upon a time", "Tom had a big red ball", "The cat saw a bird", "Lily was"]

    async def one(client, i):
        body = {"prompt": rng.choice(prompts), "max_tokens": rng.randint(5, 50),
                "temperature": 1.0, "seed": 1000 + i, "min_tokens": rng.randint(0, 5),
                "stop": rng.choice([[], ["."], ["the", "."], [" was a"]])}
        full = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        text, finish = "", None
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        text += c["text"]
                        finish = c["finish_reason"] or finish
        return body, full, text, finish

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(40)))

    for body, full, streamed, finish in asyncio.run(run()):
        assert streamed == full["text"], body
        assert finish == full["finish_reason"]
        if body["min_tokens"] == 0:  # (text before min_tokens may hold a stop string)
            for stop in body["stop"]:
                assert stop not in full["text"]
    server.wait_idle()


# --- slow requests do not stall the others -----------------------------------------------------
def test_body_limit_and_huge_prompts(server):
    big = json.dumps({"prompt": "a " * (BODY_LIMIT // 2 + 10), "max_tokens": 4}).encode()
    r = server.raw_post("/v1/completions", big)
    assert r.status_code == 413 and "max-request-body-bytes" in r.json()["error"]["message"]
    # under the body limit, but far more text than max_model_len tokens can hold: refused at
    # once, before anything tokenizes it
    r = server.post("/v1/completions", {"prompt": "word " * 150_000, "max_tokens": 4})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_heavy_chat_template_does_not_hold_health(server):
    heavy = ("{% set ns = namespace(x=0) %}{% for i in range(6000) %}{% for j in range(100) %}"
             "{% set ns.x = ns.x + j %}{% endfor %}{% endfor %}" + TEMPLATE)  # ~2 s of Jinja
    done = threading.Event()
    result = {}

    def slow():
        result["r"] = server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "chat_template": heavy}, timeout=120)
        done.set()

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.3)
    answered_while_rendering = 0
    while not done.is_set():
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        answered_while_rendering += not done.is_set()
        time.sleep(0.05)
    t.join()
    assert result["r"].status_code == 200, result["r"].text
    assert answered_while_rendering >= 3  # /health kept answering while the template rendered


# --- many streams, a small cache ---------------------------------------------------------------
def test_256_streams_with_preemption_lose_nothing(server, idle_text):
    rng = random.Random(3)
    prompts = ["Once upon a time", "Tom had a big red ball", "The cat saw a bird",
               "Lily and Tom were friends"]
    jobs = [(rng.choice(prompts), rng.randint(8, 48)) for _ in range(256)]
    expected = {(p, m): idle_text(m, p) for p, m in set(jobs)}
    before = server.metrics()

    async def one(client, prompt, max_tokens):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        text, done = "", False
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text += event["choices"][0]["text"]
        return text, done

    async def run():
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in jobs),
                                        return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(done for _, done in results)
    assert [text for text, _ in results] == [expected[j] for j in jobs]
    after = server.wait_idle()
    assert after["minipaged:num_preemptions_total"] > before["minipaged:num_preemptions_total"]
    assert after["minipaged:kv_cache_blocks_used"] == 0


# --- vLLM's extra endpoints -------------------------------------------------------------------
def test_tokenize_detokenize_version(server):
    r = server.post("/tokenize", {"prompt": PROMPT})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) and body["tokens"][0] == 1
    assert body["max_model_len"] == 512
    text = server.post("/detokenize", {"tokens": body["tokens"][1:]}).json()["prompt"]
    assert text == PROMPT
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": PROMPT}]}).json()
    assert chat["tokens"] == body["tokens"]  # the template glues "<s>" + " " + the message
    assert server.post("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert httpx.get(server.url + "/version").json()["version"]


# --- the process boundary ----------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_sigterm_drains_in_flight_requests_then_exits_0():
    s = ServeProcess("--num-blocks", "64", "--max-num-seqs", "1", "--shutdown-timeout", "1")
    try:
        results: dict = {}

        def long_stream(i):  # cannot finish within the drain timeout
            results[("stream", i)] = stream_text(
                s.url, {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}, timeout=60)

        def long_full(i):
            results[("full", i)] = s.post("/v1/completions", {
                "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}, timeout=60)

        threads = [threading.Thread(target=f, args=(i,)) for i in range(3)
                   for f in (long_stream, long_full)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while True:  # one runs, five wait: they cannot all finish in the 1 s drain
            m = s.metrics()
            if m["minipaged:num_requests_running"] + m["minipaged:num_requests_waiting"] >= 6:
                break
            assert time.time() < deadline
            time.sleep(0.05)
        core = _children(s.proc.pid)
        assert core, "the engine core should be a child process"
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # no longer accepting connections
            httpx.get(s.url + "/health", timeout=2)
        for t in threads:
            t.join(60)
        assert s.proc.wait(30) == 0, "".join(s.log)
        cut = 0
        for i in range(3):
            text, events, done = results[("stream", i)]
            assert done, "every stream ends with [DONE]"
            if "error" in events[-1]:
                assert "shutting down" in events[-1]["error"]["message"]
                cut += 1
            else:
                assert events[-1]["choices"][0]["finish_reason"] == "length"
            r = results[("full", i)]
            if r.status_code == 503:
                assert "shutting down" in r.json()["error"]["message"]
                cut += 1
            else:
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 480
        assert cut >= 3  # at most one seat's worth finished inside the drain
        time.sleep(0.5)
        assert all(not os.path.exists(f"/proc/{pid}") for pid in core), "the core is gone too"
    finally:
        s.stop()


def test_a_dead_engine_core_is_503_not_a_hang():
    s = ServeProcess("--num-blocks", "32")
    try:
        (core,) = _children(s.proc.pid)
        os.kill(core, signal.SIGKILL)
        deadline = time.time() + 10
        while httpx.get(s.url + "/health").status_code == 200:
            assert time.time() < deadline
            time.sleep(0.1)
        r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_the_engine_core_exits_when_the_api_server_dies():
    s = ServeProcess("--num-blocks", "32")
    (core,) = _children(s.proc.pid)
    s.proc.kill()  # SIGKILL: no shutdown handler runs, nobody tells the core
    s.proc.wait(10)
    deadline = time.time() + 15
    while os.path.exists(f"/proc/{core}") and open(f"/proc/{core}/stat").read().split()[2] != "Z":
        assert time.time() < deadline, "the engine core outlived its API server"
        time.sleep(0.1)
