"""`SamplingParams`: vLLM's per-request sampling fields and defaults, checked at construction.

Lesson 04 explains each field; `sampler.py` applies them to a batch of logits rows. `validate`
refuses, with a message that starts with the field's name, any value of the wrong type, NaN or
infinity, or out of the range the sampler's tensors and generators hold (`validation.py`); the
engine adds the checks that need the model (`engine/processor.py`: ids inside the vocabulary,
`max_logprobs`; `n` within `max_num_seqs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Optional

from minipaged.sampling.structured_outputs import StructuredOutputsParams
from minipaged.validation import (INT32_MAX, SEED_MAX, SEED_MIN, check_bool, check_float,
                                  check_int, check_int_list)

if TYPE_CHECKING:
    import torch

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
    # ... per prompt token after the first, besides its own (minipaged/prompt_logprobs/)
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: outputs carry token ids only (the server's engine core)
    # The output must match a JSON schema / regex / choice / grammar (structured_output/, lesson 12)
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (validation.py) and normalize: numbers to int / float, `stop` to a
        list, top_k -1 to 0. Raises ValueError starting with the field's name. The engine calls
        it again when the request is added (a field may have been changed since)."""
        self.n = check_int("n", self.n, lo=1)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, -2, 2)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, -2, 2)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty,
                                              lo=0, lo_open=True, note=" (1 = off)")
        self.temperature = check_float("temperature", self.temperature, lo=0, note=" (0 = greedy)")
        self.top_p = check_float("top_p", self.top_p, 0, 1, lo_open=True)
        self.top_k = check_int("top_k", self.top_k, -1, INT32_MAX, note=" (0 or -1: all tokens)")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = check_float("min_p", self.min_p, 0, 1)
        # Sample i of n draws from its own generator, seeded seed + i (sampler.py): all n seeds
        # must be ones torch.Generator.manual_seed takes.
        self.seed = check_int("seed", self.seed, SEED_MIN, SEED_MAX - (self.n - 1), optional=True,
                              note=f" (sample i of n={self.n} uses seed + i)" if self.n > 1 else "")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, (list, tuple)) and all(
                isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be None, a non-empty string or a list of non-empty "
                             f"strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = check_int_list("stop_token_ids", self.stop_token_ids, lo=0,
                                             optional=True) or []
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.max_tokens = check_int("max_tokens", self.max_tokens, lo=1, optional=True,
                                    note=" (None: up to max_model_len)")
        self.min_tokens = check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens}")
        self.logprobs = check_int("logprobs", self.logprobs, lo=0, optional=True)
        self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, lo=0,
                                         optional=True)
        self.skip_special_tokens = check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = check_bool("include_stop_str_in_output",
                                                     self.include_stop_str_in_output)
        self.detokenize = check_bool("detokenize", self.detokenize)
        if self.structured_outputs is not None:  # a dict too (how it crosses to the engine core)
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

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


class TokenMask(NamedTuple):
    """Grammar masks for a step's rows, on the logits' device (structured_output/manager.py
    fills them; the sampling kernels apply them, kernels.py)."""
    bitmask: "torch.Tensor"  # (rows, ceil(vocab / 32)) int32: bit t % 32 of word t // 32 = allowed
    masked: "torch.Tensor"  # (rows,) int32: 1 = the row is constrained (its bitmask applies)
    keep: "torch.Tensor"  # (ceil(vocab / 32),) int32: every bit set but the stop tokens'
