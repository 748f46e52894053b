"""Grammar masks filled on a worker thread while the host plans the next step (lesson 12).

Under async scheduling (worker/async_scheduling.py) a step with grammar-constrained rows cannot
sample right after its forward: a row's mask needs the row's previous token, which the host
reads only then. Filling the masks on the main thread (about 1 ms for 64 rows of a 152k-token
vocabulary) would put that work into every step of a host that is already the bottleneck at
small batches. So the fill moves to one worker thread, and the step's sampling waits until the
next step needs its tokens:

    step t     launch forward t; read tokens t-1; advance each row's matcher by its token
               (about a microsecond per row, in C++); start the worker; append tokens t-1
               (stop checks, outputs)
    worker       fill the rows' bitmasks: one call, on xgrammar's C++ threads, the GIL
                 released (Python code on the worker would wait for the main thread's GIL)
    step t+1   schedule t+1 and build its inputs (the worker runs meanwhile); wait for the
               worker; sample step t with the masks applied inside the sampling kernels, which
               also flag the rows whose mask allows stop tokens only; launch forward t+1; ...

A grammar has ended when nothing but a stop token may follow: either its last token was a stop
token (found here, before the fill, which would refuse such a matcher) or its mask allows stop
tokens only (found by the kernels, or by `manager.ended_rows`). Either way the request finishes
("stop") when the step is read, before that step's token is appended, so the output is a
synchronous step's.

While the batch stays the same from one step to the next (the common case: no request joined,
finished or was preempted), the rows, their matchers and the lists handed to the worker are
those of the last step (`_Plan`), and advancing them is one call per row. The main thread
touches no matcher and no bitmask buffer while the worker runs: every path that does waits for
it first (`wait`, or the job that `start` returns).
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import NamedTuple, Optional, Sequence as Seq

from minipaged.engine.sequence import Sequence
from minipaged.structured_output.manager import rejected_token


class FillResult(NamedTuple):
    rows: list[int]  # rows of the step whose bitmask row is filled
    ended: list[Sequence]  # grammar ended on the token before this step's: finish, drop it
    errors: list[tuple[Sequence, Exception]]  # rows whose grammar raised: they fail alone


class _Plan(NamedTuple):
    """One step's constrained rows that were filled, kept for the next step if it is the same."""
    seqs: list[Sequence]  # the step's rows (the list the step was built with)
    rows: list[int]  # rows of `seqs` to fill
    states: list  # their manager._Matcher (matcher, num_accepted), caught up with the rows
    matchers: list  # their xgrammar matchers, the worker's argument
    accepts: list  # their matchers' accept_token


class FillJob:
    """The worker's fill of one step: `result()` waits for it. The main thread prepares the
    job's lists after handing it over (the worker wakes up meanwhile) and releases `ready`; the
    worker releases `begun` just before the fill, `done` after it."""

    def __init__(self):
        self.ready, self.begun, self.done = (threading.Lock(), threading.Lock(),
                                             threading.Lock())
        for lock in (self.ready, self.begun, self.done):
            lock.acquire()
        self.rows: list[int] = []
        self.matchers: list = []
        self.states: list = []
        self.seqs: list[Sequence] = []  # by row: the sequence (for a fill that raises)
        self.ended: list[Sequence] = []
        self.errors: list[tuple[Sequence, Exception]] = []
        self.started = False
        self.failure: Optional[Exception] = None

    def result(self) -> FillResult:
        with self.done:
            pass
        if self.failure is not None:  # the worker raised outside a row's fill
            self.errors += [(self.seqs[i], self.failure) for i in self.rows]
            self.rows, self.failure = [], None
        return FillResult(self.rows, self.ended, self.errors)


def _worker(jobs: "queue.SimpleQueue[Optional[tuple]]") -> None:
    """The worker thread: runs each (manager, job) until handed None."""
    while (item := jobs.get()) is not None:
        mgr, job = item
        try:
            with job.ready:  # the main thread has finished the job's lists
                pass
            job.started = True
            job.begun.release()
            if job.rows:
                _fill(mgr, job)
        except BaseException as exc:  # noqa: BLE001 (the job's rows fail, alone; the thread
            job.failure = exc  # goes on: a start() waiting for it would wait for ever)
        finally:
            if not job.started:
                job.begun.release()
            job.done.release()
        del item, mgr, job


def _fill(mgr, job: FillJob) -> None:
    try:
        # (rows, ceil(vocab / 32)) int32: bit t % 32 of word t // 32 of row i = token t allowed
        mgr._batch.batch_fill_next_token_bitmask(job.matchers, mgr._bitmask, indices=job.rows)
    except Exception:  # find the row: one at a time
        rows, job.rows = job.rows, []
        for i, st in zip(rows, job.states):
            try:
                st.matcher.fill_next_token_bitmask(mgr._bitmask, i)
                job.rows.append(i)
            except Exception as exc:
                job.errors.append((job.seqs[i], exc))


