"""Structured outputs (minipaged/structured_output/, lesson 12): stories260K, which knows nothing
of JSON, writes output that parses and validates, because a grammar masks its logits each step.

Every constrained output below must be *complete* (finish_reason "stop", the grammar reached its
end) and valid: the masks allow nothing else, so a failure here is a bug in the masks, in the
matcher's state (advanced with each token, rebuilt after preemption, one per forked sample), or
in a constrained row leaking into an unconstrained one.
"""
import json
import re

import jsonschema
import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.engine.processor import RequestError
from minipaged.structured_output import StructuredOutputsParams as SO

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["cat", "dog", "fish"]}}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["story", "score"],
          "properties": {
              "story": {"type": "object", "additionalProperties": False,
                        "required": ["hero", "friends"],
                        "properties": {"hero": {"type": "string", "maxLength": 10},
                                       "friends": {"type": "array", "minItems": 1, "maxItems": 2,
                                                   "items": {"type": "object",
                                                             "additionalProperties": False,
                                                             "required": ["name"],
                                                             "properties": {"name": {
                                                                 "type": "string",
                                                                 "maxLength": 8}}}}}},
              "score": {"type": "number", "minimum": -5, "maximum": 5},
              "mood": {"enum": ["happy", "sad", 3, None]}}}
FLAGS = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
         "properties": {"ok": {"type": "boolean"},
                        "n": {"type": "integer", "minimum": 1, "maximum": 9}}}
SCHEMAS = [PERSON, NESTED, FLAGS]
REGEX = r"[A-Z][a-z]{1,8} is \d{1,2} years old\."
CHOICES = ["yes", "no", "the cat sat"]
PROMPTS = ["Once upon a time", "Lily went to the park", "The cat", "Tom had a big red ball"]


@pytest.fixture(scope="module")
def llm():
    return LLM("stories260K", block_size=8, num_blocks=256, seed=0)


def check_valid(so: SO, text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", (so.kind, text)
    if so.kind == "json":
        jsonschema.validate(json.loads(text), so.json)
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice
    else:
        raise AssertionError(so.kind)


def constraints():
    return ([SO(json=s) for s in SCHEMAS] + [SO(json=PERSON, disable_any_whitespace=True),
                                             SO(regex=REGEX), SO(choice=CHOICES)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_validate(llm, temperature):
    for so in constraints():
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=300,
                                structured_outputs=so)
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            c = out.outputs[0]
            check_valid(so, c.text, c.finish_reason)


def test_grammar_and_json_object(llm):
    so = SO(grammar='root ::= "Lily " ("ran" | "sat" | "saw " [a-z]+) "."')
    for out in llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=0, max_tokens=40,
                                                    structured_outputs=so), use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r"Lily (ran|sat|saw [a-z]+)\.", out.outputs[0].text)
    # Any object: stories260K fills it with pairs; whatever it wrote is a JSON object's start.
    so = SO(json_object=True, disable_any_whitespace=True)
    for out in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60,
                                                    structured_outputs=so), use_tqdm=False):
        c = out.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_at_its_end_finishes_the_request_without_a_stop_token(async_scheduling):
    """With ignore_eos a stop token ends nothing, so only the grammar's own end can: once its
    mask allows stop tokens only, the request finishes ("stop") with no EOS among its tokens."""
    llm = LLM("stories260K", block_size=8, seed=0, async_scheduling=async_scheduling)
    eos = llm.engine.tokenizer.eos_token_id
    for so in (SO(choice=CHOICES), SO(regex=REGEX), SO(json=FLAGS)):
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, seed=0, max_tokens=300,
                                    ignore_eos=True, structured_outputs=so)
            for out in llm.generate(PROMPTS, params, use_tqdm=False):
                c = out.outputs[0]
                check_valid(so, c.text, c.finish_reason)
                assert eos not in c.token_ids and len(c.token_ids) < 300


