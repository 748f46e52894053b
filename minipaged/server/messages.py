"""What the API server and the engine core say to each other, as typed msgpack messages.
Lesson 07 explains it.

Every message is a `msgspec.Struct` encoded with msgspec's msgpack codec: plain numbers, strings
and lists on the wire, decoded back into these classes (a wrong field type is a decode error, not
a surprise later). Nothing is pickled, so a message can never run code when it is read.

    API server ─▶ engine core      AddRequest, AbortRequests, Shutdown
    engine core ─▶ API server      Ready (once, after loading), Accepted (after adds),
                                   StepOutputs (once per step), Dead (the core is stopping)

`StepOutputs` carries only what is new since the last step: per request the newly sampled token
ids of each sample (and their logprobs), and how it finished; a request's prompt logprobs come
once, with its first tokens. The API server keeps the rest (text, stop strings, the whole token
list).
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

from minipaged.lora.request import LoRARequest


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict  # SamplingParams' fields (dataclasses.asdict), rebuilt and re-checked
    arrival_time: float
    lora_request: Optional[LoRARequest] = None  # the adapter the request's `model` names
    priority: int = 0  # scheduling_policy="priority": lower runs first


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class CompletionDelta(msgspec.Struct, array_like=True):
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    # per new token: [(token id, logprob, rank), ...] for the sampled token and the top ones
    new_logprobs: Optional[list[Optional[list[tuple[int, float, int]]]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: Optional[Union[int, str]] = None


class RequestTimes(msgspec.Struct, array_like=True):
    """A finished request's life on the engine core's clock (time.time()), for the metrics."""

    arrival: float
    first_scheduled: Optional[float]
    first_token: Optional[float]
    finished: float


# per token: [(token id, logprob, rank), ...]: the token itself and the top ones (or None)
WireLogprobs = list[Optional[list[tuple[int, float, int]]]]


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    completions: list[CompletionDelta]
    finished: bool = False
    error: Optional[str] = None  # finish_reason "error": what raised while it was stepped
    num_cached_tokens: int = 0
    times: Optional[RequestTimes] = None  # only once finished
    prompt_logprobs: Optional[WireLogprobs] = None  # once, with its first tokens (None first)


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int
    # Speculative decoding (cumulative, spec_decode/step_loop.SpecDecodingStats); 0 / [] off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: dict  # the resolved config and the cache's size: what the banner and the checks need


class Accepted(msgspec.Struct, tag="accepted", array_like=True):
    accepted: list[str]
    rejected: list[tuple[str, str]]  # (request id, why): the engine's RequestError


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    requests: list[RequestDelta]
    stats: EngineStats


class Dead(msgspec.Struct, tag="dead", array_like=True):
    message: str


CoreRequest = Union[AddRequest, AbortRequests, Shutdown]
CoreOutput = Union[Ready, Accepted, StepOutputs, Dead]


def wire_logprobs(entries) -> WireLogprobs:
    """{token id: Logprob} entries (None stays None) as plain tuples for msgpack."""
    return [None if e is None else [(tid, lp.logprob, lp.rank) for tid, lp in e.items()]
            for e in entries]


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(CoreRequest)
output_decoder = msgspec.msgpack.Decoder(CoreOutput)