class BackgroundFill:
    def __init__(self, manager):
        self.manager = manager  # StructuredOutputManager: matchers and host buffers
        self._jobs: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None
        self._last: Optional[FillJob] = None
        self._plan: Optional[_Plan] = None

    def start(self, seqs: Seq[Sequence], pin: bool,
              just_read: Optional[tuple] = None) -> FillJob:
        """Main thread: advance each constrained, unfinished row's matcher by the tokens it has
        not accepted yet, find the grammars that accepted a stop token (the sampling kernels
        find the others, whose masks allow stop tokens only), and start the worker on the other
        rows' fill. Row i of the bitmask is `seqs[i]`. `just_read`: (a PendingStep, its tokens),
        read but not appended yet: each sequence's token there is about to be appended, so it is
        accepted too (a sequence that stops meanwhile has its row filled in vain). Returns the
        job."""
        self.wait()
        mgr = self.manager
        if self._thread is None or not self._thread.is_alive():
            jobs = queue.SimpleQueue()
            thread = threading.Thread(target=_worker, args=(jobs,), daemon=True,
                                      name="minipaged-grammar")
            thread.start()
            self._jobs, self._thread = jobs, thread
            weakref.finalize(self, jobs.put, None)  # the thread ends with this object
        job = self._last = FillJob()
        self._jobs.put((mgr, job))  # the worker wakes up while the lists are made
        try:
            plan = self._plan
            if (plan is not None and just_read is not None and just_read[0].seqs is plan.seqs
                    and seqs == plan.seqs and mgr.stop_ids.isdisjoint(just_read[1])):
                self._advance_same_batch(seqs, plan, just_read[1], job)
            else:
                self._advance(seqs, just_read, job)
            if job.rows:
                try:
                    mgr.prepare_buffers(len(seqs), pin)
                except Exception as exc:  # no buffers: the rows fail, each request alone
                    job.errors += [(seqs[i], exc) for i in job.rows]
                    job.rows, self._plan = [], None
        finally:
            job.ready.release()
        # The worker needs the GIL to begin, and the main thread's pure-Python work that follows
        # (appending tokens, scheduling) would not give it up for milliseconds: wait (GIL
        # released) until the worker is about to enter the fill, which then releases it.
        while not job.begun.acquire(timeout=1.0):
            if not self._thread.is_alive():  # (it cannot end while it has jobs: a safeguard)
                raise RuntimeError("the grammar worker thread has ended")
        return job

    def _advance_same_batch(self, seqs: Seq[Sequence], plan: _Plan, tokens: list[int],
                            job: FillJob) -> None:
        """The rows are the last step's, each matcher caught up but for its token in `tokens`."""
        job.seqs = seqs
        failed = False
        for i, st, accept in zip(plan.rows, plan.states, plan.accepts):
            try:
                if not accept(tokens[i]):
                    raise rejected_token(seqs[i], tokens[i], st.num_accepted)
                st.num_accepted += 1
            except Exception as exc:  # this request's grammar: it fails alone
                job.errors.append((seqs[i], exc))
                failed = True
        if not failed:
            job.rows, job.matchers, job.states = plan.rows, plan.matchers, plan.states
            self._plan = plan._replace(seqs=seqs)
            return
        bad = {id(seq) for seq, _ in job.errors}
        for i, st in zip(plan.rows, plan.states):
            if id(seqs[i]) not in bad:
                job.rows.append(i)
                job.states.append(st)
                job.matchers.append(st.matcher)
        self._plan = None

    def _advance(self, seqs: Seq[Sequence], just_read, job: FillJob) -> None:
        """Any batch: each row's matcher found (or made) and caught up with its tokens."""
        mgr = self.manager
        row_of, tokens = ({}, None) if just_read is None else (just_read[0].row_of,
                                                                just_read[1])
        job.seqs = seqs
        for i, seq in enumerate(seqs):
            if seq.sampling_params.structured_outputs is None or seq.is_finished:
                continue
            try:
                st = mgr.matcher_of(seq)
                new = seq.output_token_ids[st.num_accepted:]
                j = row_of.get(seq.seq_id)
                if j is not None:
                    new = new + [tokens[j]]
                for token in new:
                    if not st.matcher.accept_token(token):
                        raise rejected_token(seq, token, st.num_accepted)
                    st.num_accepted += 1
                if st.matcher.is_terminated():  # it accepted a stop token
                    job.ended.append(seq)
                    continue
                job.rows.append(i)
                job.states.append(st)
                job.matchers.append(st.matcher)
            except Exception as exc:  # this request's grammar: it fails alone
                job.errors.append((seq, exc))
        self._plan = (_Plan(seqs, job.rows, job.states, job.matchers,
                            [m.accept_token for m in job.matchers])
                      if not job.ended and not job.errors else None)

    def wait(self) -> None:
        """Until the worker has finished its last job (its result stays with the job)."""
        if self._last is not None:
            self._last.result()
            self._last = None
