"""`AsyncLLMEngine`: the `LLMEngine` stepped by one background thread, fed by many HTTP requests.
Lesson 07 explains it.

`LLMEngine` is a plain synchronous object and not thread-safe. The server needs it to run
continuously while the web framework's event loop accepts new requests and streams tokens back.
The split:

    event loop thread (uvicorn/FastAPI)            engine thread (this file, `_run`)
    ──────────────────────────────────             ───────────────────────────────────────────
    submit(): put ("add", ...) on `_commands`  ──▶  drain `_commands`: tokenize, add_request,
              await the reply future           ◀──    reply (prompt ids, or the RequestError)
    RequestStream: `await queue.get()`         ◀──  step(); every RequestOutput goes to its
                                                      request's asyncio.Queue (call_soon_threadsafe)
    client gone: abort() puts ("abort", ids)   ──▶  drain: engine.abort_request -> blocks freed

Only the engine thread ever touches the `LLMEngine` (and its tokenizer), so it needs no lock:
additions and aborts wait in a thread-safe queue until the thread drains it between two steps.
While nothing is running the thread sleeps on an `Event` that `submit` and `abort` set.

`engine.stream_outputs = True` makes `step()` return a `RequestOutput` (text so far included) for
every request that got a token, not only for finished ones: that is what streaming sends.
The thread also feeds the Prometheus metrics (metrics.py): queue sizes, KV blocks in use,
preemptions, token counters, time to first token and inter-token latency.

Both threads need Python's GIL, so they take turns (torch releases it inside its kernels, which is
where a big model spends its time; stories260K's kernels are tiny). vLLM goes one step further and
runs the engine in a separate *process* (EngineCore), talking to the API server over ZeroMQ.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

from minipaged.engine.llm_engine import LLMEngine, RequestError
from minipaged.engine.output import detokenize
from minipaged.engine.output import RequestOutput
from minipaged.sampling import SamplingParams
from minipaged.server.metrics import Metrics

logger = logging.getLogger("minipaged.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a bug in a step, or the server is shutting down)."""


@dataclass
class TextPrompt:
    """Text that the engine thread tokenizes. Chat prompts come out of the chat template with
    their special tokens already in place, so they use `add_special_tokens=False`."""

    text: str
    add_special_tokens: bool = True


PromptInput = Union[str, list[int], TextPrompt]


