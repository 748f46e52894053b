"""The engine core: an `LLMEngine` stepped in a loop of its own process, behind two ZeroMQ sockets.
Lesson 07 explains it (vLLM V1's EngineCore / EngineCoreClient).

    API server process (async_llm.py)               engine-core process (`EngineCore.run`)
    ─────────────────────────────────               ──────────────────────────────────────
    tokenize, chat template, checks
    AddRequest(id, token ids, params)   ──PUSH──▶   add_request (Accepted: yes, or why not)
    AbortRequests(ids)                  ──PUSH──▶   abort_request: its blocks are free at once
                                                    step() while anything is unfinished
    detokenize, stop strings, SSE       ◀──PUSH──   StepOutputs: new token ids, finishes, stats

Why a process: in one process the HTTP event loop (parsing, JSON, server-sent events) and the
engine's step take turns on one interpreter lock, so the server went at the speed of their sum.
In two processes they overlap, and the engine core is a plain loop that never waits for HTTP.

The core only sees token ids. It runs with `detokenize=False` and no stop strings (the API
server turns tokens into text and finds stop strings, then aborts the request here). Requests
that fail while they are stepped end alone inside `LLMEngine` (finish_reason "error"); if the
step itself raises, the core sends `Dead` and exits, and the API server fails what was running.
It also exits when the API server's process is gone, so no orphan holds the GPU.

`EngineCoreClient` starts the core (a fresh interpreter running `main()`, its config as
msgpack on stdin; or a thread, for notebooks and tests that want to look inside) and owns the
sockets on the API server's side.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from minipaged.config import EngineConfig
from minipaged.engine.output import RequestOutput
from minipaged.server.messages import (AbortRequests, Accepted, AddRequest, CompletionDelta, Dead,
                                       EngineStats, Ready, RequestDelta, RequestTimes, Shutdown,
                                       StepOutputs, encoder, output_decoder, request_decoder,
                                       wire_logprobs)
from minipaged.spec_decode.step_loop import SpecDecodeStepLoop

logger = logging.getLogger("minipaged.server")

IDLE_POLL_MS = 1000  # how long an idle core sleeps on its socket before checking its parent


class ServerGone(Exception):
    """The API server no longer reads the core's outputs."""


