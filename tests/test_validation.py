"""Validation as a contract (validation.py): every field is checked where it enters.

Property tests generate, for every field of `SamplingParams`, `BeamSearchParams` and
`EngineConfig`, values of the wrong type, NaN / infinities and out-of-range numbers (each must
raise a ValueError that starts with the field's name and shows the value), and values in range
(each must be accepted). Then each poison that used to reach the step goes through
`LLM.generate`: it must be refused with a clear error, and the same `LLM` must afterwards serve
a normal request with its usual greedy text and every KV block free.
"""
from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minipaged import LLM, BeamSearchParams, EngineConfig, RequestError, SamplingParams
from minipaged.config import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, PREEMPTION_MODES,
                              SCHEDULING_POLICIES)
from minipaged.config import QUANTIZATION_METHODS, USAGE_CONTEXTS
from minipaged.validation import INT32_MAX, SEED_MAX, SEED_MIN

PROPS = settings(max_examples=40, deadline=None)
BIG = 10**30


# --- strategies -------------------------------------------------------------------------------
def ints(lo=None, hi=None):
    return st.integers(min_value=lo, max_value=hi)


def reals(lo=None, hi=None, *, lo_open=False, hi_open=False):
    """Finite floats in the range, and ints that lie inside it."""
    floats = st.floats(lo, hi, exclude_min=lo_open and lo is not None,
                       exclude_max=hi_open and hi is not None, allow_nan=False,
                       allow_infinity=False)
    int_lo = None if lo is None else math.floor(lo) + 1 if lo_open else math.ceil(lo)
    int_hi = None if hi is None else math.ceil(hi) - 1 if hi_open else math.floor(hi)
    if int_lo is not None and int_hi is not None and int_lo > int_hi:
        return floats
    return floats | ints(int_lo, int_hi)


NOT_NUMBERS = st.booleans() | st.text(max_size=5) | st.lists(ints(0, 3), max_size=2)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def bad_ints(lo=None, hi=None, *, none_ok=False):
    """Anything an int field in [lo, hi] must refuse."""
    out = [NOT_NUMBERS, st.floats(allow_nan=True), NON_FINITE]
    if lo is not None:
        out.append(ints(hi=lo - 1))
    if hi is not None:
        out.append(ints(lo=hi + 1))
    if not none_ok:
        out.append(st.none())
    return st.one_of(*out)


def bad_reals(lo=None, hi=None, *, lo_open=False, hi_open=False, none_ok=False):
    """Anything a float field in the range must refuse (integers outside it too)."""
    def outside(v) -> bool:
        return ((lo is not None and (v <= lo if lo_open else v < lo))
                or (hi is not None and (v >= hi if hi_open else v > hi)))
    numbers = []
    if lo is not None:
        numbers += [st.floats(max_value=lo, allow_nan=False, allow_infinity=False),
                    ints(hi=math.floor(lo))]
    if hi is not None:
        numbers += [st.floats(min_value=hi, allow_nan=False, allow_infinity=False),
                    ints(lo=math.ceil(hi))]
    out = [NOT_NUMBERS, NON_FINITE, st.just(BIG * 10**300)]
    if numbers:
        out.append(st.one_of(*numbers).filter(outside))
    if not none_ok:
        out.append(st.none())
    return st.one_of(*out)


def bad_bools(*, none_ok=False):
    out = [ints(), st.floats(), st.text(max_size=3)]
    if not none_ok:
        out.append(st.none())
    return st.one_of(*out)


def bad_choices(choices, *, none_ok=False):
    out = [st.text(max_size=6).filter(lambda s: s not in choices), ints(), st.booleans()]
    if not none_ok:
        out.append(st.none())
    return st.one_of(*out)


def optional(strategy):
    return st.none() | strategy


NONEMPTY_TEXT = st.text(min_size=1, max_size=6)

