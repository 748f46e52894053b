"""Async scheduling: plan and launch step t+1 while the GPU still runs step t (lesson 08).

A synchronous step (`LLMEngine.step`) ends by copying the sampled tokens to the host and waiting
for them, so the GPU idles while the host checks stops, schedules and prepares the next step.
With async scheduling the host does not wait. It leaves the sampled tokens on the GPU (their copy
to pinned host memory starts at once, `PendingStep`), plans the next step as if it had them, and
reads them one step later, while that next step runs.

The whole protocol lives in this file; the host's sequences only ever hold tokens it has read:

* `AsyncScheduler` counts, per sequence, the tokens the GPU has sampled that the host has not
  read ("in flight"). A running sequence with one in flight needs one more decode, whose input
  is that token; one whose in-flight token reaches max_tokens or max_model_len is known to stop,
  so it gets no further step.
* `GPUModelRunner.prepare_inputs` sees such a decode's input position past the host's tokens and
  gathers the token from the previous step's tensor on the device.
* `AsyncScheduling.step` replaces `LLMEngine.step`: schedule, launch, sample on the GPU, then
  process the *previous* step's tokens exactly as a synchronous step would have.

A sequence that turns out to have stopped (EOS, a stop string) has computed one token in vain;
that token is dropped when it is read. Steps that need their tokens at once (logprobs,
penalties, n > 1, beams) run synchronously, and so does a step whose sampler raised: there the
engine finds the rows that raise and fails their requests alone (engine/failures.py).

A step with grammar-constrained rows (structured_output/) stays asynchronous, one thing reordered:
a row's mask needs its previous token, so that step reads the previous step's tokens *before* it
samples (after launching the forward, so the reading and the mask fill run while the GPU
computes), then fills and applies the masks and samples on the GPU as any step does. A row whose
sequence stopped in that read is left unmasked; its token is dropped.
"""
from __future__ import annotations

import time
import weakref
from typing import Optional

import torch

from minipaged.engine import failures
from minipaged.engine.output import RequestOutput
from minipaged.engine.scheduler import Scheduler
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.sampling import SamplerOutput


