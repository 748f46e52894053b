"""Before a request is queued: its prompt and parameters checked against the model (vLLM V1's
`Processor`, the input side; `output.py`'s `OutputProcessor` is the output side).

`SamplingParams` and `BeamSearchParams` check their own fields when they are built
(`minipaged/validation.py`); `LLMEngine.add_request` checks them again (a field may have been
changed since) and adds what needs the model and the config: a prompt is text or a list of
integer token ids inside the vocabulary, stop token ids are inside the vocabulary, and `logprobs`
and `prompt_logprobs` are within `max_logprobs`; n samples or beams fit `max_num_seqs` (and
beams the cache); a LoRA adapter is read and checked (lora/manager.py); a `priority` is an
integer, and other than 0 only under the priority policy. A request that fails a check raises
`RequestError` and nothing is queued (lesson 07: a request's fault is that request's alone).
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional

from minipaged.groups.beam_search import BeamSearchParams
from minipaged.lora.request import LoRARequest
from minipaged.sampling import SamplingParams
from minipaged.validation import check_int


class RequestError(ValueError):
    """A request that cannot be served; it fails alone and the engine keeps running."""


def prompt_token_ids(request_id: str, prompt, vocab_size: int,
                     tokenize: Callable[[str], list[int]]) -> tuple[Optional[str], list[int]]:
    """(text or None, token ids) of a prompt given as text or as a list of token ids."""
    if isinstance(prompt, str):
        return prompt, tokenize(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise RequestError(f"prompt must be a string or a list of token ids, got "
                           f"{prompt!r:.80} (request {request_id!r})")
    if not prompt:
        raise RequestError("the prompt is empty; give at least one token")
    for i, t in enumerate(prompt):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab_size}), got "
                               f"{t!r:.80} at position {i} (request {request_id!r})")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"request {request_id!r}: token ids {bad[:5]} are outside the "
                           f"vocabulary [0, {vocab_size})")
    return None, [int(t) for t in prompt]


def validate_params(request_id: str, params, vocab_size: int, max_logprobs: int) -> None:
    """The fields once more, then the checks that need the model and the config."""
    if not isinstance(params, (SamplingParams, BeamSearchParams)):
        raise RequestError(f"sampling_params must be SamplingParams or BeamSearchParams, got "
                           f"{type(params).__name__} (request {request_id!r})")
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(f"{e} (request {request_id!r})") from None
    if isinstance(params, BeamSearchParams):
        return
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids must be inside the vocabulary [0, {vocab_size}), "
                           f"got {bad[:5]} (request {request_id!r})")
    for field in ("logprobs", "prompt_logprobs"):
        k = getattr(params, field)
        if k is not None and 0 <= max_logprobs < k:
            raise RequestError(f"{field} must be <= max_logprobs ({max_logprobs}), got {k} "
                               f"(request {request_id!r}); raise max_logprobs (-1: no limit) "
                               f"to ask for more")


PRIORITY_MIN, PRIORITY_MAX = -2**63, 2**63 - 1  # a 64-bit integer (it crosses msgpack)


def check_priority(request_id: str, priority, scheduling_policy: str) -> None:
    """An integer `priority`; other than 0 only under `scheduling_policy="priority"` (vLLM's
    rule: a priority the scheduler would ignore is an error, not a silent no-op)."""
    try:
        check_int("priority", priority, PRIORITY_MIN, PRIORITY_MAX, note=" (lower runs first)")
    except ValueError as e:
        raise RequestError(f"{e} (request {request_id!r})") from None
    if priority != 0 and scheduling_policy != "priority":
        raise RequestError(f"priority={priority} needs scheduling_policy='priority' "
                           f"(--scheduling-policy priority), but this engine schedules "
                           f"{scheduling_policy!r}: first come, first served; send priority 0 "
                           f"(request {request_id!r})")


def check_lora(request_id: str, lora_request, lora_manager) -> None:
    """A `LoRARequest` for an engine built with `enable_lora`; its adapter read and checked
    (`LoRAModelManager.add_adapter`, unless its CPU cache or a slot holds it)."""
    if not isinstance(lora_request, LoRARequest):
        raise RequestError(f"request {request_id!r}: lora_request must be a LoRARequest, got "
                           f"{type(lora_request).__name__}")
    if lora_manager is None:
        raise RequestError(f"request {request_id!r} asks for LoRA adapter "
                           f"{lora_request.lora_name!r}, but the engine was built without "
                           "adapters: pass enable_lora=True (--enable-lora)")
    try:
        lora_manager.add_adapter(lora_request)
    except ValueError as e:
        raise RequestError(f"request {request_id!r}: {e}") from None