# field: (values it must accept, values it must refuse)
SAMPLING_FIELDS = {
    "n": (ints(1, 10**6), bad_ints(1)),
    "presence_penalty": (reals(-2, 2), bad_reals(-2, 2)),
    "frequency_penalty": (reals(-2, 2), bad_reals(-2, 2)),
    "repetition_penalty": (reals(0, 1e6, lo_open=True), bad_reals(0, lo_open=True)),
    "temperature": (reals(0, 1e6), bad_reals(0)),
    "top_p": (reals(0, 1, lo_open=True), bad_reals(0, 1, lo_open=True)),
    "top_k": (ints(-1, INT32_MAX), bad_ints(-1, INT32_MAX)),
    "min_p": (reals(0, 1), bad_reals(0, 1)),
    "seed": (optional(ints(SEED_MIN, SEED_MAX)), bad_ints(SEED_MIN, SEED_MAX, none_ok=True)),
    "stop": (optional(NONEMPTY_TEXT | st.lists(NONEMPTY_TEXT, max_size=3)),
             st.just("") | st.lists(st.just(""), min_size=1, max_size=2)
             | st.lists(ints(), min_size=1, max_size=2) | ints() | st.booleans()),
    "stop_token_ids": (optional(st.lists(ints(0, BIG), max_size=4)),
                       st.lists(ints(hi=-1) | st.floats() | st.booleans() | st.text(max_size=2),
                                min_size=1, max_size=3) | ints() | st.text(min_size=1)),
    "ignore_eos": (st.booleans(), bad_bools()),
    "max_tokens": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),
    "min_tokens": (ints(0, 16), bad_ints(0)),
    "logprobs": (optional(ints(0, BIG)), bad_ints(0, none_ok=True)),
    "prompt_logprobs": (optional(ints(0, BIG)), bad_ints(0, none_ok=True)),
    "skip_special_tokens": (st.booleans(), bad_bools()),
    "include_stop_str_in_output": (st.booleans(), bad_bools()),
    "detokenize": (st.booleans(), bad_bools()),
    # each constraint's own checks: tests/test_structured_output.py
    "structured_outputs": (optional(st.sampled_from([{"regex": "a+"}, {"choice": ["x", "y"]},
                                                     {"json": {"type": "integer"}},
                                                     {"json_object": True}])),
                           ints() | st.text(max_size=4) | st.lists(ints(), max_size=2)
                           | st.booleans()),
}

BEAM_FIELDS = {
    "beam_width": (ints(1, 10**6), bad_ints(1)),
    "max_tokens": (ints(1, BIG), bad_ints(1)),
    "ignore_eos": (st.booleans(), bad_bools()),
    "temperature": (st.sampled_from([0, 0.0, -0.0]), bad_reals(0, 0) | st.just(False)),
    "length_penalty": (reals(-1e6, 1e6), bad_reals()),
    "early_stopping": (st.sampled_from([True, False, "never"]),
                       st.sampled_from([1, 0, 1.0, None, "", "sometimes", "Never"])),
}

