"""Structured outputs and tool calling through the real server (lesson 12): the openai client
against `minipaged serve stories260K` (in-process, tests/test_server.py's ServerThread), streamed
and whole; bad constraints are a 400 naming the field and the server keeps serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from minipaged.server.tool_parsers import HermesToolParser, StreamingToolCalls
from tests.test_server import ServerThread

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
# stories260K has no chat template: a small one that shows the tools, as real templates do
TEMPLATE = ("{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n"
            "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MSG = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def server():
    s = ServerThread("stories260K", "--device", "cpu", "--block-size", "8", "--num-blocks", "512",
                     "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _stream_text(stream) -> tuple[str, str]:
    text, reason = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += getattr(ch, "text", None) or (getattr(ch, "delta", None) and
                                                   ch.delta.content) or ""
            reason = ch.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format_and_guided_fields(client, stream):
    cases = [({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON}}},
              lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ({"guided_regex": r"[A-Z][a-z]{1,8} is \d{1,2}\."},
              lambda t: re.fullmatch(r"[A-Z][a-z]{1,8} is \d{1,2}\.", t) or 1 / 0),
             ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no") or 1 / 0),
             ({"structured_outputs": {"regex": "(cat|dog)s?"}},
              lambda t: re.fullmatch("(cat|dog)s?", t) or 1 / 0),
             ({"guided_grammar": 'root ::= "Lily " ("ran" | "sat" | "saw " [a-z]+) "."'},
              lambda t: re.fullmatch(r"Lily (ran|sat|saw [a-z]+)\.", t) or 1 / 0)]
    for extra, check in cases:
        kw = dict(model="stories260K", prompt="Once upon a time", max_tokens=200, temperature=0.7,
                  seed=1, n=2, extra_body=extra)
        if stream:
            # n=2 interleaves two choices' chunks: one choice per request here
            text, reason = _stream_text(client.completions.create(**(kw | {"n": 1}),
                                                                  stream=True))
            texts, reasons = [text], [reason]
        else:
            resp = client.completions.create(**kw)
            texts = [c.text for c in resp.choices]
            reasons = [c.finish_reason for c in resp.choices]
        for t, r in zip(texts, reasons):
            assert r == "stop", (extra, t)
            check(t)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_object_and_schema(client, stream):
    for rf in ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
               {"type": "json_object"}):
        kw = dict(model="stories260K", messages=MSG, max_tokens=300, temperature=0,
                  response_format=rf)
        if rf["type"] == "json_object":  # an open object: keep it small
            kw["extra_body"] = {"structured_outputs": None}
            kw["max_tokens"] = 40
        if stream:
            text, reason = _stream_text(client.chat.completions.create(**kw, stream=True))
        else:
            ch = client.chat.completions.create(**kw).choices[0]
            text, reason = ch.message.content, ch.finish_reason
        assert text.lstrip().startswith("{")
        if rf["type"] == "json_schema":
            assert reason == "stop"
            jsonschema.validate(json.loads(text), PERSON)


BAD = [
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": {"type": "objekt"}}, "guided_json"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ("/v1/completions", {"guided_regex": "a" * 70000}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": 'root ::= "' + "a" * 70000 + '"'}, "guided_grammar"),
    ("/v1/completions", {"guided_json": {"enum": ["a" * 70000]}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"tools": TOOLS,
                              "tool_choice": {"type": "function",
                                              "function": {"name": "launch_rocket"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
]


def test_bad_constraints_are_400_naming_the_field_and_the_server_keeps_serving(server):
    for path, extra, param in BAD:
        body = {"model": "stories260K", "max_tokens": 4} | extra
        body |= {"messages": MSG} if "chat" in path else {"prompt": "Once"}
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (extra, err)
        r = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8,
            "guided_choice": ["fine", "good"]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("fine", "good")
    server.wait_idle()


def _check_call(call, tools=TOOLS):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.function.name in schema
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_forced_tool_calls_always_parse(client):
    for seed in range(3):
        named = client.chat.completions.create(
            model="stories260K", messages=MSG, max_tokens=200, temperature=1.0, seed=seed,
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        ch = named.choices[0]
        assert ch.finish_reason == "stop" and ch.message.content is None
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)
        req = client.chat.completions.create(
            model="stories260K", messages=MSG, max_tokens=300, temperature=1.0, seed=seed,
            tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        ch = req.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            _check_call(call)


def _reassemble(stream) -> tuple[list[dict], str, str]:
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function.name:
                    c["name"] = d.function.name
                c["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, reason


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client, tool_choice):
    choice = ({"type": "function", "function": {"name": "get_weather"}}
              if tool_choice == "named" else "required")
    kw = dict(model="stories260K", messages=MSG, max_tokens=300, temperature=0, tools=TOOLS,
              tool_choice=choice, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, content, reason = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        (c["name"], c["arguments"]) for c in calls]
    assert reason == ("stop" if tool_choice == "named" else "tool_calls")


def test_a_required_call_cut_short_streams_as_the_whole_reply_reads(client):
    """max_tokens ends a forced "required" list before it parses: no tool_calls, the text as
    content, finish_reason "length", streamed or not."""
    kw = dict(model="stories260K", messages=MSG, max_tokens=6, temperature=0, tools=TOOLS,
              tool_choice="required")
    whole = client.chat.completions.create(**kw).choices[0]
    calls, content, reason = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert whole.finish_reason == reason == "length" and not whole.message.tool_calls
    assert not calls and content == whole.message.content and content.startswith("[")


HERMES = (r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}'
          r'</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_the_hermes_parser(client, stream):
    # stories260K never writes <tool_call> by itself: a regex makes it write one, and the
    # hermes parser has to find it in the text.
    kw = dict(model="stories260K", messages=MSG, max_tokens=200, temperature=0.5, seed=0,
              tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": HERMES})
    if stream:
        calls, content, reason = _reassemble(client.chat.completions.create(**kw, stream=True))
        whole = client.chat.completions.create(**kw).choices[0].message  # the same, seeded
        assert [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.tool_calls] == calls
        assert whole.content.strip() == content.strip()
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        content, reason = ch.message.content, ch.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in ch.message.tool_calls]
    assert reason == "tool_calls"
    assert content.strip() == "Sure."
    (call,) = calls
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "CET")
    # "none": the same text stays content
    ch = client.chat.completions.create(**(kw | {"tool_choice": "none"})).choices[0]
    assert ch.message.tool_calls is None and "<tool_call>" in ch.message.content


def test_hermes_parser_units():
    p = HermesToolParser()
    text = ('Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = p.extract(text)
    assert content == "Hi " and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert p.extract("no calls") == ("no calls", [])
    assert p.extract("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    s = StreamingToolCalls(p)
    out, got = "", []
    for piece in [text[i:i + 3] for i in range(0, len(text), 3)]:
        c, calls = s.feed(piece)
        out, got = out + c, got + calls
    c, calls = s.finish()
    out, got = out + c, got + calls
    assert out == "Hi " and [c["function"]["name"] for c in got] == ["f", "g"]
    assert [c["index"] for c in got] == [0, 1]
    s = StreamingToolCalls(p)  # a "<" that is not a call is sent once it is certain
    assert s.feed("a <to") == ("a ", [])
    assert s.feed("p") == ("<top", [])


def test_invalid_regex_cannot_take_the_two_process_server_down():
    """vLLM's server once died for everyone on one bad guided regex: here, a 400 for that
    request, and a real `minipaged serve` (API server + engine core processes) goes on."""
    from tests.test_server_robustness import ServeProcess
    srv = ServeProcess("--block-size", "8", "--num-blocks", "256")
    try:
        for bad in ["(unclosed", "[z-a]", "\\", "a{2,1}", "(?<=x)y"]:
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": "stories260K", "prompt": "Once", "max_tokens": 4, "guided_regex": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": ["Once upon a time", "Lily"], "max_tokens": 100,
            "guided_regex": r"(Lily|Tom) (ran|sat)\."})
        assert r.status_code == 200
        assert all(re.fullmatch(r"(Lily|Tom) (ran|sat)\.", c["text"]) for c in r.json()["choices"])
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert srv.proc.poll() is None
    finally:
        srv.stop()
