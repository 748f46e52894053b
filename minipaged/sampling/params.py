"""`SamplingParams`: vLLM's per-request sampling fields and defaults, checked at construction.

Lesson 04 explains each field; `sampler.py` applies them to a batch of logits rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[str | list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: Optional[int] = None  # number of top log-probabilities to return per token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            bad("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: Optional[str] = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: Logprob} holding the top-`logprobs` tokens and the sampled one (or None).
    logprobs: list[Optional[dict[int, Logprob]]] = field(default_factory=list)
    sampled_logprobs: list[Optional[float]] = field(default_factory=list)
