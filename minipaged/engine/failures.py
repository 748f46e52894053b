"""A request that raises while it is stepped fails alone (lesson 07, serving).

Whatever raises while the engine works on one request (its sampling, detokenizing, a stop check,
its beam step) is that request's fault: `fail_request` ends it with `FINISHED_ERROR`, gives
its blocks back and returns its last `RequestOutput` (finish_reason "error", `error` set), and
the step goes on for every other request. So does a request whose LoRA adapter, dropped from
the CPU cache, can no longer be read from its folder: it fails before the forward
(`LLMEngine.schedule`). An error in the model's forward is nobody's request:
it propagates.

The sampler runs on the whole batch at once, so a raise there does not say which row caused it.
Only then (the path below runs after a failure, never in a healthy step) each row is sampled
alone, and the rows that raise fail. The other rows must get exactly the token the batch would
have given them: a seeded row draws from its own generator, which the failed batch call may
already have advanced, so the generators are saved before every batch call and put back before
the retry. Greedy rows need nothing; unseeded rows draw fresh noise from the engine's generator
(what they get depends on the batch anyway).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, TypeVar

import torch

from minipaged.engine.output import CompletionOutput, OutputProcessor, RequestOutput
from minipaged.engine.scheduler import Scheduler
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.groups.group import SequenceGroup
from minipaged.sampling import SamplerOutput

logger = logging.getLogger("minipaged.engine")
Row = TypeVar("Row")
SavedGenerators = list[tuple[Sequence, Optional[torch.Tensor]]]


def fail_request(engine, seq: Sequence, exc: Exception, outputs: list[RequestOutput],
                 finished: list[str]) -> None:
    """End `seq`'s whole request with FINISHED_ERROR (every sample or beam), free its
    blocks, and report it in this step's `outputs` and `finished` (`engine`: an LLMEngine)."""
    root = engine.requests.pop(seq.request_id, None)
    if root is None:  # it has already failed this step (another of its samples)
        return
    group = engine.groups.pop(seq.request_id, None)
    error = describe(exc)
    logger.warning("request %r failed: %s", seq.request_id, error, exc_info=exc)
    # The culprit, even if it had finished, and every other sequence still running.
    live = held_seqs(engine.scheduler, seq.request_id)
    for s in dict.fromkeys([seq] + live):
        engine.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
        s.error = error
    root.error, root.finished_time = error, time.time()
    outputs.append(error_output(engine.output_processor, root, group, live))
    finished.append(seq.request_id)


def sample_batch(sampler: Callable[[torch.Tensor, list[Sequence]], SamplerOutput],
                 logits: torch.Tensor, seqs: list[Sequence]):
    """`sampler(logits, seqs)` -> (its output, the sequences it holds tokens for, [(sequence,
    error)] of the rows that raised): all rows at once, and only if that raises, each alone."""
    generators = save_generators(seqs)  # seeded rows: for a retry after a raise
    try:
        return sampler(logits, seqs), seqs, []
    except Exception:
        done, errors = sample_rows_alone(sampler, logits, seqs, generators)
        return join_outputs([out for _, out in done]), [seq for seq, _ in done], errors


def describe(exc: BaseException) -> str:
    """The request's error message: the exception's type and text."""
    return f"{type(exc).__name__}: {exc}"


def save_generators(seqs: list[Sequence]) -> SavedGenerators:
    """The state of each seeded sequence's generator (None: not created yet)."""
    return [(s, None if s.generator is None else s.generator.get_state())
            for s in seqs if s.sampling_params.seed is not None]


def restore_generators(saved: SavedGenerators) -> None:
    for seq, state in saved:
        if state is None:
            seq.generator = None  # created by the failed call: created afresh from its seed
        else:
            seq.generator.set_state(state)


def sample_rows_alone(sample: Callable[[torch.Tensor, list[Sequence]], Row], logits: torch.Tensor,
                      seqs: list[Sequence], saved: SavedGenerators):
    """After `sample(logits, seqs)` raised: each row alone, with the generators as they were
    before. Returns (the rows that sampled: [(seq, result)], the rows that raised:
    [(seq, exception)])."""
    restore_generators(saved)
    done: list[tuple[Sequence, Row]] = []
    failed: list[tuple[Sequence, Exception]] = []
    for row, seq in enumerate(seqs):
        try:
            done.append((seq, sample(logits[row:row + 1], [seq])))
        except Exception as exc:  # this row's fault
            failed.append((seq, exc))
    return done, failed


def join_outputs(outs: list[SamplerOutput]) -> SamplerOutput:
    """One `SamplerOutput` from one-row outputs, in order."""
    joined = SamplerOutput(token_ids=[o.token_ids[0] for o in outs])
    if any(o.logprobs for o in outs):
        joined.logprobs = [o.logprobs[0] if o.logprobs else None for o in outs]
        joined.sampled_logprobs = [o.sampled_logprobs[0] if o.sampled_logprobs else None
                                   for o in outs]
    return joined


def held_seqs(scheduler: Scheduler, request_id: str) -> list[Sequence]:
    """Every sequence of the request that the scheduler still holds (waiting, running or
    swapped): with a beam step cut short, that includes beams forked but not yet recorded."""
    return [s for s in scheduler.seqs() if s.request_id == request_id]


def error_output(processor: OutputProcessor, root: Sequence, group: Optional[SequenceGroup],
                 live: list[Sequence]) -> RequestOutput:
    """The failed request's last output: its tokens and the text decoded so far (nothing is
    decoded again: decoding may be what raised). One completion per sample; for a beam search,
    one per beam that was live (`live`: those the scheduler held)."""
    if group is None:
        seqs = [root]
    elif group.beam is None:
        seqs = sorted(group.seqs, key=lambda s: s.index)
    else:
        seqs = live
    outputs = [CompletionOutput(
        index=i, text=s.output_text, token_ids=list(s.output_token_ids),
        cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
        logprobs=s.logprobs, finish_reason=s.status.value, stop_reason=s.stop_reason)
        for i, s in enumerate(seqs)]
    return processor.request_output(root, outputs, True)
