"""Async scheduling: plan and launch step t+1 while the GPU still runs step t (lesson 08).

A step loop (the seam in engine/step_loop.py), chosen once when the engine is built
(`async_scheduling`, on by default on CUDA); it calls the engine's public phases.

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
* `AsyncStepLoop.step` is the engine's step: schedule, launch, sample on the GPU, then
  process the *previous* step's tokens exactly as a synchronous step would have.

A sequence that turns out to have stopped (EOS, a stop string) has computed one token in vain;
that token is dropped when it is read. Steps that need their tokens at once (logprobs,
penalties, n > 1, beams) run synchronously, and so does a step whose sampler raised: there the
engine finds the rows that raise and fails their requests alone (engine/failures.py).

A step with grammar-constrained rows (structured_output/) stays asynchronous, its sampling
deferred: a row's mask needs the row's previous token, so that step reads the previous step's
tokens first, advances the constrained rows' matchers by them, hands the mask fill to a worker
thread (structured_output/background.py) and leaves its logits unsampled (`DeferredStep`). It
is sampled when its tokens are first needed: while the next step's inputs are built (after that
step has been scheduled, the worker filling meanwhile), or when it is read. On the GPU the masks
are applied inside the sampling kernels, which also flag, beside each token, a row whose mask
allows stop tokens only. A row whose grammar had ended is finished when the step is read
("stop") and its token dropped.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from minipaged.engine import failures
from minipaged.engine.output import RequestOutput
from minipaged.engine.scheduler import Scheduler
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.engine.step_loop import StepLoop
from minipaged.sampling import SamplerOutput
from minipaged.structured_output.manager import ended_rows


class PendingStep:
    """A step's sampled tokens on their way to the host.

    Row i of `tokens` is the next token of `seqs[i]`. The copy into pinned host memory starts
    at once and does not block; `host_tokens()` waits for it (and so for that step) only.
    `ended` and `errors` are a deferred step's rows that finish or fail when it is read, and
    `grammar_ended` (known once read) the rows its sampler flagged: their grammar had ended.
    """

    def __init__(self, seqs: list[Sequence], tokens: Optional[torch.Tensor] = None):
        self.seqs = seqs
        self.row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self.ended: list[Sequence] = []
        self.errors: list[tuple[Sequence, Exception]] = []
        self.grammar_ended: list[int] = []
        self._tokens = None
        if tokens is not None:
            self.start_copy(tokens)

    def start_copy(self, tokens: torch.Tensor) -> None:
        """tokens: (num_seqs,) int64 on the device, the next step's input ids; or (2, num_seqs):
        those, then 1 for each row whose grammar has ended."""
        self._tokens = tokens if tokens.dim() == 1 else tokens[0]
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    @property
    def tokens(self) -> torch.Tensor:
        return self._tokens

    def host_tokens(self) -> list[int]:
        self.tokens  # noqa: B018 (a deferred step samples now)
        if self._ready is not None:
            self._ready.synchronize()
        if self._host.dim() == 1:
            return self._host.tolist()
        tokens, ended = self._host.tolist()
        if any(ended):
            self.grammar_ended = [i for i, e in enumerate(ended) if e]
        return tokens


class DeferredStep(PendingStep):
    """A step with grammar rows whose sampling waits for their masks (the worker's `fill`):
    `sample(self)` runs when the tokens are first asked for."""

    def __init__(self, seqs: list[Sequence], logits: torch.Tensor, fill, sample):
        super().__init__(seqs)
        self.logits, self.fill, self._sample = logits, fill, sample

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._sample(self)
        return self._tokens


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


class AsyncStepLoop(StepLoop):
    """The step loop of async scheduling: its scheduler counts tokens in flight."""

    scheduler_cls = AsyncScheduler

    @staticmethod
    def scheduler_kwargs(config) -> dict:
        return {"max_model_len": config.max_model_len}

    def __init__(self, engine):
        super().__init__(engine)
        self.pending: Optional[PendingStep] = None  # the step whose tokens are not read yet
        self.wait_time = 0.0  # this step's wait for the previous step's tokens (StepRecord)
        from minipaged.structured_output.background import BackgroundFill
        self.fill = BackgroundFill(engine.structured_output)  # grammar rows' masks, off-thread
        engine.structured_output.advance_on_fill = True

    def has_unfinished_requests(self) -> bool:
        """Tokens in flight count only for sequences that are still unfinished (an aborted or
        failed request's pending token is dropped when it is read)."""
        return self.engine.has_unfinished_sequences() or (
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
        self.wait_time = 0.0
        sched = eng.schedule()
        if sched.is_empty:
            if self.pending is None:
                return eng.finish_empty_step(sched, t0)
            outputs, finished = self.read_pending()  # nothing to run, but tokens to read
            return eng.finish_step(sched, outputs, finished, t0, self.wait_time)
        # The forward is queued on the GPU; nothing below waits for it until tokens are read.
        logits = eng.execute_model(sched, self.pending)
        sampling = eng.update_computed(sched)
        defer = bool(sampling) and self.can_defer(sampling)
        if defer and any(s.sampling_params.structured_outputs is not None for s in sampling):
            # Masks need the tokens before them: read the previous step's tokens (the forward
            # keeps running), then fill on the worker; sampled when the tokens are needed.
            pin = logits.is_cuda
            fills = []  # started as soon as the tokens are read, before they are processed
            outputs, finished = self.read_pending(
                lambda pending, tokens: fills.append(self.fill.start(
                    sampling, pin, just_read=(pending, tokens))))
            fill = fills[0] if fills else self.fill.start(sampling, pin)
            self.pending_step(DeferredStep(sampling, logits, fill, self.sample_deferred))
            return eng.finish_step(sched, outputs, finished, t0, self.wait_time)
        pending = self.sample(logits, sampling) if defer else None
        if pending is not None:
            outputs, finished = self.read_pending()  # while this step runs
            self.pending_step(pending)
            return eng.finish_step(sched, outputs, finished, t0, self.wait_time)
        self.fill.wait()  # the matchers are the main thread's again
        outputs, finished = self.read_pending()  # this step needs them all
        self.finish_ended(sampling, outputs, finished)
        more_outputs, more_finished = eng.sample_and_process(logits, sampling)
        return eng.finish_step(sched, outputs + more_outputs, finished + more_finished, t0,
                               self.wait_time)

    def pending_step(self, pending: PendingStep) -> None:
        """This step's tokens are in flight: counted, and read during the next step."""
        for seq in pending.seqs:
            self.engine.scheduler.token_sampled(seq)
        # Sequences that stopped meanwhile need nothing from this step: if none is left,
        # there is nothing to read (has_unfinished_requests stays honest).
        if any(not s.is_finished for s in pending.seqs):
            self.pending = pending
        else:
            for seq in pending.seqs:
                self.engine.scheduler.token_read(seq)

    def sample(self, logits: torch.Tensor, sampling: list[Sequence]) -> Optional[PendingStep]:
        """This step's tokens (no grammar rows), left on the device. None if the sampler
        raised: the step is then sampled again synchronously, where a row that raises fails
        alone (engine/failures.py)."""
        generators = failures.save_generators(sampling)
        try:
            return PendingStep(sampling, self.engine.sampler.sample(logits, sampling))
        except Exception:
            failures.restore_generators(generators)  # the retry draws what this call drew
            return None

    def sample_deferred(self, step: DeferredStep) -> None:
        """Sample a deferred step once its masks are filled: on the device, as `sample` does,
        the masks applied inside the sampling kernels where they apply (else to the logits
        first). If the sampler raises, each row is sampled alone (synchronously) and the rows
        that raise fail when the step is read; rows whose grammar ended or raised get token 0,
        dropped when read."""
        eng = self.engine
        mgr = eng.structured_output
        rows, step.ended, step.errors = step.fill.result()
        logits, seqs = step.logits, step.seqs
        step.logits = step.fill = None
        generators = failures.save_generators(seqs)
        try:
            mask = mgr.token_mask(rows, len(seqs), logits.device) if rows else None
            out = None if mask is None else eng.sampler.sample_masked(logits, seqs, mask)
            if out is None:
                tokens = eng.sampler.sample(  # (the bitmask is on the device already)
                    mgr.apply_bitmask(logits, rows, None if mask is None else mask.bitmask),
                    seqs)
                out = tokens if mask is None else torch.stack((tokens, ended_rows(mask)))
        except Exception:
            if rows:  # the rows the kernels would have flagged (from the host's bitmask)
                ended = ended_rows(mgr.token_mask(rows, len(seqs), torch.device("cpu")))
                step.ended += [seqs[i] for i in ended.nonzero().flatten().tolist()]
            skip = {id(s) for s in step.ended} | {id(s) for s, _ in step.errors}
            keep = [i for i, s in enumerate(seqs) if id(s) not in skip]

            def masked(row_logits, row_seqs):  # the worker is done: fill on this thread
                return eng.sampler(mgr.apply_masks(row_logits, row_seqs), row_seqs)
            done, failed = failures.sample_rows_alone(masked, logits[keep],
                                                      [seqs[i] for i in keep], generators)
            step.errors += failed
            token_of = {id(s): out.token_ids[0] for s, out in done}
            out = torch.tensor([token_of.get(id(s), 0) for s in seqs], dtype=torch.int64,
                               device=logits.device)
        step.start_copy(out)

    def finish_ended(self, seqs: list[Sequence], outputs: list[RequestOutput],
                     finished: list[str]) -> None:
        """Before a synchronous step samples: finish ("stop") the grammar rows whose grammar
        has ended (their matchers advance here, since `accept` leaves them to the fill)."""
        mgr = self.engine.structured_output
        for seq in seqs:
            if (getattr(seq.sampling_params, "structured_outputs", None) is None
                    or seq.is_finished):  # (beam search's params have none)
                continue
            try:
                if mgr.caught_up_and_ended(seq):
                    self.finish_stopped(seq, outputs, finished)
            except Exception as exc:  # this request's grammar: it fails alone
                failures.fail_request(self.engine, seq, exc, outputs, finished)

    def finish_stopped(self, seq: Sequence, outputs: list[RequestOutput],
                       finished: list[str]) -> None:
        """End `seq`, its grammar done, as `LLMEngine.process_tokens` ends a sequence that stops:
        its request with it, or, one of n samples, with the group's last."""
        eng = self.engine
        seq.finished_time = time.time()
        eng.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        group = seq.group
        if group is not None and not group.is_finished:
            return
        outputs.append(eng.output_processor.make_output(seq) if group is None
                       else eng.output_processor.make_group_output(group, None))
        eng.requests.pop(seq.request_id, None)
        eng.groups.pop(seq.request_id, None)
        finished.append(seq.request_id)

    def read_pending(self, before_process=None) -> tuple[list[RequestOutput], list[str]]:
        """Read the previous step's tokens and process them as a synchronous step would have.
        `before_process(pending, tokens)` runs between the two (it starts the next fill)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return [], []
        t0 = time.perf_counter()
        tokens = pending.host_tokens()  # waits for that step only; the current one keeps running
        self.wait_time += time.perf_counter() - t0
        for seq in pending.seqs:
            self.engine.scheduler.token_read(seq)
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        for seq, exc in pending.errors:  # a deferred step's rows: before any token is appended
            if not seq.is_finished:
                failures.fail_request(self.engine, seq, exc, outputs, finished)
        for seq in pending.ended + [pending.seqs[i] for i in pending.grammar_ended]:
            if not seq.is_finished:
                self.finish_stopped(seq, outputs, finished)
        if before_process is not None:
            before_process(pending, tokens)
        self.engine.process_tokens(pending.seqs, SamplerOutput(token_ids=tokens), outputs, finished)
        return outputs, finished