POWERS_OF_TWO = st.sampled_from([2**k for k in range(21)])
CONFIG_FIELDS = {
    "model": (NONEMPTY_TEXT, st.just("") | st.none() | ints()),
    "tokenizer": (optional(NONEMPTY_TEXT), st.just("") | ints() | st.booleans()),
    "dtype": (st.sampled_from(DTYPES), bad_choices(DTYPES)),
    "max_model_len": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),
    "max_num_seqs": (ints(1, BIG), bad_ints(1)),
    "max_num_batched_tokens": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),
    "usage_context": (st.sampled_from(USAGE_CONTEXTS), bad_choices(USAGE_CONTEXTS)),
    "block_size": (POWERS_OF_TWO, bad_ints(1) | ints(3, 10**6).filter(lambda b: b & (b - 1))),
    "gpu_memory_utilization": (reals(0, 1, lo_open=True), bad_reals(0, 1, lo_open=True)),
    "num_blocks": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),
    "kv_cache_memory": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),
    "enable_prefix_caching": (st.booleans(), bad_bools()),
    "enable_chunked_prefill": (st.booleans(), bad_bools()),
    "preemption_mode": (st.sampled_from(PREEMPTION_MODES), bad_choices(PREEMPTION_MODES)),
    "scheduling_policy": (st.sampled_from(SCHEDULING_POLICIES), bad_choices(SCHEDULING_POLICIES)),
    "swap_space": (optional(reals(0, 1e6)), bad_reals(0, none_ok=True)),
    "num_cpu_blocks": (optional(ints(0, BIG)), bad_ints(0, none_ok=True)),
    "seed": (ints(SEED_MIN, SEED_MAX), bad_ints(SEED_MIN, SEED_MAX)),
    "device": (NONEMPTY_TEXT, st.just("") | st.none() | ints()),
    "cpu_threads": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),
    "attention_backend": (optional(st.sampled_from(ATTENTION_BACKENDS)),
                          bad_choices(ATTENTION_BACKENDS, none_ok=True)),
    "fused_ops": (optional(st.booleans()), bad_bools(none_ok=True)),
    "max_trace_len": (optional(ints(0, BIG)), bad_ints(0, none_ok=True)),
    "record_block_tables": (st.booleans(), bad_bools()),
    "enforce_eager": (st.booleans(), bad_bools()),
    "async_scheduling": (optional(st.booleans()), bad_bools(none_ok=True)),
    "kv_cache_dtype": (st.sampled_from(KV_CACHE_DTYPES), bad_choices(KV_CACHE_DTYPES)),
    "quantization": (optional(st.sampled_from(QUANTIZATION_METHODS)),
                     bad_choices(QUANTIZATION_METHODS, none_ok=True)),
    "max_logprobs": (ints(-1, BIG), bad_ints(-1)),
    "tensor_parallel_size": (ints(1, 1024), bad_ints(1)),
    "enable_lora": (st.booleans(), bad_bools()),
    "max_loras": (ints(1, BIG), bad_ints(1)),
    "max_lora_rank": (ints(1, 512), bad_ints(1, 512)),
    "max_cpu_loras": (optional(ints(1, BIG)), bad_ints(1, none_ok=True)),  # >= max_loras (1)
    "speculative_config": (
        optional(st.builds(lambda k, m: {"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_max": m, "prompt_lookup_min": 1},
                           ints(1, 16), ints(1, 8))),
        ints() | st.text(max_size=5) | st.lists(ints(), max_size=2) | st.booleans()),
}

BEAM_BASE = dict(beam_width=2, max_tokens=4)


def _sampling(field, value):
    return SamplingParams(**{field: value})


def _beam(field, value):
    return BeamSearchParams(**{**BEAM_BASE, field: value})


def _config(field, value):
    EngineConfig(**{field: value}).validate()


@pytest.mark.parametrize("cls, table", [(SamplingParams, SAMPLING_FIELDS),
                                        (BeamSearchParams, BEAM_FIELDS),
                                        (EngineConfig, CONFIG_FIELDS)])
def test_every_field_has_a_contract(cls, table):
    """A field added later must be added to the tables above (and so be checked)."""
    assert set(table) == {f.name for f in fields(cls)}


def _refused(make, field, value):
    with pytest.raises(ValueError) as e:
        make(field, value)
    msg = str(e.value)
    assert msg.startswith(f"{field} must be "), msg  # the server reports this word as the field
    shown = [repr(value)] + ([repr([value])] if isinstance(value, str) else [])
    assert any(s in msg for s in shown), f"{value!r} not shown in {msg!r}"


CASES = ([(_sampling, f, ok, bad) for f, (ok, bad) in SAMPLING_FIELDS.items()]
         + [(_beam, f, ok, bad) for f, (ok, bad) in BEAM_FIELDS.items()]
         + [(_config, f, ok, bad) for f, (ok, bad) in CONFIG_FIELDS.items()])
IDS = ([f"SamplingParams.{f}" for f in SAMPLING_FIELDS]
       + [f"BeamSearchParams.{f}" for f in BEAM_FIELDS]
       + [f"EngineConfig.{f}" for f in CONFIG_FIELDS])


@pytest.mark.parametrize("make, field, ok, bad", CASES, ids=IDS)
@PROPS
@given(data=st.data())
def test_out_of_range_and_wrong_types_are_refused_naming_the_field(make, field, ok, bad, data):
    _refused(make, field, data.draw(bad, label=field))


@pytest.mark.parametrize("make, field, ok, bad", CASES, ids=IDS)
@PROPS
@given(data=st.data())
def test_values_in_range_are_accepted(make, field, ok, bad, data):
    make(field, data.draw(ok, label=field))


