"""Request and sequence state: the life of one generation, token by token.

A `Sequence` is one stream of tokens (the prompt followed by what the engine has sampled so far)
and walks a small state machine that lesson 03 draws as a Gantt chart:

    WAITING ──schedule──▶ RUNNING ──stop / length──▶ FINISHED_*
       ▲                  │    ▲
       └──preempt─────────┘    │     recompute: its KV blocks are freed, it re-prefills later
                 SWAPPED ◀─────┘     swap: its KV blocks wait in CPU memory (lesson 06)

`num_computed_tokens` is vLLM's name for "how many of `token_ids` already have K/V in the cache":
the work left is a whole prompt, a prefill chunk, or the single newest token of a decode.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from minipaged.lora import LoRARequest
    from minipaged.sampling import Logprob, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recorded in the trace; a preempted sequence is put back in WAITING
    SWAPPED = "swapped"  # preempted by swapping: its KV blocks are in the CPU block pool
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens reached, or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # something raised while this request was stepped; it ended alone

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR})
_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream. `seq_id` is unique in the process; `request_id` is the user's name for it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: "SamplingParams"
    prompt: Optional[str] = None
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Everything below is filled in while the sequence runs.
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: Optional[list[dict[int, "Logprob"]]] = None
    output_text: str = ""
    # Incremental detokenization (output.py): a DecodeStream fed token_ids[:detok_read_offset].
    detok_stream: Optional[object] = field(default=None, repr=False)
    detok_read_offset: int = -1
    stop_searched_len: int = 0  # output_text[:this] has been searched for stop strings
    stop_reason: Optional[int | str] = None
    error: Optional[str] = None  # FINISHED_ERROR: what went wrong, for the request's caller
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    skip_reading_prefix_cache: bool = False  # vLLM's name: no prefix-cache lookup at admission
    # SamplingParams.prompt_logprobs: per prompt token, None first (prompt_logprobs/)
    prompt_logprobs: Optional[list[Optional[dict[int, "Logprob"]]]] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    generator: Optional["torch.Generator"] = None  # per-request RNG when SamplingParams.seed is set
    group: Optional[object] = field(default=None, repr=False)  # n > 1, beams: its SequenceGroup
    index: int = 0  # which of the group's samples (its CompletionOutput.index); beams: a counter
    recompute_until: int = 0  # tokens whose K/V a recompute preemption threw away (for the trace)
    lora_request: Optional["LoRARequest"] = None  # the adapter it runs with (minipaged/lora/)
    priority: int = 0  # scheduling_policy="priority": lower runs first (minipaged/priority/)
    # spec_decode/: the proposals the next step verifies, the totals proposed / accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    # --- sizes ------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model (prefix-cache key, scheduler's slot count)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet: the work left before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token is missing from the cache (prompt or recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def name(self) -> str:
        """The request id, or "request_id/index" for one of a group's sequences (trace keys)."""
        return self.request_id if self.group is None else f"{self.request_id}/{self.index}"

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def fork(self, index: int) -> "Sequence":
        """A copy with its own token lists and a new `seq_id` (the KV blocks are shared by
        `BlockManager.fork`, not here). Its RNG starts afresh from `seed + index`."""
        return replace(self, seq_id=next(_seq_counter), index=index, generator=None,
                       detok_stream=None,
                       output_token_ids=list(self.output_token_ids), token_ids=list(self.token_ids),
                       logprobs=None if self.logprobs is None else list(self.logprobs))

    def __repr__(self) -> str:  # short, for the lessons
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
