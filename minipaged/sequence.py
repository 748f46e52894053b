"""Request and sequence state: the life of one generation, token by token.

A `Sequence` is one stream of tokens (the prompt followed by what the engine has sampled so far)
and walks a small state machine that lesson 03 draws as a Gantt chart:

    WAITING ──schedule──▶ RUNNING ──stop / length──▶ FINISHED_*
       ▲                     │
       └──────preempt────────┘   (recompute: its KV blocks are freed, it re-prefills later)

`num_computed_tokens` is vLLM's name for "how many of `token_ids` already have K/V in the cache";
the scheduler gives every sequence `len(token_ids) - num_computed_tokens` more tokens of work,
which is a whole prompt, a prefill chunk, or the single newest token of a decode.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from minipaged.sampling import Logprob, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recorded in the trace; a preempted sequence is put back in WAITING
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens reached, or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


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
    stop_reason: Optional[int | str] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    generator: Optional["torch.Generator"] = None  # per-request RNG when SamplingParams.seed is set

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

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def __repr__(self) -> str:  # short, for the lessons
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