class EngineCore:
    """The core's side: an `LLMEngine` and the loop that feeds and steps it."""

    def __init__(self, config: EngineConfig):
        from minipaged.engine.llm_engine import LLMEngine
        self.engine = LLMEngine(config)  # step() returns finished requests; the rest is read
        # from the live sequences (`_live_delta`): no RequestOutput per token per request
        self.sent: dict[str, list[int]] = {}  # request id -> tokens sent so far, per sample
        self.prompt_logprobs_due: set[str] = set()  # asked for prompt logprobs, not sent yet
        self.first_scheduled: dict[str, float] = {}
        self._last_record = None  # the newest StepRecord already looked at
        self.accepted: list[str] = []
        self.rejected: list[tuple[str, str]] = []
        self.stopping = False

    def info(self) -> dict:
        eng, cfg = self.engine, self.engine.config
        return {"config": msgspec.to_builtins(cfg), "num_blocks": eng.num_blocks,
                "vocab_size": eng.model_config.vocab_size,
                "max_position_embeddings": eng.model_config.max_position_embeddings,
                "device": str(eng.device), "dtype": str(eng.dtype),
                "attention_backend": type(eng.backend).__name__,
                "eos_token_ids": list(eng.eos_token_ids),
                "model_path": str(eng.source.path) if eng.source.path is not None else None}

    # --- messages in ------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, AbortRequests):
            self.engine.abort_request(msg.request_ids)
            for rid in msg.request_ids:
                self._forget(rid)
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def add(self, msg: AddRequest) -> None:
        from minipaged.sampling import SamplingParams
        try:
            params = SamplingParams(**msg.sampling_params)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params,
                                    arrival_time=msg.arrival_time,
                                    lora_request=msg.lora_request, priority=msg.priority)
        except (ValueError, TypeError) as e:  # RequestError, or a field SamplingParams refuses
            self.rejected.append((msg.request_id, str(e)))
            return
        self.sent[msg.request_id] = [0] * params.n
        if params.prompt_logprobs is not None:
            self.prompt_logprobs_due.add(msg.request_id)
        self.accepted.append(msg.request_id)

    def take_acks(self) -> Optional[Accepted]:
        if not self.accepted and not self.rejected:
            return None
        acks = Accepted(self.accepted, self.rejected)
        self.accepted, self.rejected = [], []
        return acks

    # --- the step and what it sends ---------------------------------------------------------
    def step(self) -> StepOutputs:
        outputs = self.engine.step()
        self._note_scheduled()
        deltas = [d for out in outputs if (d := self._delta(out)) is not None]  # finished
        for rid, sent in self.sent.items():  # still running: their new tokens, if any
            if (d := self._live_delta(rid, sent)) is not None:
                deltas.append(d)
        return StepOutputs(deltas, self.stats())

    def _live_delta(self, request_id: str, sent: list[int]) -> Optional[RequestDelta]:
        eng = self.engine
        group = eng.groups.get(request_id)
        seqs = group.seqs if group is not None else [eng.requests.get(request_id)]
        completions = []
        for seq in seqs:
            if seq is None:
                continue
            start, end = sent[seq.index], seq.num_output_tokens
            if end > start:
                lps = None
                if seq.logprobs is not None:
                    lps = wire_logprobs(seq.logprobs[start:end])
                completions.append(CompletionDelta(
                    seq.index, seq.output_token_ids[start:end], lps,
                    seq.cumulative_logprob if lps is not None else None))
                sent[seq.index] = end
        if not completions:
            return None
        return RequestDelta(request_id, completions, num_cached_tokens=seqs[0].num_cached_tokens,
                            prompt_logprobs=self._prompt_logprobs(
                                request_id, seqs[0].prompt_logprobs, seqs[0].num_prompt_tokens))

    def _prompt_logprobs(self, request_id: str, entries, num_prompt_tokens: int):
        """A request's prompt logprobs for the wire, the first time they are complete."""
        if (request_id not in self.prompt_logprobs_due or entries is None
                or len(entries) < num_prompt_tokens):
            return None
        self.prompt_logprobs_due.discard(request_id)
        return wire_logprobs(entries)

    def _note_scheduled(self) -> None:
        """When each request was first scheduled (queue time = that - arrival), from the trace."""
        trace = self.engine.trace
        if not trace or trace[-1] is self._last_record:
            return
        self._last_record = trace[-1]
        now = time.time()
        for entry in trace[-1].scheduled:
            self.first_scheduled.setdefault(entry.request_id, now)

    def _delta(self, out: RequestOutput) -> Optional[RequestDelta]:
        sent = self.sent.get(out.request_id)
        if sent is None:  # aborted meanwhile
            return None
        completions = []
        for c in out.outputs:
            start = sent[c.index]
            new = c.token_ids[start:]
            if not new and c.finish_reason is None:
                continue
            lps = None
            if c.logprobs is not None:
                lps = wire_logprobs(c.logprobs[start:len(c.token_ids)])
            completions.append(CompletionDelta(c.index, new, lps, c.cumulative_logprob,
                                               c.finish_reason, c.stop_reason))
            sent[c.index] = len(c.token_ids)
        prompt_logprobs = self._prompt_logprobs(out.request_id, out.prompt_logprobs,
                                                len(out.prompt_token_ids))
        times = None
        if out.finished:
            m = out.metrics
            times = RequestTimes(m.get("arrival_time") or 0.0,
                                 self.first_scheduled.get(out.request_id),
                                 m.get("first_token_time"), m.get("finished_time") or time.time())
            self._forget(out.request_id)
        return RequestDelta(out.request_id, completions, out.finished, out.error,
                            out.num_cached_tokens, times, prompt_logprobs)

    def _forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)
        self.first_scheduled.pop(request_id, None)
        self.prompt_logprobs_due.discard(request_id)

    def stats(self) -> EngineStats:
        eng = self.engine
        sched, bm = eng.scheduler, eng.block_manager
        spec = ()
        if isinstance(eng.step_loop, SpecDecodeStepLoop):  # speculative decoding's counters
            st = eng.step_loop.stats
            spec = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens,
                    list(st.num_accepted_tokens_per_pos))
        return EngineStats(len(sched.running), len(sched.waiting)  # (+ grammars compiling)
                           + len(eng.grammar_compiles.waiting),
                           bm.num_blocks - bm.num_free_blocks, bm.num_blocks,
                           sched.num_preemptions, bm.prefix_queries, bm.prefix_hits, *spec)

    # --- the loop ---------------------------------------------------------------------------
    def run(self, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: Optional[int]) -> None:
        """Drain every waiting message, then step; sleep on the socket only while idle."""
        eng = self.engine

        def send(msg) -> None:
            try:
                outbox.send(encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # nobody is listening: the API server is gone
                raise ServerGone from None

        while not self.stopping:
            busy = eng.has_unfinished_requests()
            timeout = 0 if busy else IDLE_POLL_MS
            handled = False
            while inbox.poll(timeout):
                self.handle(request_decoder.decode(inbox.recv()))
                handled, timeout = True, 0
            acks = self.take_acks()
            if acks is not None:
                send(acks)
            if eng.has_unfinished_requests():
                send(self.step())
            elif handled:  # aborts freed blocks: let the gauges know
                send(StepOutputs([], self.stats()))
            elif parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("the API server is gone: the engine core stops")
                return


def run_engine_core(config_bytes: bytes, inbox_addr: str, outbox_addr: str,
                    parent_pid: Optional[int], num_threads: Optional[int],
                    on_start: Optional[Callable[[EngineCore], None]] = None) -> None:
    """The engine core's main (in its own process, or a thread's target). `on_start` sees the
    `EngineCore` before it serves (in a thread: so a notebook or test can look inside)."""
    import torch
    if num_threads is not None and parent_pid is not None:  # a process: match the server's
        torch.set_num_threads(num_threads)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(inbox_addr)
    outbox.connect(outbox_addr)
    try:
        try:
            core = EngineCore(msgspec.msgpack.decode(config_bytes, type=EngineConfig))
        except Exception as e:  # noqa: BLE001 - a config or model error: tell the server why
            outbox.send(encoder.encode(Dead(str(e))), flags=zmq.NOBLOCK)
            return
        if on_start is not None:
            on_start(core)
        outbox.send(encoder.encode(Ready(core.info())), flags=zmq.NOBLOCK)
        try:
            core.run(inbox, outbox, parent_pid)
        except ServerGone:
            logger.warning("the API server is gone: the engine core stops")
        except Exception as e:  # noqa: BLE001 - a bug in a step: every request must hear of it
            logger.exception("the engine core crashed")
            with contextlib.suppress(zmq.Again):
                outbox.send(encoder.encode(Dead(f"the engine core crashed: {e!r}")),
                            flags=zmq.NOBLOCK)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)  # let the last message (Dead) reach the server
        ctx.term()