@PROPS
@given(n=ints(1, 64), seed=ints(SEED_MIN, SEED_MAX))
def test_seed_leaves_room_for_every_samples_seed(n, seed):
    """Sample i of n draws with seed + i: every one of them must be a seed torch takes."""
    if seed + n - 1 <= SEED_MAX:
        params = SamplingParams(n=n, seed=seed)
        for i in range(n):
            torch.Generator().manual_seed(params.seed + i)
    else:
        _refused(lambda f, v: SamplingParams(n=n, seed=v), "seed", seed)


@PROPS
@given(max_tokens=ints(1, 100), min_tokens=ints(0, 100))
def test_min_tokens_must_fit_max_tokens(max_tokens, min_tokens):
    if min_tokens <= max_tokens:
        SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)
    else:
        with pytest.raises(ValueError, match=rf"^min_tokens must be <= max_tokens "
                                             rf"\({max_tokens}\), got {min_tokens}$"):
            SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)


def test_values_are_normalized_to_plain_numbers():
    p = SamplingParams(temperature=1, top_p=1, top_k=-1, n=True + 1, stop="x")
    assert type(p.temperature) is float and type(p.top_p) is float and p.top_k == 0
    assert p.stop == ["x"] and p.stop_token_ids == []


def test_messages_name_field_value_and_range():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=math.nan)
    assert str(e.value) == "temperature must be a finite number >= 0 (0 = greedy), got nan"
    with pytest.raises(ValueError) as e:
        SamplingParams(n=2, seed=2**64 - 1)
    assert str(e.value) == (f"seed must be None or an integer in [{SEED_MIN}, {2**64 - 2}] "
                            f"(sample i of n=2 uses seed + i), got {2**64 - 1}")
    with pytest.raises(ValueError) as e:
        EngineConfig(max_num_batched_tokens=0).validate()
    assert str(e.value) == "max_num_batched_tokens must be None or an integer >= 1, got 0"


# --- the engine's own checks: they need the model ---------------------------------------------
@pytest.fixture(scope="module")
def llm():
    llm = LLM("stories260K", block_size=8, num_blocks=96, dtype="float32", device="cpu",
              max_num_seqs=8)
    llm.idle_text = _idle(llm)  # before any poison
    return llm


def _idle(llm) -> str:
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)[0]
    return out.outputs[0].text


def _assert_serves_as_before(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.get_num_unfinished_requests() == 0
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert _idle(llm) == llm.idle_text
    assert eng.block_manager.num_free_blocks == eng.num_blocks


BAD_TOKEN = st.one_of(st.floats(), st.booleans(), st.text(max_size=3), st.none(),
                      ints(hi=-1), ints(lo=512), st.lists(ints(0, 5), max_size=2))


@settings(max_examples=30, deadline=None)
@given(prefix=st.lists(ints(0, 511), max_size=4), bad=BAD_TOKEN, suffix=st.lists(ints(0, 511),
                                                                                   max_size=4))
def test_any_bad_token_id_is_refused_at_entry(llm, prefix, bad, suffix):
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("p", prefix + [bad] + suffix, SamplingParams(max_tokens=2))
    assert "token ids" in str(e.value) and "request 'p'" in str(e.value)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(ints(0, BIG), min_size=1, max_size=4))
def test_stop_token_ids_must_be_inside_the_vocabulary(llm, ids):
    params = SamplingParams(stop_token_ids=ids, min_tokens=1, max_tokens=2)
    if max(ids) < 512:
        llm.engine.add_request("s", [1, 403], params)
        llm.engine.abort_request("s")
        return
    with pytest.raises(RequestError, match=r"^stop_token_ids must be inside the vocabulary "
                                           r"\[0, 512\), got \["):
        llm.engine.add_request("s", [1, 403], params)
    assert not llm.engine.requests


@settings(max_examples=20, deadline=None)
@given(k=ints(0, 10**6))
def test_logprobs_up_to_max_logprobs(llm, k):
    assert llm.config.max_logprobs == 20  # vLLM's default
    params = SamplingParams(logprobs=k, max_tokens=1)
    if k <= 20:
        llm.engine.add_request("l", [1, 403], params)
        llm.engine.abort_request("l")
        return
    with pytest.raises(RequestError, match=rf"^logprobs must be <= max_logprobs \(20\), got {k} "):
        llm.engine.add_request("l", [1, 403], params)


