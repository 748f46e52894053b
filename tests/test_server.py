"""The OpenAI-compatible server (minipaged/server/, lesson 07) through the official `openai` client.

A real uvicorn serves stories260K on 127.0.0.1 (a free port) in a background thread, built from
`minipaged serve` arguments, with the engine core in a thread of this process (the same sockets
and messages as the real process), so the tests can look inside its engine (block manager,
scheduler) as well as at /metrics. tests/test_server_robustness.py runs `minipaged serve` itself.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from minipaged.cli.serve import load_chat_template, main, parse_args
from minipaged.lessons.server import InProcessServer
from minipaged.server.metrics import parse_metrics
from minipaged.server.reasoning import get_reasoning_parser

KEY = "test-key"
# stories260K is a base model without a chat template: this one just glues the messages together
# ("<s> Once upon a time": the space makes sentencepiece produce "▁Once", as for a plain prompt).
TEMPLATE = "{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
PROMPT = "Once upon a time"


class ServerThread(InProcessServer):
    """`minipaged serve ARGS` inside this process (uvicorn in a daemon thread, the lessons'
    InProcessServer), with the engine core's engine in reach for the tests."""

    @property
    def engine(self):  # the LLMEngine inside the engine core
        return self.app.state.llm.client.core.engine

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine has no requests and every KV block is free again."""
        eng, deadline = self.engine, time.time() + timeout
        while True:
            idle = (not eng.has_unfinished_requests() and not self.app.state.llm.requests
                    and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks)
            if idle or time.time() > deadline:
                break
            time.sleep(0.02)
        assert idle, (f"not idle: {eng.get_num_unfinished_requests()} requests, "
                      f"{eng.block_manager.num_blocks - eng.block_manager.num_free_blocks} blocks used")



@pytest.fixture(scope="module")
def server():
    s = ServerThread("stories260K", "--num-blocks", "512", "--max-num-seqs", "32", "--api_key", KEY,
                     "--chat-template", TEMPLATE, "--device", "cpu", "--uvicorn-log-level", "warning")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    from minipaged import LLM
    return LLM("stories260K", num_blocks=64, device="cpu")


# --- the basics --------------------------------------------------------------------------------
def test_list_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["stories260K"]
    assert models[0].model_extra["max_model_len"] == server.engine.config.max_model_len == 512


def test_greedy_completion_equals_offline_llm(client, offline):
    from minipaged import SamplingParams
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40),
                                use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 40, 45)
    # token ids work as the prompt too ([1, 403, 407, 261, 378] is "<s> Once upon a time")
    r2 = client.completions.create(model="stories260K", prompt=[1, 403, 407, 261, 378],
                                   max_tokens=40, temperature=0)
    assert r2.choices[0].text == expected.text


def test_chat_through_template(client):
    # The template renders "<s>Once upon a time": the same tokens as the completion prompt.
    r = client.chat.completions.create(model="stories260K", temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": PROMPT}])
    c = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == c.choices[0].text
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 20


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30,
                                     temperature=0).choices[0].text
    chunks = list(client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert len(text_chunks) == 30  # one event per generated token
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 30

    chat = list(client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": PROMPT}], max_tokens=30,
        temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == full
    assert chat[-1].choices[0].finish_reason == "length"


def test_streaming_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions",
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) == 4


def test_n_and_seed(client, server):
    def sample(**kw):
        r = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=16,
                                      temperature=1.0, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    server.wait_idle()
    first_step = len(server.engine.trace)  # (the module's server keeps every step)
    a = sample(n=3, seed=7)
    assert len(a) == 3 and len(set(a)) > 1  # seeds 7, 8, 9: different samples
    # one engine request with n = 3: its prompt is prefilled once and the samples share it
    steps = list(server.engine.trace)[first_step:]
    prefilled = sum(e.num_prefill_tokens + e.num_cached_tokens for r in steps for e in r.scheduled)
    assert prefilled == len(server.engine.tokenize(PROMPT))  # (computed or found in the cache)
    assert max(r.num_blocks_saved_by_sharing for r in steps) > 0
    assert sample(n=3, seed=7) == a  # ... and reproducible
    assert sample(seed=8) == [a[1]]  # choice i of seed s is request seed s + i
    # a list of prompts times n: choice index = prompt index * n + sample index
    r = client.completions.create(model="stories260K", prompt=[PROMPT, "Tom had a big red ball"],
                                  n=2, max_tokens=8, temperature=0)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] == texts[1] != texts[2] == texts[3]
    assert texts[0] == ", there was a little girl"
    n_tom = len(server.engine.tokenize("Tom had a big red ball"))
    assert r.usage.prompt_tokens == 5 + n_tom  # each prompt counts once, however many samples
    assert r.usage.completion_tokens == 4 * 8
    # n > 1 while streaming: every choice index appears and finishes
    chunks = list(client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": PROMPT}], n=2, seed=1,
        max_tokens=8, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_sampling_fields_reach_the_engine(client):
    greedy = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20,
                                       temperature=0).choices[0].text
    top1 = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20,
                                     temperature=1.5, extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # top_k=1 leaves only the argmax
    # greedy text has " girl" in it (", there was a little girl named Lily...")
    stopped = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=[" girl"]).choices[0]
    assert stopped.finish_reason == "stop" and greedy.startswith(stopped.text)
    assert " girl" not in stopped.text and stopped.text.endswith("little")
    streamed = list(client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40,
                                              temperature=0, stop=[" girl"], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == stopped.text
    # repetition / presence / frequency penalties change the greedy continuation
    penalised = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0, frequency_penalty=2.0,
        presence_penalty=1.0, extra_body={"repetition_penalty": 1.5}).choices[0].text
    assert penalised != greedy
    # logprobs: one entry per token, the tokens spell the text
    r = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=10,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 10
    assert all(len(t) >= 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="stories260K", temperature=0, max_tokens=5,
                                          messages=[{"role": "user", "content": PROMPT}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)


# --- errors --------------------------------------------------------------------------------------
def test_api_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # open, no key


def test_errors_in_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories260K", prompt=[300] * 600, max_tokens=5)
    msg = e.value.body["message"]
    assert "600" in msg and "512" in msg and "max_model_len" in msg

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories260K", prompt=[300] * 500, max_tokens=20)
    assert "520" in e.value.body["message"] and "at most 12" in e.value.body["message"]

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories260K", prompt=PROMPT, temperature=-1)
    assert e.value.body["param"] == "temperature"

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                   json={"messages": "hello"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}

    # none of that disturbed the engine
    server.wait_idle()
    assert client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=3,
                                     temperature=0).choices[0].text == ", there was"


# --- disconnects and load ------------------------------------------------------------------------
@pytest.fixture
def slow_engine(server, monkeypatch):
    """Every step takes >= 10 ms, so a 500-token request needs >= 5 s: a disconnect after a few
    tokens cannot lose the race against the request simply finishing."""
    step = server.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    server.wait_idle()
    monkeypatch.setattr(server.engine, "step", slow_step)
    return server


ABORTED = 'minipaged:request_success_total{finished_reason="abort"}'


def test_disconnect_mid_stream_frees_blocks(slow_engine):
    server = slow_engine
    before = server.metrics()
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # three events and their blank lines
        assert got[0].startswith("data: ")
        eng = server.engine
        assert eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    # the connection is closed here, long before 500 tokens
    server.wait_idle()
    m = server.metrics()
    assert m["minipaged:kv_cache_blocks_used"] == 0 and m["minipaged:num_requests_running"] == 0
    assert m.get(ABORTED) == before.get(ABORTED, 0) + 1
    assert m["minipaged:generation_tokens_total"] - before["minipaged:generation_tokens_total"] < 100


def test_disconnect_while_waiting_for_a_full_response(slow_engine):
    server = slow_engine
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(10.0, read=0.3),
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True})
    server.wait_idle()
    assert server.metrics()[ABORTED] == before.get(ABORTED, 0) + 1


def test_128_concurrent_streams(server):
    server.wait_idle()
    before = server.metrics()
    rng = random.Random(0)
    jobs = [(rng.choice(["Once upon a time", "Tom had a big red ball", "The cat saw a bird",
                         "Lily and Tom were friends"]), rng.randint(4, 24)) for _ in range(128)]

    async def one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(
            model="stories260K", prompt=prompt, max_tokens=max_tokens, temperature=0.8,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return usage.completion_tokens, finish

    async def burst():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                      max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, p, m) for p, m in jobs),
                                        return_exceptions=True)

    first_step = server.engine.num_steps
    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert [r[0] for r in results] == [m for _, m in jobs]
    assert all(r[1] == "length" for r in results)
    server.wait_idle()
    after = server.metrics()
    assert after["minipaged:generation_tokens_total"] - before["minipaged:generation_tokens_total"] \
        == sum(m for _, m in jobs)
    assert after["minipaged:kv_cache_blocks_used"] == 0
    assert after["minipaged:time_to_first_token_seconds_count"] >= 128
    # --max-num-seqs 32: never more than 32 sequences in a step; the rest queued
    steps = [r for r in server.engine.trace if r.step >= first_step]
    assert max(r.num_running for r in steps) == 32
    assert max(r.num_waiting for r in steps) > 0


def test_engine_crash_fails_its_requests():
    """A step that raises (a bug, not a request's fault) stops the core: what was running fails
    with EngineDeadError, later requests are refused at once, /health would say 503."""
    from minipaged import EngineConfig, SamplingParams
    from minipaged.server.async_llm import AsyncLLM, EngineDeadError
    llm = AsyncLLM(EngineConfig(num_blocks=32, device="cpu"), in_process=True)

    def broken_step():
        raise RuntimeError("boom")

    llm.client.core.engine.step = broken_step

    async def run():
        llm.start()
        stream = await llm.generate([PROMPT], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):  # later requests are refused at once
            await llm.generate([PROMPT], SamplingParams(max_tokens=4))

    try:
        asyncio.run(run())
        assert not llm.is_running
    finally:
        llm.shutdown()


def test_prompt_preprocessing_has_a_time_bound(server, monkeypatch):
    """A chat template that renders for longer than the bound is a 400, not a stuck request."""
    monkeypatch.setattr(server.app.state.llm, "preprocess_timeout", 0.2)
    heavy = ("{% set ns = namespace(x=0) %}{% for i in range(6000) %}{% for j in range(100) %}"
             "{% set ns.x = ns.x + j %}{% endfor %}{% endfor %}" + TEMPLATE)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                         "chat_template": heavy})
    assert r.status_code == 400, r.text
    assert "took longer than 0.2 s" in r.json()["error"]["message"]
    server.wait_idle()


def test_metrics_and_health(server):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = parse_metrics(r.text)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count"):
        assert "minipaged:" + name in m
    assert m["minipaged:kv_cache_blocks_total"] == 512
    assert m["minipaged:generation_tokens_total"] > 0


def test_docs_and_openapi(server):
    import re
    for page, marker in (("/docs", "swagger"), ("/redoc", "redoc")):
        r = httpx.get(server.url + page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        assert marker in r.text.lower()
        # every script and stylesheet comes from this server (no CDN): the page works offline
        assets = re.findall(r"""(?:src|href)=["']([^"']+\.(?:js|css))["']""", r.text)
        assert assets, r.text
        for url in assets:
            assert url.startswith("/"), f"{page} loads {url} from elsewhere"
            asset = httpx.get(server.url + url)
            assert asset.status_code == 200 and len(asset.content) > 10_000
    schema = httpx.get(server.url + "/openapi.json").json()
    paths = schema["paths"]
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health",
            "/metrics", "/tokenize", "/detokenize", "/version"} <= set(paths)
    # it documents what the server answers: 400 with OpenAI's error shape, never FastAPI's 422
    assert '"422"' not in json.dumps(schema)
    bad = paths["/v1/completions"]["post"]["responses"]["400"]
    assert bad["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_docs_render_in_headless_chromium(server):
    """Swagger UI draws its operations with JavaScript: only a browser shows that the page works
    offline (every request beyond this machine fails in `browser.render`)."""
    from browser import render, script_errors
    dom, console = render(server.url + "/docs")
    assert "/v1/completions" in dom and "/v1/chat/completions" in dom, console
    assert not script_errors(console), console
    dom, console = render(server.url + "/redoc")
    assert "/v1/completions" in dom, console


def test_reasoning_parser_rules():
    r1, qwen3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
    # R1's template opens <think> in the prompt: the output starts inside the reasoning
    assert r1().extract("thinking...</think>answer") == ("thinking...", "answer")
    assert r1().extract("ran out of tokens while thinking") == ("ran out of tokens while thinking", None)
    assert qwen3().extract("no thinking here") == (None, "no thinking here")
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


def test_reasoning_server_and_missing_template():
    s = ServerThread("stories260K", "--num-blocks", "64", "--reasoning-parser", "deepseek_r1",
                     "--served-model-name", "tiny", "--device", "cpu",
                     "--uvicorn-log-level", "warning")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        with pytest.raises(openai.BadRequestError) as e:  # stories260K has no chat template
            client.chat.completions.create(model="tiny", messages=messages)
        assert "chat template" in e.value.body["message"]
        assert "--chat-template" in e.value.body["message"]
        # a template in the request works; no </think> in a story, so R1 calls it all reasoning
        kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
                  extra_body={"chat_template": TEMPLATE})
        msg = client.chat.completions.create(**kw).choices[0].message
        assert msg.content is None and msg.model_extra["reasoning_content"].startswith(", there was")
        chunks = list(client.chat.completions.create(stream=True, **kw))
        streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                           for c in chunks)
        assert streamed == msg.model_extra["reasoning_content"]
    finally:
        s.stop()


# --- the command line -----------------------------------------------------------------------------
def test_cli_flags_and_teaching_errors(tmp_path, capsys):
    a = parse_args(["stories260K", "--max_model_len", "256", "--api_key", "k", "--served_model_name",
                    "a", "b", "--no-enable-prefix-caching", "--tensor_parallel_size", "2",
                    "--trust_remote_code", "--host", "0.0.0.0"])
    assert (a.max_model_len, a.api_key, a.served_model_name) == (256, "k", ["a", "b"])
    assert a.enable_prefix_caching is False and a.tensor_parallel_size == 2 and a.host == "0.0.0.0"
    assert parse_args([]).host == "127.0.0.1" and parse_args([]).model == "stories260K"
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("missing.jinja")
    # the deployment note's failure: max_model_len above max_position_embeddings (exit status 2,
    # one line; tests/test_cli.py checks the other teaching errors of every command)
    assert main(["stories260K", "--max-model-len", "4096", "--device", "cpu", "--port", "0",
                 "--trust-remote-code"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("note: --trust-remote-code") and len(err) == 2
    assert err[1].startswith("error: ") and "4096" in err[1] and "512" in err[1]
    # a KV cache too small for one max_model_len sequence
    assert main(["stories260K", "--num-blocks", "8", "--device", "cpu", "--port", "0"]) == 2
    assert "largest max_model_len that fits is 128" in capsys.readouterr().err
