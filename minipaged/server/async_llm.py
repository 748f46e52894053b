"""`AsyncLLM`: the API server's half of the engine (vLLM V1's AsyncLLM). Lesson 07 explains it.

It runs on the HTTP server's event loop and does everything a request needs except the step:

    prompt in    tokenize (or render the chat template) in a worker thread, with a time bound;
                 refuse what can never fit before any heavy work; send `AddRequest` to the core
                 (engine_core.py) and wait for its `Accepted`.
    tokens out   `_on_outputs` reads each `StepOutputs`: appends the new token ids to the
                 request's own `Sequence`s, detokenizes them, looks for stop strings in the new
                 text only (engine/output.py's `OutputProcessor`, the offline engine's code), and
                 aborts a request in the core once a stop string ends it.
    streams      one `RequestStream` per HTTP request (request_stream.py); it is woken once per
                 step with whatever is new, however many tokens that is (a slow client gets them
                 merged, it never makes the engine wait).

A request's failure stays its own: an error the core reports for one request ends that request;
only a dead core (`Dead`, or its process gone) fails everything, and /health says so.
`drain()` is the graceful shutdown: refuse new requests, let the running ones finish for a while,
then end the rest with an error their clients can read.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import RequestError
from minipaged.engine.output import OutputProcessor, detokenize
from minipaged.engine.processor import check_priority
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.models.loader import load_tokenizer, resolve_model
from minipaged.sampling import Logprob, SamplingParams
from minipaged.server.engine_core import EngineCoreClient
from minipaged.lora.request import LoRARequest
from minipaged.server.messages import (AbortRequests, Accepted, AddRequest, Dead, RequestDelta,
                                       StepOutputs)
from minipaged.server.metrics import Metrics
from minipaged.server.request_stream import PromptInput, RequestState, RequestStream, TextPrompt

logger = logging.getLogger("minipaged.server")


class EngineDeadError(RuntimeError):
    """The engine core stopped (a bug in a step, or the server is shutting down)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, metrics: Optional[Metrics] = None, *,
                 in_process: bool = False, preprocess_timeout: float = 30.0):
        self.source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.metrics = metrics
        self.preprocess_timeout = preprocess_timeout
        self.client = EngineCoreClient(config, in_process=in_process)
        self.info = self.client.wait_ready()  # the model loads in the core; errors raise here
        self.config = EngineConfig(**self.info["config"])  # as the core resolved it
        cfg = self.config
        self.processor = OutputProcessor(self.tokenizer, self.info["eos_token_ids"],
                                         cfg.max_model_len, cfg.block_size)
        self.requests: dict[str, RequestState] = {}
        self.dead: Optional[str] = None
        self.draining = False
        self._reader: Optional[asyncio.Task] = None
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="minipaged-prompt")
        self._token_text: dict[int, str] = {}
        self._anchor: Optional[list[int]] = None
        self._max_bytes_per_token = _max_bytes_per_token(self.tokenizer)
        self._last_stats = None
        if metrics is not None:
            metrics.kv_cache_blocks_total.set(self.info["num_blocks"])

    # --- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the core's outputs (call from the event loop that serves requests)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    @property
    def is_running(self) -> bool:
        return self.dead is None and self.client.is_alive

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: no new requests; in-flight ones get `timeout` seconds to finish,
        then end with an error event (streams) or a 503 (full responses)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.requests and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.05)
        if self.requests:
            logger.warning("shutting down: %d requests did not finish within %.0f s",
                           len(self.requests), timeout)
            self._fail_all(EngineDeadError(
                f"the server is shutting down; this request did not finish within the "
                f"{timeout:g} s drain timeout"), abort=True)

    def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all(EngineDeadError("the server is shutting down"), abort=False)
        self.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- requests ---------------------------------------------------------------------------
    async def generate(self, prompts: list[PromptInput], params: SamplingParams,
                       request_id: Optional[str] = None, stream: bool = True,
                       lora_request: Optional[LoRARequest] = None,
                       priority: int = 0) -> RequestStream:
        """One engine request per prompt, each with `params.n` samples (and `lora_request`'s
        adapter, if any; `priority` under the priority policy). Returns once the core has
        accepted them all; raises `RequestError` (nothing stays queued) if any is refused."""
        if self.draining:
            raise EngineDeadError("the server is shutting down and accepts no new requests")
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.dead or 'not started'})")
        check_priority(request_id or "new", priority, self.config.scheduling_policy)
        token_ids = [await self.tokenize(p) for p in prompts]
        for ids in token_ids:
            self.check_length(ids, params)
        base = request_id or f"req-{next(self._ids)}"
        rids = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        out = RequestStream(self.abort)
        loop = asyncio.get_running_loop()
        now = time.time()
        # The core sees token ids only: text and stop strings are this side's job.
        core_params = dataclasses.asdict(params) | {"stop": [], "detokenize": False}
        incremental = stream or bool(params.stop)
        for rid, ids in zip(rids, token_ids):
            seqs = [Sequence(request_id=rid, prompt_token_ids=ids, sampling_params=params,
                             arrival_time=now, index=i) for i in range(params.n)]
            state = RequestState(rid, ids, seqs, out, now, incremental,
                                 accepted=loop.create_future())
            out.states.append(state)
            self.requests[rid] = state
            if not self.client.send(AddRequest(rid, ids, core_params, now, lora_request,
                                               priority)):
                self._die("the engine core is not listening")
                raise EngineDeadError("the engine core stopped")
        if self.metrics is not None:
            for _ in rids:
                self.metrics.request_params_n.observe(params.n)
        try:
            errors = [e for e in await asyncio.gather(*(s.accepted for s in out.states))
                      if e is not None]
        except BaseException:  # cancelled: the client left while we waited
            out.abort()
            raise
        if errors:
            out.abort()
            raise RequestError(errors[0])
        return out

    def abort(self, request_ids: list[str]) -> None:
        """Cancel requests (unknown or finished ids are ignored): the core frees their blocks
        before its next step."""
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None and self.metrics is not None:
                self.metrics.request_finished("abort")
        if self.client.is_alive:
            self.client.send(AbortRequests(list(request_ids)))

    async def run_off_loop(self, fn: Callable, what: str):
        """Run `fn()` in a worker thread, so the event loop keeps answering (/health, streams),
        within `preprocess_timeout` seconds."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, fn),
                                          self.preprocess_timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"{what} took longer than {self.preprocess_timeout:g} s; send a "
                               "smaller request") from None

    async def tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError(f"model {self.config.model!r} has no tokenizer (dummy weights?): "
                               "send prompts as lists of token ids")
        text, special = ((prompt.text, prompt.add_special_tokens) if isinstance(prompt, TextPrompt)
                         else (prompt, True))
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        max_len = self.config.max_model_len
        # No token covers more than `_max_bytes_per_token` bytes, so a text this long cannot fit
        # (2x margin for normalizers); refuse it without tokenizing megabytes on the server.
        if num_bytes > 2 * self._max_bytes_per_token * max_len:
            raise RequestError(
                f"prompt: {num_bytes:,} bytes of text are at least "
                f"{num_bytes // self._max_bytes_per_token:,} tokens (no token of this vocabulary "
                f"is longer than {self._max_bytes_per_token} bytes), far more than max_model_len "
                f"{max_len}. Shorten the prompt.")
        tok = self.tokenizer
        return await self.run_off_loop(
            lambda: list(tok(text, add_special_tokens=special).input_ids), "tokenizing the prompt")

    def check_length(self, token_ids: list[int], params: SamplingParams) -> None:
        n, max_len = len(token_ids), self.config.max_model_len
        too_long = params.max_tokens is not None and n + params.max_tokens > max_len
        if too_long and 0 < n < max_len:  # (n >= max_len: the core's add_request explains it)
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens (max_model_len), but "
                f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                f"{params.max_tokens} for the completion). Lower max_tokens to at most "
                f"{max_len - n}, shorten the prompt, or start the server with a larger "
                f"--max-model-len.")

    # --- outputs (the reader task) ----------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            try:
                msg = await self.client.recv(1000)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a socket or decode error is fatal
                self._die(f"reading from the engine core failed: {e!r}")
                return
            if msg is None:
                if not self.client.is_alive:
                    self._die("the engine core process exited")
                    return
            elif isinstance(msg, StepOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, Accepted):
                self._on_accepted(msg)
            elif isinstance(msg, Dead):
                self._die(msg.message)
                return

    def _on_accepted(self, msg: Accepted) -> None:
        for rid in msg.accepted:
            state = self.requests.get(rid)
            if state is not None and not state.accepted.done():
                state.accepted.set_result(None)
        for rid, why in msg.rejected:
            state = self.requests.pop(rid, None)
            if state is not None and not state.accepted.done():
                state.accepted.set_result(why)

    def _on_outputs(self, msg: StepOutputs) -> None:
        now = time.time()
        to_abort = []
        for delta in msg.requests:
            state = self.requests.get(delta.request_id)
            if state is None:  # aborted, or ended here by a stop string
                continue
            if self._apply(state, delta, now):
                to_abort.append(state.request_id)
            if state.finished:
                del self.requests[state.request_id]
                self._finished_metrics(state, delta, now)
            state.stream.notify(state)
        if to_abort:
            self.client.send(AbortRequests(to_abort))
        self._update_gauges(msg)

    def _apply(self, state: RequestState, delta: RequestDelta, now: float) -> bool:
        """Fold one step's news into `state`; True if a stop string ended it here (so the core,
        which does not know, must abort it)."""
        proc, m = self.processor, self.metrics
        new_tokens = 0
        for c in delta.completions:
            seq = state.seqs[c.index]
            if seq.is_finished:
                continue
            for j, token in enumerate(c.new_token_ids):
                seq.append_token(token)
                if c.new_logprobs is not None:
                    seq.logprobs += self.logprob_entries(c.new_logprobs[j:j + 1])
                if seq.sampling_params.stop and proc.check_stop_strings(seq):
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    break
            new_tokens += len(c.new_token_ids)
            if c.cumulative_logprob is not None:
                seq.cumulative_logprob = c.cumulative_logprob
            if seq.is_finished:
                continue
            if c.finish_reason is not None:
                seq.status = SequenceStatus(c.finish_reason)
                seq.stop_reason = c.stop_reason
                if self.tokenizer is not None:
                    proc.final_text(seq)
            elif state.incremental:
                proc.detokenize(seq)
        state.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            state.prompt_logprobs = self.logprob_entries(delta.prompt_logprobs)
        if delta.error is not None:
            state.error = delta.error
        if new_tokens and m is not None:
            if state.first_token_time is None:
                m.time_to_first_token.observe(now - state.arrival)
                m.prompt_tokens.inc(len(state.prompt_token_ids))
            else:
                m.inter_token_latency.observe((now - state.last_token_time) / new_tokens)
            m.generation_tokens.inc(new_tokens)
        if new_tokens:
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
        all_done = all(s.is_finished for s in state.seqs)
        state.finished = delta.finished or all_done
        return all_done and not delta.finished

    def _finished_metrics(self, state: RequestState, delta: RequestDelta, now: float) -> None:
        m = self.metrics
        if m is None:
            return
        reasons = [s.status.value for s in state.seqs]
        m.request_finished("error" if state.error else reasons[0])
        m.e2e_request_latency.observe(now - state.arrival)
        t = delta.times
        if t is not None and t.first_scheduled is not None:
            m.request_queue_time.observe(max(t.first_scheduled - t.arrival, 0.0))
            if t.first_token is not None:
                m.request_prefill_time.observe(max(t.first_token - t.first_scheduled, 0.0))
                m.request_decode_time.observe(max(t.finished - t.first_token, 0.0))

    def _update_gauges(self, msg: StepOutputs) -> None:
        m, st = self.metrics, msg.stats
        if m is None:
            return
        last = self._last_stats
        m.num_requests_running.set(st.num_running)
        m.num_requests_waiting.set(st.num_waiting)
        m.kv_cache_blocks_used.set(st.num_blocks_used)
        m.kv_cache_usage_perc.set(st.num_blocks_used / max(st.num_blocks_total, 1))
        m.num_preemptions.inc(st.num_preemptions - (last.num_preemptions if last else 0))
        m.prefix_cache_queries.inc(st.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        m.prefix_cache_hits.inc(st.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        if st.spec_num_drafts:
            m.spec_decode_step(st, last)
        self._last_stats = st

    def logprob_entries(self, wire) -> list[Optional[dict[int, Logprob]]]:
        """Logprobs off the wire (messages.wire_logprobs), each token with its text."""
        return [None if e is None else {tid: Logprob(lp, rank, self.token_text(tid))
                                        for tid, lp, rank in e} for e in wire]

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs: decoded after an anchor token and cut off again, so
        sentencepiece keeps the leading space ("▁went" -> " went")."""
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.tokenizer
            if tok is None:
                text = f"token_id:{token_id}"
            else:
                if self._anchor is None:
                    self._anchor = list(tok("a", add_special_tokens=False).input_ids)[-1:]
                text = detokenize(tok, self._anchor, [token_id], skip_special=False)
            self._token_text[token_id] = text
        return text

    # --- failure of the whole core ----------------------------------------------------------
    def _die(self, message: str) -> None:
        logger.error("the engine core stopped: %s", message)
        self.dead = message
        self._fail_all(EngineDeadError(f"the engine core stopped: {message}"), abort=False)

    def _fail_all(self, error: BaseException, abort: bool) -> None:
        states = list(self.requests.values())
        self.requests.clear()
        if abort and states and self.client.is_alive:
            self.client.send(AbortRequests([s.request_id for s in states]))
        for s in states:
            if s.accepted is not None and not s.accepted.done():
                s.accepted.set_exception(error)
            s.finished = True
            s.stream.fail(error)


def _max_bytes_per_token(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for (its vocabulary string's
    bytes: byte-level and sentencepiece markers only ever overstate it)."""
    if tokenizer is None:
        return 1
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=1)
