"""The requests speculative decoding refuses, checked as each is added (lesson 10).

`LLMEngine.add_request` calls it through the step loop (`SpecDecodeStepLoop.check_request`):
beam search and n > 1 do not combine with a verify step yet. A request's refusal is a `RequestError` (it fails alone);
the engine-wide refusals are `SpeculativeConfig.check_engine` (config.py).
"""
from __future__ import annotations

from minipaged.groups.beam_search import BeamSearchParams
from minipaged.engine.processor import RequestError


def check_request(request_id: str, params) -> None:
    """Requests speculation does not combine with yet: beam search and n > 1."""
    if isinstance(params, BeamSearchParams):
        raise RequestError(f"request {request_id!r}: beam search does not combine with "
                           f"speculative decoding yet; use an engine without "
                           f"speculative_config for beam search")
    if params.n > 1:
        raise RequestError(f"request {request_id!r}: n={params.n} does not combine with "
                           f"speculative decoding yet; use n=1 (send the prompt n times), or an "
                           f"engine without speculative_config")
