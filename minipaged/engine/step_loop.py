"""The step-loop seam: who runs `step()`, chosen once when the engine is built (lessons 02b, 03).

A step loop owns `step()` and `has_unfinished_requests()`; the engine forwards both to the loop
it was built with (vLLM binds `EngineCore.step_fn` once the same way). Every loop is made of
the engine's public phases (llm_engine.py). `SyncStepLoop` below is the core's, one step at a
time; the others live with their capability (async_sched/, spec_decode/; engine/build.py picks
one). A loop may bring its own scheduler class (`scheduler_cls`, with `scheduler_kwargs`) and
refuse requests it cannot serve (`check_request`).
"""
from __future__ import annotations

import time
import weakref

from minipaged.engine.scheduler import Scheduler


class StepLoop:
    """The seam's interface, and what every loop shares."""

    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(self, engine):
        # Weak: a cycle with the engine would need the collector to free a dropped engine (CUDA
        # freezes the heap, gpu_model_runner.freeze_gc_heap).
        self.engine = weakref.proxy(engine)

    @staticmethod
    def scheduler_kwargs(config) -> dict:
        """Extra keyword arguments of `scheduler_cls` (from the resolved config)."""
        return {}

    def check_request(self, request_id: str, params) -> None:
        """Raise `RequestError` for a request this loop cannot serve (called by add_request)."""

    def step(self) -> list:
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_sequences()


class SyncStepLoop(StepLoop):
    """One step at a time: plan, run the forward, sample, update, record."""

    def step(self) -> list:
        eng = self.engine
        t0 = time.perf_counter()
        sched = eng.schedule()
        if sched.is_empty:
            return eng.finish_empty_step(sched, t0)
        logits = eng.execute_model(sched)  # (num_sampling_seqs, vocab)
        outputs, finished = eng.sample_and_process(logits, eng.update_computed(sched))
        return eng.finish_step(sched, outputs, finished, t0)
