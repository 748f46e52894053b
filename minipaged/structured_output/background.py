"""Grammar masks filled on a worker thread while the host plans the next step (lesson 12).

Under async scheduling (async_sched/step_loop.py) a step with grammar-constrained rows cannot
sample right after its forward: a row's mask needs the row's previous token, which the host
reads only then. Filling the masks on the main thread (about 1 ms for 64 rows of a 152k-token
vocabulary) would put that work into every step of a host that is already the bottleneck at
small batches. So the fill moves to one worker thread, and the step's sampling waits until the
next step needs its tokens:

    step t     launch forward t; read tokens t-1; advance the rows' matchers by their tokens
               (one batched call into xgrammar's C++, batch_calls.py: a few microseconds per
               row); start the worker; append tokens t-1 (stop checks, outputs)
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
those of the last step (`_Plan`), and advancing them is the one batched call. When the batch
has changed, the rows whose matcher lacks only the token just read still share one batched
call; new rows and rows that are behind (a synchronous step came between) accept their tokens
one by one. A batched call that raises may have moved some matchers: theirs are made again from
their tokens, one row at a time, so the row at fault fails alone. The main thread
touches no matcher and no bitmask buffer while the worker runs: every path that does waits for
it first (`wait`, or the job that `start` returns).
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import NamedTuple, Optional, Sequence as Seq

from minipaged.engine.sequence import Sequence
from minipaged.structured_output.batch_calls import BatchCalls
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
    calls: BatchCalls  # their matchers' batched accept and fill (the worker's argument)


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
        self.states: list = []  # by entry of `rows`: its manager._Matcher
        self.calls: Optional[BatchCalls] = None  # their matchers' (made by start())
        self.seqs: list[Sequence] = []  # by row: the sequence (for a fill that raises)
        self.ended: list[Sequence] = []
        self.errors: list[tuple[Sequence, Exception]] = []
        self.started = False
        self.failure: Optional[Exception] = None

    def add(self, row: int, st) -> None:
        """Row `row`, its matcher `st` caught up, is to be filled."""
        self.rows.append(row)
        self.states.append(st)

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
        mgr.fill_rows(job.calls, job.rows)
    except Exception:  # find the row: one at a time
        rows, job.rows = job.rows, []
        for i, st in zip(rows, job.states):
            try:
                mgr.fill_row(st.matcher, i)
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
            plan, self._plan = self._plan, None
            if (plan is not None and just_read is not None and just_read[0].seqs is plan.seqs
                    and seqs == plan.seqs and mgr.stop_ids.isdisjoint(just_read[1])):
                keep = self._advance_same_batch(seqs, plan, just_read, job)
            else:
                keep = self._advance(seqs, just_read, job)
            if job.rows:
                try:
                    mgr.prepare_buffers(len(seqs), pin)
                    if job.calls is None:  # (the same batch's are the plan's)
                        job.calls = BatchCalls([st.matcher for st in job.states])
                except Exception as exc:  # no buffers: the rows fail, each request alone
                    job.errors += [(seqs[i], exc) for i in job.rows]
                    job.rows, keep = [], False
            if keep and job.rows:  # for the next step, if its rows are these
                self._plan = _Plan(seqs, job.rows, job.states, job.calls)
        finally:
            job.ready.release()
        # The worker needs the GIL to begin, and the main thread's pure-Python work that follows
        # (appending tokens, scheduling) would not give it up for milliseconds: wait (GIL
        # released) until the worker is about to enter the fill, which then releases it.
        while not job.begun.acquire(timeout=1.0):
            if not self._thread.is_alive():  # (it cannot end while it has jobs: a safeguard)
                raise RuntimeError("the grammar worker thread has ended")
        return job

    def _advance_same_batch(self, seqs: Seq[Sequence], plan: _Plan, just_read: tuple,
                            job: FillJob) -> bool:
        """The rows are the last step's, each matcher caught up but for its token in
        `just_read`: one batched accept. True if the rows stay as they were (all accepted)."""
        job.seqs, tokens = seqs, just_read[1]
        done = self._accept_batched(seqs, plan.rows, plan.states, plan.calls,
                                    [tokens[i] for i in plan.rows], job)
        if done:
            job.rows, job.states, job.calls = plan.rows, plan.states, plan.calls
            return True
        if done is None:  # it raised: the rows' matchers made again, one row at a time
            return self._advance(seqs, just_read, job, batched=False)
        return False

    def _advance(self, seqs: Seq[Sequence], just_read, job: FillJob,
                 batched: bool = True) -> bool:
        """Any batch: each row's matcher found (or made) and caught up with its tokens. Rows
        whose matcher lacks only their token in `just_read`, not a stop token, accept it in one
        batched call (if `batched`); the others (new rows, rows behind) one token at a time.
        True if no grammar ended or raised (the rows can be kept for the next step)."""
        mgr = self.manager
        row_of, tokens = ({}, None) if just_read is None else (just_read[0].row_of,
                                                                just_read[1])
        job.seqs = seqs
        rows, states, picked = [], [], []  # for the batched accept
        for i, seq in enumerate(seqs):
            if seq.sampling_params.structured_outputs is None or seq.is_finished:
                continue
            try:
                st = mgr.matcher_of(seq)
                j = row_of.get(seq.seq_id)
                token = None if j is None else tokens[j]
                if (batched and token is not None and token not in mgr.stop_ids
                        and st.num_accepted == len(seq.output_token_ids)):
                    rows.append(i)
                    states.append(st)
                    picked.append(token)
                else:
                    self._catch_up(seqs, i, st, token, job)
            except Exception as exc:  # this request's grammar: it fails alone
                job.errors.append((seq, exc))
        if rows:
            done = self._accept_batched(seqs, rows, states,
                                        BatchCalls([st.matcher for st in states]), picked, job)
            if done:
                job.rows += rows
                job.states += states
            elif done is None:  # it raised: those rows' matchers made again, one at a time
                for i, token in zip(rows, picked):
                    try:
                        self._catch_up(seqs, i, mgr.matcher_of(seqs[i]), token, job)
                    except Exception as exc:  # this request's grammar: it fails alone
                        job.errors.append((seqs[i], exc))
        return not job.ended and not job.errors

    def _catch_up(self, seqs: Seq[Sequence], i: int, st, token: Optional[int],
                  job: FillJob) -> None:
        """Row i's matcher accepts, one by one, its sequence's tokens it has not accepted, then
        `token` (read, not appended yet) if any; then ends the row or adds it to the fill."""
        seq = seqs[i]
        new = seq.output_token_ids[st.num_accepted:]
        for t in new if token is None else new + [token]:
            if not st.matcher.accept_token(t):
                raise rejected_token(seq, t, st.num_accepted)
            st.num_accepted += 1
        if st.matcher.is_terminated():  # it accepted a stop token
            job.ended.append(seq)
            return
        job.add(i, st)

    def _accept_batched(self, seqs: Seq[Sequence], rows: list[int], states: list,
                        calls: BatchCalls, picked: list[int], job: FillJob) -> Optional[bool]:
        """Row rows[k]'s matcher (states[k], caught up) accepts picked[k], in one call. True if
        all did (the caller adds the rows to the fill); False if some refused theirs: those
        requests fail, alone, and the others join the fill; None if the call raised: some
        matchers may have moved, so the rows' are dropped, to be made again from their tokens."""
        try:
            refused = calls.accept(picked)
        except Exception:
            for i in rows:
                self.manager.forget(seqs[i])
            return None
        if not refused:
            for st in states:
                st.num_accepted += 1
            return True
        refused = set(refused)
        for k, (i, st) in enumerate(zip(rows, states)):
            if k in refused:  # this request's grammar refused its token: it fails alone
                job.errors.append((seqs[i], rejected_token(seqs[i], picked[k], st.num_accepted)))
            else:
                st.num_accepted += 1
                job.add(i, st)
        return False

    def wait(self) -> None:
        """Until the worker has finished its last job (its result stays with the job)."""
        if self._last is not None:
            self._last.result()
            self._last = None
