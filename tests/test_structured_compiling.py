"""Grammars compiled off the engine's thread (minipaged/structured_output/compiling.py, lesson
12): a request whose grammar takes long to compile waits alone; the others keep being served;
a compile that fails later fails its request alone; an aborted one leaves the queue.

A real slow spec takes seconds to minutes (the module's docstring), so here the compile of one
spec is made to wait for the test (`gate`): the test decides when it ends, and nothing is timed.
"""
import threading
import time

import httpx
import pytest

from minipaged import LLM, SamplingParams
from minipaged.structured_output import StructuredOutputsParams as SO
from minipaged.structured_output import compiling
from minipaged.structured_output.manager import RequestGrammarError, StructuredOutputManager

SLOW = SO(choice=["slow one", "slow two"])
LATE = SO(choice=["late one"])


@pytest.fixture
def gates(monkeypatch):
    """spec -> threading.Event: compiles of those specs wait until the test sets the event,
    then fail with `event.error` if it is set (else compile as usual); other specs compile as
    usual. SLOW and LATE are gated from the start."""
    gates = {}
    for so in (SLOW, LATE):
        gates[so.spec] = threading.Event()
        gates[so.spec].error = None
    compile_uncached = StructuredOutputManager.compile_uncached

    def gated(self, params):
        gate = gates.get(params.spec)
        if gate is not None:
            assert gate.wait(timeout=60)
            if gate.error is not None:
                raise gate.error
        return compile_uncached(self, params)
    monkeypatch.setattr(StructuredOutputManager, "compile_uncached", gated)
    return gates


@pytest.fixture
def gate(gates):
    return gates[SLOW.spec]


def _engine(async_scheduling):
    return LLM("stories260K", block_size=8, num_blocks=256, seed=0,
               async_scheduling=async_scheduling).engine


def _run(eng, until=None):
    """Step until nothing is left (or `until(outs)`); request id -> its last RequestOutput."""
    outs = {}
    while eng.has_unfinished_requests() and not (until and until(outs)):
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_slow_compile_holds_only_its_own_request(gate, async_scheduling):
    eng = _engine(async_scheduling)
    fast = SO(choice=["yes", "no"])
    eng.add_request("slow", "Once upon a time", SamplingParams(temperature=0, max_tokens=20,
                                                               structured_outputs=SLOW))
    eng.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=12))
    eng.add_request("fast", "The cat", SamplingParams(temperature=0, max_tokens=20,
                                                      structured_outputs=fast))
    # a second request for the same slow spec joins its compile
    eng.add_request("slow2", "The cat", SamplingParams(temperature=0, max_tokens=20,
                                                       structured_outputs=SLOW))
    outs = _run(eng, until=lambda outs: {"free", "fast"} <= outs.keys())
    assert outs["free"].outputs[0].finish_reason == "length"
    assert outs["fast"].outputs[0].text in ("yes", "no")
    assert set(eng.grammar_compiles.waiting) == {"slow", "slow2"}
    assert eng.has_unfinished_requests()
    gate.set()
    outs = _run(eng)
    assert {outs[r].outputs[0].text for r in ("slow", "slow2")} <= set(SLOW.choice)
    assert outs["slow"].outputs[0].finish_reason == "stop" and not eng.grammar_compiles.waiting
    # compiled once, now cached: a new request for it is queued at once
    eng.add_request("again", "Once", SamplingParams(temperature=0, max_tokens=20,
                                                    structured_outputs=SLOW))
    assert not eng.grammar_compiles.waiting
    assert _run(eng)["again"].outputs[0].text in SLOW.choice


def test_a_compile_that_fails_later_fails_its_request_alone(gate, monkeypatch):
    eng = _engine(False)
    eng.add_request("slow", "Once upon a time", SamplingParams(max_tokens=20,
                                                               structured_outputs=SLOW))
    eng.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=12))
    eng.step()
    gate.error = RequestGrammarError("structured_outputs.choice cannot be compiled: too big")
    gate.set()
    outs = _run(eng)
    assert outs["slow"].outputs[0].finish_reason == "error"
    assert "structured_outputs.choice cannot be compiled: too big" in outs["slow"].error
    free = outs["free"].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    # the refusal is not cached as a success: a new request for it compiles (and fails) again,
    # here within add_request (given the time: the worker thread must start and answer)
    monkeypatch.setattr(compiling, "QUICK_S", 30.0)
    with pytest.raises(ValueError, match="cannot be compiled: too big"):
        eng.add_request("again", "Once", SamplingParams(max_tokens=5, structured_outputs=SLOW))


def test_an_aborted_request_stops_waiting_for_its_grammar(gate):
    eng = _engine(False)
    eng.add_request("slow", "Once upon a time", SamplingParams(max_tokens=20,
                                                               structured_outputs=SLOW))
    assert eng.has_unfinished_requests() and eng.get_num_unfinished_requests() == 1
    eng.abort_request("slow")
    assert not eng.has_unfinished_requests() and eng.get_num_unfinished_requests() == 0
    gate.set()
    eng.add_request("next", "Once", SamplingParams(temperature=0, max_tokens=4))
    assert list(_run(eng)) == ["next"]


def test_through_the_server_a_slow_compile_waits_alone(gates):
    """The same through `minipaged serve`: while one request waits for its grammar, others are
    served (and it counts as waiting); it is answered once its grammar is ready; a compile
    refused late fails its request alone (500, naming the library's message), and the server
    goes on."""
    from tests.test_server import ServerThread
    s = ServerThread("stories260K", "--device", "cpu", "--block-size", "8", "--num-blocks",
                     "256", "--uvicorn-log-level", "warning")
    replies = {}

    def post(name, choice):
        replies[name] = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 20,
            "temperature": 0, "guided_choice": choice})

    def held(n):
        deadline = time.time() + 30
        while len(s.engine.grammar_compiles.waiting) < n and time.time() < deadline:
            time.sleep(0.01)
        return len(s.engine.grammar_compiles.waiting) == n
    try:
        waits = [threading.Thread(target=post, args=(name, so.choice))
                 for name, so in (("slow", SLOW), ("late", LATE))]
        for t in waits:
            t.start()
        assert held(2)
        plain = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 8
        assert s.metrics()["minipaged:num_requests_waiting"] == 2 and held(2)
        gates[SLOW.spec].set()
        waits[0].join(60)
        assert replies["slow"].status_code == 200
        assert replies["slow"].json()["choices"][0]["text"] in SLOW.choice
        gates[LATE.spec].error = RequestGrammarError(
            "structured_outputs.choice cannot be compiled: too big")
        gates[LATE.spec].set()
        waits[1].join(60)
        assert replies["late"].status_code == 500
        assert "cannot be compiled: too big" in replies["late"].json()["error"]["message"]
        again = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "model": "stories260K", "prompt": "Once", "max_tokens": 20,
            "guided_choice": SLOW.choice})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] in SLOW.choice
        s.wait_idle()
    finally:
        for gate in gates.values():
            gate.set()
        s.stop()