def test_json_object_ends_where_the_object_does(llm, monkeypatch):
    """stories260K never closes an object by itself (it writes pairs until max_tokens). Made to
    prefer, after a few tokens, the allowed tokens that close a string or an object, it ends
    exactly where the object does: the text is one whole JSON object."""
    tok = llm.engine.tokenizer
    texts = [tok.decode([t]) for t in range(llm.engine.model_config.vocab_size)]
    bias = torch.tensor([1e3 * ('"' in t) + 1e3 * ("}" in t) for t in texts])
    sampler = llm.engine.sampler
    sample = sampler.sample

    def closing(logits, seqs):
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens >= 6:
                logits[i] += bias.to(logits.dtype)  # (-inf, forbidden, stays -inf)
        return sample(logits, seqs)
    monkeypatch.setattr(sampler, "sample", closing)
    for ws in (True, False):
        so = SO(json_object=True, disable_any_whitespace=ws)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200,
                                                    structured_outputs=so), use_tqdm=False)
        for out in outs:
            check_valid(so, out.outputs[0].text, out.outputs[0].finish_reason)


def test_n_samples_each_valid_and_different(llm):
    so = SO(json=PERSON)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=300, structured_outputs=so)
    (out,) = llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        check_valid(so, c.text, c.finish_reason)
    assert len({c.text for c in out.outputs}) > 1  # each sample follows its own matcher


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=40)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    cons = [SamplingParams(temperature=0, max_tokens=300, structured_outputs=so)
            for so in constraints()[:len(PROMPTS)]]
    outs = llm.generate(PROMPTS + PROMPTS, [plain] * len(PROMPTS) + cons, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:len(PROMPTS)]] == alone
    for so, o in zip(constraints(), outs[len(PROMPTS):]):
        check_valid(so, o.outputs[0].text, o.outputs[0].finish_reason)


def _pressure_run(**cfg):
    llm = LLM("stories260K", block_size=8, max_model_len=256, max_num_batched_tokens=64,
              enable_prefix_caching=False, seed=0, **cfg)
    sos = constraints() * 2
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=so) for so in sos]
    params += [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * 4
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return sos, outs, llm.trace


@pytest.mark.parametrize("mode, async_scheduling", [("recompute", False), ("swap", False),
                                                     ("recompute", True)])
def test_preemption_keeps_the_grammar_state(mode, async_scheduling):
    _, ref, _ = _pressure_run(num_blocks=1024)
    sos, outs, trace = _pressure_run(num_blocks=40, preemption_mode=mode,
                                     async_scheduling=async_scheduling)
    assert sum(len(r.preempted) for r in trace) > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    for so, o in zip(sos, outs):
        check_valid(so, o.outputs[0].text, o.outputs[0].finish_reason)


def test_async_scheduling_gives_the_same_tokens_with_grammars():
    prompts = PROMPTS * 2
    params = ([SamplingParams(temperature=0, max_tokens=40)] * 4
              + [SamplingParams(temperature=0, max_tokens=300, structured_outputs=so)
                 for so in constraints()[:4]])
    res = []
    for flag in (False, True):
        llm = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=flag)
        res.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)])
    assert res[0] == res[1]


def test_async_scheduling_keeps_constrained_steps_in_flight():
    llm = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=True)
    eng = llm.engine
    for i, so in enumerate(constraints()[:4]):
        eng.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=300,
                                                           structured_outputs=so))
    in_flight = 0
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
        in_flight += eng.step_loop.pending is not None
    assert in_flight > 10  # steps whose tokens were read a step late, every row constrained
    done = {o.request_id: o.outputs[0] for o in outs if o.finished}
    for i, so in enumerate(constraints()[:4]):
        check_valid(so, done[str(i)].text, done[str(i)].finish_reason)


