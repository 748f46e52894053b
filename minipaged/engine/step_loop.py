"""The step-loop seam: who runs `step()`, chosen once when the engine is built (lessons 02b, 03).

A step loop owns `step()` and `has_unfinished_requests()`; the engine forwards both to the loop
it was built with (`LLMEngine.step_loop`; vLLM binds `EngineCore.step_fn` once the same way).
Every loop is made of the engine's public phases:

    schedule()            plan: which sequences run, how many tokens each (scheduler.py)
    execute_model(sched)  the forward: logits of the rows that sample
    update_computed()     the step's K/V are in the cache: num_computed_tokens moves on
    sample_and_process()  sample a token per row, append it, check stops, finish requests
    finish_step()         record the StepRecord, return the step's outputs

`SyncStepLoop` below is the core's loop, one step at a time. The others live with their
capability and plug in here: `async_sched.AsyncStepLoop` (plan step t+1 while the GPU runs
step t, lesson 08) and `spec_decode.SpecDecodeStepLoop` (propose, verify, roll back, lesson
10). A loop may also bring its own scheduler class (`scheduler_cls`, built by the engine with
`scheduler_kwargs`) and refuse requests it cannot serve (`check_request`).
"""
from __future__ import annotations

import time
import weakref

from minipaged.engine.scheduler import Scheduler


class StepLoop:
    """The seam's interface, and what every loop shares."""

    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(self, engine):
        # A weak reference: the engine holds its loop, so a strong one back would make a
        # reference cycle, and a dropped engine must be freed without the cycle collector (the
        # CUDA engine freezes the heap, see gpu_model_runner.freeze_gc_heap).
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
