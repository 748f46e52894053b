"""The request-extension seam: capabilities that act on requests, attached once at build.

A request extension (structured outputs, LoRA adapters, n > 1 and beam search) plugs into
`LLMEngine` at a few named points of a request's life. Each hook is called once per batch
(never once per row) and only for the extensions that define it; with none registered the
engine's step calls nothing:

    prepare(engine, request_id, params, n)    add_request, once the prompt (n tokens) is read:
                                              (the params its sequences run with, a function
                                              that takes its new Sequence, or None); raise
                                              RequestError for a request it cannot serve
    hold(request_id, params)                  add_request, the last check: None to queue the
                                              request now, or a function that takes its new
                                              Sequence and keeps it out of the queue (a grammar
                                              still compiling)
    num_held()                                requests held so far (they are unfinished)
    before_plan(engine)                       before the scheduler plans: release held requests
    after_plan(engine, sched)                 after the plan, before the forward: drop what
                                              cannot run (fail it with engine.fail_before_forward)
    rows_to_sample(engine, logits, seqs)      (logits, seqs) of the rows to sample (a group's
                                              prompt forks into its samples; beams wait)
    process_logits(logits, seqs)              the rows about to be sampled (grammar masks)
    after_tokens(engine, seqs, outputs,       after `process_tokens` appended a token to each
                 finished)                    of `seqs` (a group of n samples reports, beam
                                              searches step), adding to the step's outputs
    abort(request_id)                         the request is aborted, before the engine drops it

vLLM keeps the same points in its `Processor` (checks), its scheduler (structured-output and
LoRA admission), its `StructuredOutputManager` (bitmasks before sampling) and its n > 1 fan-out
(`ParentRequest`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

HOOKS = ("prepare", "hold", "num_held", "before_plan", "after_plan", "rows_to_sample",
         "process_logits", "after_tokens", "abort")


class RequestExtension:
    """Every hook, doing nothing; an extension overrides the ones it needs."""

    def prepare(self, engine, request_id: str, params, num_prompt_tokens: int):
        return params, None

    def hold(self, request_id: str, params) -> Optional[Callable]:
        return None

    def num_held(self) -> int:
        return 0

    def before_plan(self, engine) -> None:
        pass

    def after_plan(self, engine, sched) -> None:
        pass

    def rows_to_sample(self, engine, logits: torch.Tensor, seqs: list):
        return logits, seqs

    def process_logits(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        return logits

    def after_tokens(self, engine, seqs: list, outputs: list, finished: list[str]) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass


class Extensions:
    """The registered extensions' hooks, one list per hook (only those an extension overrides),
    so the engine calls exactly the hooks in use: `for hook in ext.before_plan: hook(engine)`."""

    def __init__(self, extensions: list[RequestExtension]):
        self.extensions = extensions
        for name in HOOKS:
            base = getattr(RequestExtension, name)
            setattr(self, name, [getattr(e, name) for e in extensions
                                 if getattr(type(e), name) is not base])
