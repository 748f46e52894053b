"""Structured outputs as a request extension (engine/extensions.py; lesson 12).

Attached to every engine (any request may carry `structured_outputs`); it costs a few checks a
step while no request has a grammar. What it does at each point:

    hold          a request's grammar compile starts (off the engine's thread, compiling.py); a
                  refusal in the first moments is a RequestError, a longer compile holds the
                  request outside the scheduler until it is done
    before_plan   requests whose grammar has compiled join the queue (or fail alone)
    process_logits  the grammar rows' masks applied to the logits before sampling (manager.py)
    abort         a held request stops waiting

After each token the engine advances the row's matcher (`StructuredOutputManager.accept`), which
finishes the row ("stop") at the grammar's end.
"""
from __future__ import annotations

from minipaged.engine.extensions import RequestExtension
from minipaged.engine.processor import RequestError
from minipaged.structured_output.compiling import GrammarCompiles
from minipaged.structured_output.manager import StructuredOutputManager


class StructuredOutputExtension(RequestExtension):
    def __init__(self, manager: StructuredOutputManager):
        self.manager = manager
        self.compiles = GrammarCompiles(manager)  # ... off the engine's thread

    def hold(self, request_id: str, params):
        spec = getattr(params, "structured_outputs", None)  # (beam search's params have none)
        if spec is None:
            return None
        try:
            compiling = self.compiles.start(spec)
        except ValueError as e:
            raise RequestError(f"{e} (request {request_id!r})") from None
        if compiling is None:
            return None
        return lambda seq: self.compiles.hold(seq, compiling)  # waits until compiled

    def num_held(self) -> int:
        return len(self.compiles.waiting)

    def before_plan(self, engine) -> None:
        if self.compiles.busy:  # those whose grammar has compiled join the queue
            self.compiles.admit(engine.scheduler.add, engine.fail_before_forward,
                                idle=not engine.scheduler.has_unfinished())

    def process_logits(self, logits, seqs):
        return self.manager.apply_masks(logits, seqs)  # grammar rows only

    def abort(self, request_id: str) -> None:
        self.compiles.drop(request_id)
