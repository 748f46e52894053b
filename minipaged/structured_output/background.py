"""Grammar masks filled on a worker thread while the host plans the next step (lesson 12).

Under async scheduling (worker/async_scheduling.py) a step with grammar-constrained rows cannot
sample right after its forward: a row's mask needs the row's previous token, which the host
reads only then. Filling the masks on the main thread (about 1 ms for 64 rows of a 152k-token
vocabulary, plus a few microseconds per row to advance each matcher) would put that work into
every step of a host that is already the bottleneck at small batches. So the work moves to one
worker thread, and the step's sampling waits until the next step needs its tokens:

    step t     launch forward t; read and append tokens t-1; start(step t's rows) -> worker
    worker       advance each matcher by its new tokens (one batched call), note the grammars
                 that have ended, fill the other rows' bitmasks (xgrammar's C++ threads; the
                 GIL is released while they run)
    step t+1   schedule t+1 and build its inputs (the worker runs meanwhile); wait for the
               worker; apply the masks and sample step t; launch forward t+1; ...

The main thread touches no matcher and no bitmask buffer while the worker runs: every path that
does waits for it first (`wait`, or the `Future` that `start` returns). A grammar the worker finds
ended is reported with its step, whose token for that row is then dropped and the request
finished ("stop") before that token is appended, so the output is a synchronous step's.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Optional, Sequence as Seq

from minipaged.engine.sequence import Sequence
from minipaged.structured_output.manager import rejected_token


class FillResult(NamedTuple):
    rows: list[int]  # rows of the step whose bitmask row is filled
    ended: list[Sequence]  # grammar ended before this step's token: finish, drop the token
    errors: list[tuple[Sequence, Exception]]  # rows whose grammar raised: they fail alone


class BackgroundFill:
    def __init__(self, manager):
        self.manager = manager  # StructuredOutputManager: matchers and host buffers
        self._pool: Optional[ThreadPoolExecutor] = None
        self._last: Optional[Future] = None

    def start(self, seqs: Seq[Sequence], pin: bool,
              just_read: Optional[tuple[dict[int, int], list[int]]] = None) -> Future:
        """Main thread: take each constrained, unfinished row's matcher and the tokens it has
        not accepted yet, and start the worker on them. Row i of the bitmask is `seqs[i]`.
        `just_read`: a step's (row_of, tokens), read but not appended yet: each sequence's
        token there is about to be appended, so it is accepted too. Returns the Future of the
        FillResult."""
        self.wait()
        mgr = self.manager
        jobs: list[tuple[int, Sequence, object, list[int]]] = []
        errors: list[tuple[Sequence, Exception]] = []
        for i, seq in enumerate(seqs):
            if seq.sampling_params.structured_outputs is None or seq.is_finished:
                continue
            try:
                st = mgr.matcher_of(seq)
            except Exception as exc:  # this request's grammar: it fails alone
                errors.append((seq, exc))
                continue
            tokens = seq.output_token_ids[st.num_accepted:]
            if just_read is not None and seq.seq_id in just_read[0]:
                tokens = tokens + [just_read[1][just_read[0][seq.seq_id]]]
            jobs.append((i, seq, st, tokens))
        if jobs:
            mgr.prepare_buffers(len(seqs), pin)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minipaged-grammar")
        self._last = self._pool.submit(self._run, jobs, errors)
        return self._last

    def wait(self) -> None:
        """Until the worker has finished its last job (its result stays with its Future)."""
        if self._last is not None:
            self._last.exception()  # waits; an error is the Future's, not ours
            self._last = None

    def _run(self, jobs, errors) -> FillResult:
        """Worker thread: advance, find the ends, fill."""
        mgr = self.manager
        xgr = mgr._xgr()
        ok_jobs = []
        singles = [job for job in jobs if len(job[3]) == 1]  # the common case: one new token
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(
            [st.matcher for _, _, st, _ in singles], [toks[0] for *_, toks in singles]
        ) if singles else []
        verdict = {id(job): ok for job, ok in zip(singles, accepted)}
        for job in jobs:
            i, seq, st, tokens = job
            try:
                if id(job) in verdict:
                    if not verdict[id(job)]:
                        raise rejected_token(seq, tokens[0], st.num_accepted)
                    st.num_accepted += 1
                else:  # none yet, or several (a sequence that came back from preemption)
                    for token in tokens:
                        if not st.matcher.accept_token(token):
                            raise rejected_token(seq, token, st.num_accepted)
                        st.num_accepted += 1
                ok_jobs.append(job)
            except Exception as exc:
                errors.append((seq, exc))
        ended, fill = [], []
        for job in ok_jobs:
            (ended if mgr.has_ended(job[2]) else fill).append(job)
        rows = [i for i, *_ in fill]
        if rows:
            try:
                # (rows, ceil(vocab / 32)) int32: bit t of row i = token t allowed
                mgr._batch.batch_fill_next_token_bitmask([st.matcher for _, _, st, _ in fill],
                                                         mgr._bitmask, indices=rows)
            except Exception:  # find the row: one at a time
                rows = []
                for i, seq, st, _ in fill:
                    try:
                        st.matcher.fill_next_token_bitmask(mgr._bitmask, i)
                        rows.append(i)
                    except Exception as exc:
                        errors.append((seq, exc))
        return FillResult(rows, [seq for _, seq, _, _ in ended], errors)