def test_a_finished_row_is_not_masked(llm):
    from minipaged.engine.sequence import Sequence, SequenceStatus
    mgr = llm.engine.structured_output
    params = SamplingParams(structured_outputs=SO(choice=CHOICES))
    ok, failed = (Sequence(request_id=r, prompt_token_ids=[1], sampling_params=params)
                  for r in ("ok", "failed"))
    failed.append_token(llm.engine.tokenizer.eos_token_id)  # one its grammar refuses first
    failed.status = SequenceStatus.FINISHED_ERROR
    assert mgr.fill_bitmask([failed, ok]) == [1]


@pytest.mark.parametrize("kw, match", [
    (dict(regex="(unclosed"), r"structured_outputs\.regex is not valid: .*parenthesis"),
    (dict(regex="[z-a]"), r"structured_outputs\.regex is not valid"),
    (dict(json={"type": "objekt"}), r"structured_outputs\.json is not valid: .*objekt"),
    (dict(json='{"type": "object"'), r"structured_outputs\.json must be a JSON schema"),
    (dict(json=[1, 2]), r"structured_outputs\.json must be a JSON schema"),
    (dict(json={"$ref": "#/definitions/nope"}), r"structured_outputs\.json is not valid"),
    (dict(grammar='root ::= undefined_rule'), r"structured_outputs\.grammar is not valid"),
    (dict(choice=[]), r"structured_outputs\.choice must be a non-empty list"),
    (dict(choice=["a", 3]), r"structured_outputs\.choice must be a non-empty list"),
    (dict(regex="a", choice=["a"]), r"exactly one of"),
    (dict(), r"exactly one of"),
    (dict(regex="a" * 70000), r"structured_outputs\.regex is too large"),
])
def test_bad_constraints_are_refused_at_entry(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=kw)
    if kw:
        with pytest.raises(ValueError, match=match):
            SO(**kw)


def test_a_spec_is_parsed_once_and_a_refused_one_refused_every_time(monkeypatch):
    """Validation remembers the last specs it parsed (a request is validated twice, and a server
    sees the same schemas again and again); a refused spec stays refused."""
    import xgrammar as xgr

    from minipaged.sampling import structured_outputs as so_params
    so_params._spec_error.cache_clear()  # (the test may run again in this process)
    calls = []
    parse = xgr.Grammar.from_json_schema

    def counted(*args, **kwargs):
        calls.append(args[0])
        return parse(*args, **kwargs)
    monkeypatch.setattr(xgr.Grammar, "from_json_schema", counted)
    schema = {"type": "object", "properties": {"cache_test": {"type": "integer"}}}
    for _ in range(3):
        SamplingParams(structured_outputs=SO(json=schema)).validate()
    assert len(calls) == 1
    other = dict(schema, required=["cache_test"])
    SamplingParams(structured_outputs=SO(json=other))
    assert len(calls) == 2  # another spec is parsed
    for _ in range(2):
        with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid: .*objekt"):
            SO(json={"type": "objekt", "cache_test": 1})
    assert len(calls) == 3


def test_bad_constraint_added_to_engine_fails_alone(llm, monkeypatch):
    from minipaged.structured_output import compiling
    monkeypatch.setattr(compiling, "QUICK_S", 30.0)  # refused within add_request, however slow
    eng = llm.engine
    good = SamplingParams(temperature=0, max_tokens=300, structured_outputs=SO(choice=CHOICES))
    eng.add_request("good", "Once upon a time", good)
    bad = SamplingParams(temperature=0, max_tokens=8)
    bad.structured_outputs = SO(regex="a")
    bad.structured_outputs.regex = "(a"  # changed after its check: the engine checks again
    with pytest.raises(RequestError, match=r"structured_outputs\.regex.*request 'bad'"):
        eng.add_request("bad", "Once upon a time", bad)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["good"]
    assert outs[-1].outputs[0].text in CHOICES


def test_a_dict_crosses_like_the_server_sends_it():
    import dataclasses
    p = SamplingParams(structured_outputs=SO(json=PERSON))
    again = SamplingParams(**dataclasses.asdict(p))
    assert again.structured_outputs == p.structured_outputs
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"jsn": {}})