def test_no_logprobs_limit_returns_at_most_the_vocabulary():
    llm = LLM("stories260K", max_model_len=64, num_blocks=32, device="cpu", max_logprobs=-1)
    out = llm.generate([[1, 403]], SamplingParams(max_tokens=1, logprobs=10**6),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) == 512


def test_n_must_fit_max_num_seqs(llm):
    with pytest.raises(RequestError, match="n=9 sequences cannot run at once with max_num_seqs=8"):
        llm.generate("Once", SamplingParams(n=9), use_tqdm=False)
    _assert_serves_as_before(llm)


# --- each poison that used to reach the step, through LLM.generate ------------------------------
def _changed_after_construction(field, value, **base):
    """Valid params whose field is then set to a poison: only the engine's check can stop it."""
    params = SamplingParams(**base)
    setattr(params, field, value)
    return params


POISONS = {
    # the per-sample seed of sample 1 (seed + 1) would overflow torch's generator
    "seed": (dict(n=2, temperature=1.0), 2**64 - 1),
    # top_k of 2**63 overflowed the int64 tensor inside the step
    "top_k": (dict(temperature=1.0), 2**63),
    # NaN gave <unk> for every token; the step did not even fail
    "temperature": (dict(), math.nan),
    "repetition_penalty": (dict(temperature=0), math.nan),
}


@pytest.mark.parametrize("field", POISONS)
def test_poisoned_sampling_field_is_refused_at_entry(llm, field):
    base, value = POISONS[field]
    with pytest.raises(ValueError, match=f"^{field} must be "):
        SamplingParams(**base, **{field: value})
    params = _changed_after_construction(field, value, max_tokens=4, **base)
    with pytest.raises(RequestError) as e:
        llm.generate(["Once upon a time", "The cat"], params, use_tqdm=False)
    assert str(e.value).startswith(f"prompt 0: {field} must be "), str(e.value)
    assert repr(value) in str(e.value)
    _assert_serves_as_before(llm)


def test_stop_token_id_outside_the_vocabulary_with_min_tokens(llm):
    """It used to index the logits out of bounds inside the step (the min_tokens ban)."""
    with pytest.raises(RequestError) as e:
        llm.generate(["The cat", "Once upon a time"],
                     [SamplingParams(max_tokens=4),
                      SamplingParams(stop_token_ids=[10**6], min_tokens=2, max_tokens=4)],
                     use_tqdm=False)
    assert str(e.value).startswith("prompt 1: stop_token_ids must be inside the vocabulary "
                                   "[0, 512), got [1000000]")
    _assert_serves_as_before(llm)


@pytest.mark.parametrize("prompts, words", [
    (None, "prompts must be a string, a list of token ids"),
    ([], "prompts must be"),
    ([1.0, 403.0], "prompt 0: prompt token ids must be integers in [0, 512), got 1.0 at position"),
    ([[1, 403], [1, True]], "prompt 1: prompt token ids must be integers in [0, 512), got True at"),
    ([[1, 403], [[1, 2]]], "prompt 1: prompt token ids must be integers in [0, 512), got [1, 2] "),
    ([[1, 403], 7.5], "prompt 1: prompt must be a string or a list of token ids, got 7.5"),
    ([{"prompt_token_ids": []}], "prompt 0: the prompt is empty"),
    ([{"text": "x"}], "prompt 0: prompt must be a string or a list of token ids, got None"),
])
def test_bad_prompts_are_refused_at_entry(llm, prompts, words):
    """Float token ids used to run a whole generation and then fail in detokenize."""
    with pytest.raises(RequestError) as e:
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert words in str(e.value), str(e.value)
    _assert_serves_as_before(llm)


def test_max_num_batched_tokens_zero_is_refused_before_building(llm):
    """It used to build an engine whose scheduler could never make progress."""
    with pytest.raises(ValueError, match="^max_num_batched_tokens must be None or an integer "
                                         ">= 1, got 0$"):
        LLM("stories260K", max_num_batched_tokens=0, device="cpu")
    _assert_serves_as_before(llm)


def test_sampling_params_of_another_kind_are_refused(llm):
    with pytest.raises(RequestError, match="sampling_params must be SamplingParams or "
                                           "BeamSearchParams, got dict"):
        llm.generate("Once", {"temperature": 0}, use_tqdm=False)
    _assert_serves_as_before(llm)