@dataclass
class _Tracked:
    """What the engine thread remembers about one engine request it is serving."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_tokens: int = 0
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None


class RequestStream:
    """The outputs of one HTTP request, which may be several engine requests (`n` > 1, or a list
    of prompts). Iterate it for `(index, RequestOutput)` pairs; it ends when all are finished.
    `abort()` cancels whatever has not finished (idempotent, safe in a `finally`)."""

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str], out_queue: asyncio.Queue,
                 prompt_token_ids: list[list[int]]):
        self.request_ids = request_ids
        self.prompt_token_ids = prompt_token_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue = out_queue
        self._engine = engine
        self._unfinished = set(request_ids)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, metrics: Optional[Metrics] = None):
        self.engine = engine
        engine.stream_outputs = True
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.dead: Optional[BaseException] = None
        self._ids = itertools.count()
        self._preemptions_seen = engine.scheduler.num_preemptions
        self._token_text: dict[int, str] = {}
        self._anchor: Optional[list[int]] = None
        if metrics is not None:
            metrics.kv_cache_blocks_total.set(engine.block_manager.num_blocks)
            self._update_gauges()

    # --- life cycle (event loop side) -------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minipaged-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # --- requests (event loop side) ---------------------------------------------------------
    async def submit(self, prompts: list[PromptInput], params: list[SamplingParams],
                     request_id: Optional[str] = None) -> RequestStream:
        """Queue one engine request per (prompt, params) pair and wait until the engine thread
        has accepted them all. Raises `RequestError` (nothing stays queued) if any is refused."""
        if self.dead is not None or not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.dead or 'not started'})")
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        base = request_id or f"req-{next(self._ids)}"
        ids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        arrival = time.time()
        futures = []
        for rid, prompt, sp in zip(ids, prompts, params):
            fut = loop.create_future()
            self._commands.put(("add", rid, prompt, sp, loop, out_queue, fut, arrival))
            futures.append(fut)
        self._wake.set()
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:  # cancelled: the client left while we waited
            self.abort(ids)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort(ids)
            raise errors[0]
        return RequestStream(self, ids, out_queue, results)

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests (unknown or finished ids are ignored); their KV blocks are freed
        before the engine's next step."""
        self._commands.put(("abort", list(request_ids)))
        self._wake.set()

    # --- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stopping:
                self._wake.clear()
                self._drain_commands()
                if not eng.has_unfinished_requests():
                    self._update_gauges()
                    self._wake.wait(timeout=1.0)
                    continue
                outputs = eng.step()
                self._dispatch(outputs)
                self._update_gauges()
            error: BaseException = EngineDeadError("the server is shutting down")
        except BaseException as e:  # a bug in a step: fail every request, keep the server up
            logger.exception("the engine thread crashed")
            self.dead = error = e
        self.dead = self.dead or error
        self._fail_everything(error)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])

    def _add(self, rid, prompt, params, loop, out_queue, fut, arrival) -> None:
        eng = self.engine
        try:
            token_ids = self._tokenize(prompt)
            n, max_len = len(token_ids), eng.config.max_model_len
            too_long = params.max_tokens is not None and n + params.max_tokens > max_len
            if too_long and 0 < n < max_len:  # (n >= max_len: add_request explains that case)
                raise RequestError(
                    f"This model's maximum context length is {max_len} tokens (max_model_len), but "
                    f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                    f"{params.max_tokens} for the completion). Lower max_tokens to at most "
                    f"{max_len - n}, shorten the prompt, or start the server with a larger "
                    f"--max-model-len.")
            eng.add_request(rid, token_ids, params, arrival_time=arrival)
        except Exception as e:  # RequestError (too long, bad ids, no tokenizer) or tokenizer error
            self._post(loop, _set_future, fut, None, e)
            return
        self._tracked[rid] = _Tracked(loop, out_queue, arrival)
        self._post(loop, _set_future, fut, token_ids, None)

    def _tokenize(self, prompt: PromptInput) -> list[int]:
        eng = self.engine
        if isinstance(prompt, TextPrompt):
            if not prompt.add_special_tokens and eng.tokenizer is not None:
                return list(eng.tokenizer(prompt.text, add_special_tokens=False).input_ids)
            return list(eng.tokenize(prompt.text))
        if isinstance(prompt, str):
            return list(eng.tokenize(prompt))  # exactly what LLM.generate does with a string
        return list(prompt)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None:
                self.engine.abort_request(rid)  # frees its blocks now
                if self.metrics is not None:
                    self.metrics.request_finished("abort")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Metrics per output, then hand each output to its request's queue (one callback per
        event loop per step, not one per token)."""
        now = time.time()
        m = self.metrics
        by_loop: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            comp = out.outputs[0]
            n = len(comp.token_ids)
            new = n - t.num_tokens
            if new > 0:
                if t.first_token_time is None:
                    t.first_token_time = now
                    if m is not None:
                        m.time_to_first_token.observe(now - t.arrival)
                        m.prompt_tokens.inc(len(out.prompt_token_ids))
                elif m is not None:
                    m.inter_token_latency.observe((now - t.last_token_time) / new)
                if m is not None:
                    m.generation_tokens.inc(new)
                if comp.logprobs is not None:
                    comp.logprobs = list(comp.logprobs[:n])  # a snapshot: the engine's list grows
                    for entry in comp.logprobs[t.num_tokens:]:
                        for tid, lp in entry.items():
                            if lp.decoded_token is None:
                                lp.decoded_token = self.token_text(tid)
                t.num_tokens, t.last_token_time = n, now
            if out.finished:
                del self._tracked[out.request_id]
                if m is not None:
                    m.request_finished(comp.finish_reason or "stop")
                    m.e2e_request_latency.observe(now - t.arrival)
            by_loop[t.loop].append((t.queue, out))
        for loop, items in by_loop.items():
            self._post(loop, _deliver, items)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (engine thread only: it uses the tokenizer).

        Decoded after an anchor token and cut off again, so sentencepiece keeps the leading
        space ("▁went" -> " went") that decoding the token alone would drop."""
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.tokenizer
            if tok is None:
                text = f"token_id:{token_id}"
            else:
                if self._anchor is None:
                    self._anchor = list(tok("a", add_special_tokens=False).input_ids)[-1:]
                text = detokenize(tok, self._anchor, [token_id], skip_special=False)
            self._token_text[token_id] = text
        return text

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        sched, bm = self.engine.scheduler, self.engine.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        m.num_requests_running.set(len(sched.running))
        m.num_requests_waiting.set(len(sched.waiting))
        m.kv_cache_blocks_used.set(used)
        m.kv_cache_usage_perc.set(used / bm.num_blocks)
        if sched.num_preemptions > self._preemptions_seen:
            m.num_preemptions.inc(sched.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = sched.num_preemptions

    def _fail_everything(self, error: BaseException) -> None:
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine thread crashed: {error!r}")
        while True:  # requests that were never added
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._post(cmd[4], _set_future, cmd[6], None, dead)
        for rid, t in list(self._tracked.items()):
            self._post(t.loop, _deliver, [(t.queue, dead)])
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine may be in any state after a crash
                pass
        self._tracked.clear()

    def _post(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            if fn is _deliver:
                self._abort([o.request_id for _, o in args[0] if isinstance(o, RequestOutput)])


# --- run on the event loop (scheduled with call_soon_threadsafe) -----------------------------
def _set_future(fut: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if fut.done():  # the waiting request was cancelled; submit() aborts it
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, out in items:
        q.put_nowait(out)
