"""Grammars compiled off the engine's thread: a request waits for its own grammar, and no other
request waits with it (lesson 12).

Compiling a constraint against a vocabulary is usually quick (the structured-outputs benchmark's
JSON schema: 18 ms for a vocabulary of Qwen3's 151,936 tokens), but a spec of a few kilobytes can
take far longer: on 2 CPU cores and that vocabulary, a 13 KB schema of 200 patterned string
fields took 8.9 s, a 2 KB regex of 120 alternatives 28 s
(benchmarks/experiments/structured_outputs/structured_compile_times.py).
Compiled in `add_request`, on the engine's thread, that would stop every running request for as
long. So the compile runs on a worker thread (xgrammar's compiler releases
the GIL while it works):

    add_request      the grammar is cached: the request is queued at once. Otherwise, as its
                     last check, its compile starts and `add_request` waits for it up to
                     QUICK_S (if a worker is free to start it at once): most specs compile in
                     time, and a refusal is still a RequestError there (the server's 400). A
                     request whose compile takes longer, or that joins a compile already
                     running for the same spec, waits here, not in the scheduler.
    each step        before the scheduler plans it (`admit`): the waiting requests whose grammar
                     is ready join the scheduler's queue; those whose compile failed fail alone
                     (finish_reason "error", the library's message; through the server, as any
                     request that fails while it is served).

At most MAX_WORKERS compiles run at once; later ones wait in line (a request for a cached
grammar never does). A compile cannot be interrupted: an aborted request leaves at once, and
its compile finishes for the cache. The vocabulary itself is read on the engine's thread, once,
for the first constrained request (`prepare_compiler`).
"""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import weakref
from typing import Callable, Optional

from minipaged.engine.sequence import Sequence
from minipaged.sampling.structured_outputs import StructuredOutputsParams

QUICK_S = 0.05  # how long add_request waits for a compile before leaving the request waiting
IDLE_S = 0.005  # with nothing else to run, a step waits this long for a compile to finish
MAX_WORKERS = 2


def _worker(jobs: "queue.SimpleQueue[Optional[tuple]]") -> None:
    """A compile thread: runs each (future, function, argument) until handed None. (Daemon
    threads rather than a ThreadPoolExecutor, whose threads the interpreter joins at exit: a
    server stopped during a long compile would wait for it.)"""
    while (job := jobs.get()) is not None:
        future, fn, arg = job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # noqa: BLE001 (the request's: it fails alone)
                future.set_exception(exc)
        del job, future, fn, arg


class GrammarCompiles:
    def __init__(self, manager):
        self.manager = manager  # StructuredOutputManager: the compiler and the cache
        self._jobs: Optional[queue.SimpleQueue] = None  # to MAX_WORKERS compile threads
        self._running: dict[tuple, cf.Future] = {}  # spec key -> its compile
        self.waiting: dict[str, tuple[Sequence, cf.Future]] = {}  # request id -> its compile

    @property
    def busy(self) -> bool:
        """Requests wait, or compiles run (whose grammars `admit` will cache)."""
        return bool(self.waiting or self._running)

    def start(self, params: StructuredOutputsParams) -> Optional[cf.Future]:
        """None if `params`' grammar is compiled (now, or within QUICK_S of starting its
        compile); else its compile, still running. Raises RequestGrammarError if the library
        refused it meanwhile."""
        mgr = self.manager
        if mgr.cached(params) is not None:
            return None
        key = mgr.key(params)
        future = self._running.get(key)
        fresh = future is None  # else it joins that compile, without waiting for it here
        wait = 0.0
        if fresh:
            if sum(not f.done() for f in self._running.values()) < MAX_WORKERS:
                wait = QUICK_S  # a worker starts it at once: worth a short wait
            mgr.prepare_compiler()  # (on this thread: the first call reads the vocabulary)
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                for i in range(MAX_WORKERS):
                    threading.Thread(target=_worker, args=(self._jobs,), daemon=True,
                                     name=f"minipaged-compile-{i}").start()
                # the threads end with this object
                weakref.finalize(self, lambda jobs: [jobs.put(None) for _ in range(MAX_WORKERS)],
                                 self._jobs)
            future = self._running[key] = cf.Future()
            self._jobs.put((future, mgr.compile_uncached, params))
        try:
            compiled = future.result(timeout=wait)
        except cf.TimeoutError:
            return future
        except Exception:
            self._running.pop(key, None)  # refused: the next request with it compiles again
            raise
        self._running.pop(key, None)
        mgr.remember(key, compiled)
        return None

    def hold(self, seq: Sequence, future: cf.Future) -> None:
        """`seq`'s request waits here until its grammar (`future`) is compiled."""
        self.waiting[seq.request_id] = (seq, future)

    def drop(self, request_id: str) -> None:
        """The request is aborted: it stops waiting (its compile still fills the cache)."""
        self.waiting.pop(request_id, None)

    def admit(self, add: Callable[[Sequence], None],
              fail: Callable[[Sequence, Exception], None], idle: bool) -> None:
        """Pass each waiting request whose compile is done to `add` (the scheduler's queue), or
        with the compile's exception to `fail`. `idle`: nothing else can run this step, so
        wait up to IDLE_S for a compile first (rather than spin through empty steps)."""
        if idle and self.waiting:
            cf.wait([f for _, f in self.waiting.values()], timeout=IDLE_S,
                    return_when=cf.FIRST_COMPLETED)
        for key, future in list(self._running.items()):
            if future.done():
                del self._running[key]
                if future.exception() is None:
                    self.manager.remember(key, future.result())
        for request_id, (seq, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[request_id]
            if future.exception() is None:  # (cached above, or when a later request joined it)
                add(seq)
            else:
                fail(seq, future.exception())