class PendingStep:
    """A step's sampled tokens on their way to the host.

    Row i of `tokens` is the next token of `seqs[i]`. The copy into pinned host memory starts
    at once and does not block; `host_tokens()` waits for it (and so for that step) only.
    """

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor):
        self.seqs = seqs
        self.tokens = tokens  # (num_seqs,) int64 on the device: the next step's input ids
        self.row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    def host_tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class AsyncScheduler(Scheduler):
    """The scheduler, counting each sequence's tokens in flight."""

    def __init__(self, *args, max_model_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_model_len = max_model_len
        self.in_flight: dict[int, int] = {}  # seq_id -> sampled tokens the host has not read
        self.stops_in_flight: set[int] = set()  # seq_ids whose in-flight token is their last

    def num_tokens_to_compute(self, seq: Sequence) -> int:
        if seq.seq_id in self.stops_in_flight:
            return 0
        return seq.num_uncomputed_tokens + self.in_flight.get(seq.seq_id, 0)

    def token_sampled(self, seq: Sequence) -> None:
        k = self.in_flight[seq.seq_id] = self.in_flight.get(seq.seq_id, 0) + 1
        p = seq.sampling_params
        if ((p.max_tokens is not None and seq.num_output_tokens + k >= p.max_tokens)
                or seq.num_tokens + k >= self.max_model_len):
            self.stops_in_flight.add(seq.seq_id)

    def token_read(self, seq: Sequence) -> None:
        k = self.in_flight.pop(seq.seq_id, 0) - 1
        if k > 0:
            self.in_flight[seq.seq_id] = k
        else:
            self.stops_in_flight.discard(seq.seq_id)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        super().finish(seq, status)
        self.stops_in_flight.discard(seq.seq_id)


class AsyncScheduling:
    """Installs itself on an engine: its scheduler counts tokens in flight, its `step` runs."""

    def __init__(self, engine):
        # A weak reference: the engine holds this object (its `step`), so a strong one back
        # would make a reference cycle, and a dropped engine must be freed without the cycle
        # collector (the CUDA engine freezes the heap, see gpu_model_runner.freeze_gc_heap).
        self.engine = weakref.proxy(engine)
        engine.scheduler = engine.make_scheduler(AsyncScheduler,
                                                 max_model_len=engine.config.max_model_len)
        self.pending: Optional[PendingStep] = None  # the step whose tokens are not read yet
        engine.step = self.step
        engine.has_unfinished_requests = self.has_unfinished_requests

    def has_unfinished_requests(self) -> bool:
        """Tokens in flight count only for sequences that are still unfinished (an aborted or
        failed request's pending token is dropped when it is read)."""
        return self.engine.scheduler.has_unfinished() or (
            self.pending is not None and any(not s.is_finished for s in self.pending.seqs))

    def can_defer(self, sampling: list[Sequence]) -> bool:
        """Tokens can be read a step late unless something needs them (or their logprobs) now."""
        if self.engine.groups:
            return False
        # min_tokens bans EOS by the count of tokens the host holds: wait until it is past.
        return not any(s.sampling_params.logprobs is not None or s.sampling_params.has_penalties
                       or 0 < s.sampling_params.min_tokens >= s.num_output_tokens
                       for s in sampling)

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        t0 = time.perf_counter()
        eng._wait_time = 0.0
        sched = eng._schedule()
        if sched.is_empty:
            if self.pending is None:
                eng._check_progress(sched)
                if not sched.preempted:
                    if eng._failed_ids:  # requests failed before the forward (llm_engine.py)
                        eng._record(sched, [], t0)
                    return eng.with_failed([])
            outputs, finished = self.read_pending()  # nothing to run, but tokens to read
            eng._record(sched, finished, t0)
            return eng.with_failed(outputs)
        # The forward is queued on the GPU; nothing below waits for it until tokens are read.
        logits = eng.model_runner.execute(sched, self.pending)
        sampling = eng._computed(sched)
        defer = bool(sampling) and self.can_defer(sampling)
        outputs, finished = [], []
        if defer and any(s.sampling_params.structured_outputs is not None for s in sampling):
            # A grammar's mask needs the token before it: read the previous step's tokens
            # first (the forward keeps running), so the matchers have them when masks are filled.
            outputs, finished = self.read_pending()
        pending = self.sample(logits, sampling) if defer else None
        if pending is not None:
            for seq in sampling:
                eng.scheduler.token_sampled(seq)
            more_outputs, more_finished = self.read_pending()  # while this step runs
            outputs, finished = outputs + more_outputs, finished + more_finished
            # Sequences that stopped meanwhile need nothing from this step: if none is left,
            # there is nothing to read (has_unfinished_requests stays honest).
            if any(not s.is_finished for s in pending.seqs):
                self.pending = pending
            else:
                for seq in pending.seqs:
                    eng.scheduler.token_read(seq)
            eng._record(sched, finished, t0)
            return eng.with_failed(outputs)
        earlier_outputs, earlier_finished = self.read_pending()  # this step needs them all
        outputs, finished = outputs + earlier_outputs, finished + earlier_finished
        more_outputs, more_finished = eng._sample_and_process(logits, sampling)
        eng._record(sched, finished + more_finished, t0)
        return eng.with_failed(outputs + more_outputs)

    def sample(self, logits: torch.Tensor, sampling: list[Sequence]) -> Optional[PendingStep]:
        """This step's tokens, left on the device. None if the sampler raised: the step is then
        sampled again synchronously, where a row that raises fails alone (engine/failures.py)."""
        generators = failures.save_generators(sampling)
        try:
            logits = self.engine.structured_output.apply_masks(logits, sampling)  # grammar rows
            return PendingStep(sampling, self.engine.sampler.sample(logits, sampling))
        except Exception:
            failures.restore_generators(generators)  # the retry draws what this call drew
            return None

    def read_pending(self) -> tuple[list[RequestOutput], list[str]]:
        """Read the previous step's tokens and process them as a synchronous step would have."""
        pending, self.pending = self.pending, None
        if pending is None:
            return [], []
        t0 = time.perf_counter()
        tokens = pending.host_tokens()  # waits for that step only; the current one keeps running
        self.engine._wait_time += time.perf_counter() - t0
        for seq in pending.seqs:
            self.engine.scheduler.token_read(seq)
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        self.engine._process(pending.seqs, SamplerOutput(token_ids=tokens), outputs, finished)
        return outputs, finished