class EngineCoreClient:
    """The API server's side: starts the core, sends requests, receives outputs (asyncio)."""

    def __init__(self, config: EngineConfig, in_process: bool = False):
        import torch
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="minipaged-")
        inbox_addr = f"ipc://{self._dir}/to_core"
        outbox_addr = f"ipc://{self._dir}/from_core"
        self.ctx = zmq.Context()
        self.to_core = self.ctx.socket(zmq.PUSH)
        self.from_core = self.ctx.socket(zmq.PULL)
        for sock in (self.to_core, self.from_core):
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: queue whatever is in flight
            sock.setsockopt(zmq.RCVHWM, 0)
        self.to_core.bind(inbox_addr)
        self.from_core.bind(outbox_addr)
        self._async_from: Optional[zmq.asyncio.Socket] = None
        config_bytes, threads = encoder.encode(config), torch.get_num_threads()
        self.thread: Optional[threading.Thread] = None
        self.process: Optional[subprocess.Popen] = None
        self.core: Optional[EngineCore] = None  # in a thread only: the core itself
        if in_process:
            self.thread = threading.Thread(
                target=run_engine_core, daemon=True, name="minipaged-engine-core",
                args=(config_bytes, inbox_addr, outbox_addr, None, None,
                      lambda core: setattr(self, "core", core)))
            self.thread.start()
        else:  # a fresh interpreter running `main()` below, its config on stdin
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from minipaged.server.engine_core import main; main()",
                 inbox_addr, outbox_addr, str(os.getpid()), str(threads)], stdin=subprocess.PIPE)
            self.process.stdin.write(config_bytes)
            self.process.stdin.close()

    @property
    def is_alive(self) -> bool:
        if self.thread is not None:
            return self.thread.is_alive()
        return self.process.poll() is None

    def wait_ready(self, timeout: float = 900.0) -> dict:
        """Block until the core has loaded the model; its `Ready.info`. Raises ValueError with
        the core's own message if it could not start (a wrong path, a config that cannot fit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.from_core.poll(200):
                msg = output_decoder.decode(self.from_core.recv())
                if isinstance(msg, Ready):
                    return msg.info
                if isinstance(msg, Dead):
                    self.close()
                    raise ValueError(msg.message)
            elif not self.is_alive:
                self.close()
                raise RuntimeError("the engine core exited while it was starting (see its log)")
        self.close()
        raise TimeoutError(f"the engine core did not start within {timeout:.0f} s")

    def send(self, msg) -> bool:
        """Queue `msg` for the core without ever blocking; False if the core is gone (a PUSH
        socket with no peer would otherwise wait forever)."""
        try:
            self.to_core.send(encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    async def recv(self, timeout_ms: int):
        """The next message from the core, or None after `timeout_ms` of silence."""
        if self._async_from is None:  # the handshake was synchronous; from now on, asyncio
            self._async_from = zmq.asyncio.Socket.from_socket(self.from_core)
        if not await self._async_from.poll(timeout_ms):
            return None
        return output_decoder.decode(await self._async_from.recv())

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it, and make sure it is gone."""
        if self.is_alive:
            self.send(Shutdown())
        if self.thread is not None:
            self.thread.join(timeout)
        else:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._async_from is not None:
            self._async_from.close(linger=0)
        self.to_core.close(linger=0)
        self.from_core.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def main() -> None:
    """The engine-core process: ADDRESS_IN ADDRESS_OUT PARENT_PID THREADS, the config on stdin."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    inbox_addr, outbox_addr, parent, threads = sys.argv[1:5]
    run_engine_core(sys.stdin.buffer.read(), inbox_addr, outbox_addr, int(parent), int(threads))
