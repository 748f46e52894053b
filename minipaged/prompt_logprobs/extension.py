"""Prompt logprobs as a request extension (engine/extensions.py; lesson 04).

Attached to every engine (any request may ask for `prompt_logprobs`); a request without them
passes through `prepare` untouched, and nothing else is called per step. At each point:

    prepare   a request with prompt_logprobs starts with `prompt_logprobs = [None]` (position 0
              has nothing before it) and, if it has more than one prompt token, is registered
              with the runner (runner.py) and set to skip reading the prefix cache
    abort     an aborted request stops being scored

Why skip the prefix cache: a prefix hit has K/V but no logits, so its positions could not be
scored. vLLM V1 makes the same choice (`skip_reading_prefix_cache`: requests with prompt
logprobs recompute their whole prompt); the blocks they compute are still published for
others. Once its prompt is scored a request reads the cache as usual, so a recompute
preemption after that reuses what is cached.

With tensor parallelism the logits are gathered from every rank with the rows each rank was
sent (worker/tp_worker.py), so a runner wrapper on the driver cannot add rows: such an engine
refuses prompt logprobs by name.
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.extensions import RequestExtension
from minipaged.engine.processor import RequestError
from minipaged.engine.sequence import Sequence


class PromptLogprobsExtension(RequestExtension):
    def __init__(self, scoring: Optional[dict[str, Sequence]]):
        self.scoring = scoring  # PromptLogprobsRunner.scoring (None: no runner computes them)

    def prepare(self, engine, request_id: str, params, num_prompt_tokens: int):
        k = getattr(params, "prompt_logprobs", None)  # (beam search's params have none)
        if k is None:
            return params, None
        if self.scoring is None:
            raise RequestError(f"request {request_id!r}: prompt_logprobs={k} is not supported "
                               f"with tensor_parallel_size={engine.config.tensor_parallel_size}"
                               f"; use an engine without tensor parallelism to score prompts")

        def start(seq: Sequence) -> None:
            seq.prompt_logprobs = [None]
            if seq.num_prompt_tokens > 1:
                seq.skip_reading_prefix_cache = True
                self.scoring[request_id] = seq
        return params, start

    def abort(self, request_id: str) -> None:
        if self.scoring is not None:
            self.scoring.pop(request_id, None)
