"""Grammar masks filled on a worker thread while the host plans the next step (lesson 12).

Under async scheduling (worker/async_scheduling.py) a step with grammar-constrained rows cannot
sample right after its forward: a row's mask needs the row's previous token, which the host
reads only then. Filling the masks on the main thread (about 1 ms for 64 rows of a 152k-token
vocabulary) would put that work into every step of a host that is already the bottleneck at
small batches. So the fill moves to one worker thread, and the step's sampling waits until the
next step needs its tokens:

    step t     launch forward t; read tokens t-1; advance each row's matcher by its token and
               note the grammars that ended (microseconds per row); start the worker; append
               tokens t-1 (stop checks, outputs)
    worker       fill the rows' bitmasks: one call, on xgrammar's C++ threads, the GIL
                 released (Python code on the worker would wait for the main thread's GIL)
    step t+1   schedule t+1 and build its inputs (the worker runs meanwhile); wait for the
               worker; apply the masks and sample step t; launch forward t+1; ...

The main thread touches no matcher and no bitmask buffer while the worker runs: every path that
does waits for it first (`wait`, or the `Future` that `start` returns). A grammar found ended is
reported with its step, whose token for that row is then dropped and the request finished
("stop") before that token is appended, so the output is a synchronous step's.
"""
from __future__ import annotations

import threading
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
        """Main thread: advance each constrained, unfinished row's matcher by the tokens it has
        not accepted yet (a microsecond or two each, in C++), note the grammars that ended, and
        start the worker on the other rows' fill. Row i of the bitmask is `seqs[i]`.
        `just_read`: a step's (row_of, tokens), read but not appended yet: each sequence's
        token there is about to be appended, so it is accepted too (a sequence that stops
        meanwhile has its row filled in vain). Returns the Future of the FillResult."""
        self.wait()
        mgr = self.manager
        fill: list[tuple[int, Sequence, object]] = []
        ended: list[Sequence] = []
        errors: list[tuple[Sequence, Exception]] = []
        for i, seq in enumerate(seqs):
            if seq.sampling_params.structured_outputs is None or seq.is_finished:
                continue
            try:
                st = mgr.matcher_of(seq)
                tokens = seq.output_token_ids[st.num_accepted:]
                if just_read is not None and seq.seq_id in just_read[0]:
                    tokens = tokens + [just_read[1][just_read[0][seq.seq_id]]]
                for token in tokens:
                    if not st.matcher.accept_token(token):
                        raise rejected_token(seq, token, st.num_accepted)
                    st.num_accepted += 1
                (ended.append(seq) if mgr.has_ended(st) else fill.append((i, seq, st)))
            except Exception as exc:  # this request's grammar: it fails alone
                errors.append((seq, exc))
        if fill:
            mgr.prepare_buffers(len(seqs), pin)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minipaged-grammar")
        # The worker needs the GIL to begin, and the main thread's pure-Python work that follows
        # (appending tokens, scheduling) would not give it up for milliseconds: wait (GIL
        # released) until the worker is about to enter the fill, which then releases it.
        begun = threading.Event()
        self._last = self._pool.submit(self._run, fill, ended, errors, begun)
        begun.wait()
        return self._last

    def wait(self) -> None:
        """Until the worker has finished its last job (its result stays with its Future)."""
        if self._last is not None:
            self._last.exception()  # waits; an error is the Future's, not ours
            self._last = None

    def _run(self, fill, ended, errors, begun: threading.Event) -> FillResult:
        """Worker thread: fill the rows' bitmasks (one call; its C++ threads release the GIL)."""
        mgr = self.manager
        try:
            rows = [i for i, _, _ in fill]
            matchers = [st.matcher for _, _, st in fill]
        finally:
            begun.set()
        if rows:
            try:
                # (rows, ceil(vocab / 32)) int32: bit t of row i = token t allowed
                mgr._batch.batch_fill_next_token_bitmask(matchers, mgr._bitmask, indices=rows)
            except Exception:  # find the row: one at a time
                rows = []
                for i, seq, st in fill:
                    try:
                        st.matcher.fill_next_token_bitmask(mgr._bitmask, i)
                        rows.append(i)
                    except Exception as exc:
                        errors.append((seq, exc))
        return FillResult(rows, ended, errors)
