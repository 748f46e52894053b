"""Stage 4, `step_loop` (lesson 02b): one engine step, phase by phase, and when a request stops.

Write `SyncStepLoop.step` (minipaged/engine/step_loop.py), `LLMEngine.update_computed`
(minipaged/engine/llm_engine.py), and `OutputProcessor.check_stop` and `find_stop_string`
(minipaged/engine/output.py).
While the grader runs, yours replace the real methods: every `LLM.generate` steps through your
loop. Grade them with

    minipaged exercise check step_loop

Needs from the stages before: the plan (`engine.schedule()`, stages admission and scheduler,
lesson 03), the forward (`engine.execute_model(sched)`, built by prepare_inputs) and the
sampler (stage sampler, lesson 04), all reached through the engine's public phases:

    eng.schedule()                          -> SchedulerOutput (sched.is_empty: nothing runs)
    eng.execute_model(sched)                -> logits, one row per sequence that samples
    eng.update_computed(sched)              -> the sequences that sample, in step order
    eng.sample_and_process(logits, seqs)    -> (outputs, finished request ids); it appends each
                                               token and calls check_stop
    eng.finish_step(sched, outputs, finished, t0)   records the step, returns its outputs
    eng.finish_empty_step(sched, t0)        the same for a step with nothing to run
    eng.block_manager.cache_full_blocks(seq)        publish the blocks a step filled

In `check_stop`: `seq.sampling_params` (`min_tokens`, `ignore_eos`, `stop_token_ids`, `stop`,
`max_tokens`), `seq.num_output_tokens`, `seq.num_tokens`, `self.eos_token_ids`,
`self.max_model_len`, and `self.check_stop_strings(seq)` (detokenizes, then looks for a stop
string in the new text with your `find_stop_string`; True on a match).
"""
from __future__ import annotations

import time  # noqa: F401  (t0 = time.perf_counter())
from typing import Optional

from minipaged.engine.scheduler import SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus  # noqa: F401


def step(self) -> list:
    # `self` is the step loop; `self.engine` the engine. Plan; a step with nothing to run
    # ends with finish_empty_step. Otherwise run the forward, count the step's tokens
    # computed, sample and process the rows that sample, and finish the step.
    raise NotImplementedError("exercise: write SyncStepLoop.step")


def update_computed(self, sched: SchedulerOutput) -> list[Sequence]:
    """Phase 3: the forward has written the step's K/V: count them computed, publish the
    full blocks not published at allocation; returns the sequences that sample, in order.

    The full blocks a step fills were published when the scheduler allocated their slots: now
    they are computed; `cache_full_blocks` publishes those whose tokens were not known then."""
    raise NotImplementedError("exercise: write LLMEngine.update_computed")


def check_stop(self, seq: Sequence, token: int) -> Optional[SequenceStatus]:
    """The finished status `seq` reaches with its newest `token`, or None to go on."""
    # In this order: once min_tokens are out, EOS (unless ignore_eos) and the stop token ids
    # (the latter also set seq.stop_reason) stop it; then stop strings (only if p.stop);
    # then max_tokens and max_model_len end it for length.
    raise NotImplementedError("exercise: write OutputProcessor.check_stop")


def find_stop_string(text: str, searched: int, stops: list[str],
                     include: bool) -> Optional[tuple[str, int]]:
    """The stop string that ends in the new text `text[searched:]` and starts first, with the
    length the text is cut to (its end if `include`, else its start); None if there is none.

    Only matches that reach into the new text count (vLLM's window: the last `len(stop) - 1`
    old characters plus the new ones), so text that was checked before, or produced before
    min_tokens, is never cut after the fact, and the search costs O(new text) per step.
    """
    # str.find(stop, start) with start = max(searched - len(stop) + 1, 0); the earliest match.
    raise NotImplementedError("exercise: write find_stop_string")
