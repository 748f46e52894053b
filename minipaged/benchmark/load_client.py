"""Open-loop load from several client processes (`minipaged bench serve`, lesson 13).

A request arrives when its time comes (`serving.arrival_offsets`), whether or not earlier ones
have finished: an *open* loop, the way users reach a server (a closed loop, in which each worker
waits for its answer before sending the next, slows down with the server and never sees a
queue build up). `--max-concurrency` caps the requests in flight (vLLM's semaphore); a request
that arrives at the cap waits for a free slot, and its latency counts from when it was sent.

The load generator must not be what it measures: reading a server-sent-events stream costs the
client about 0.1 ms of CPU per streamed token (benchmarks/serve_load.py measured it), so one
asyncio process saturates near 8,000 tokens/s and then sends late and reads in bursts. So the
requests are dealt to K client processes (request i to client i % K), each with its own event
loop and HTTP client; they connect first, then start on one event at one shared start time
(`time.monotonic()`, CLOCK_MONOTONIC on Linux: every process reads the same clock), and each
sends its requests at start + offset. With a cap, each client holds its share of it (C // K,
one more for the first C % K). Each client reports its CPU time over the run (busy fraction:
CPU time / wall time; near 1 it is the bottleneck) and how late it sent each request against
the schedule (`send lag`).
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from typing import Optional

from minipaged.benchmark.serving import RequestResult, stream_completion

MAX_DEFAULT_CLIENTS = 16
CLIENT_BUSY_WARN = 0.7  # a client busier than this may be limiting the numbers


@dataclass
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    offset: float = 0.0  # seconds after the start at which it is sent
    extra: Optional[dict] = None  # more request fields (e.g. priority)


@dataclass
class ClientReport:
    """What one client process sends back: its results and its own clock and CPU time."""

    index: int
    results: list  # [(job index, RequestResult)]
    start: float = 0.0  # when it started sending (time.monotonic(): every process reads it)
    end: float = 0.0
    cpu_sec: float = 0.0  # time.process_time() over [start, end]
    send_lag: Optional[list[float]] = None  # seconds late, per request, against the schedule
    error: str = ""

    @property
    def busy_fraction(self) -> float:
        return self.cpu_sec / (self.end - self.start) if self.end > self.start else 0.0


def default_clients(load: int, cpus: Optional[int] = None) -> int:
    """One process per stream up to half the machine's CPUs (the other half is the server's),
    at most 16: a client's cost follows the tokens/s it reads, not its number of streams."""
    cpus = cpus or os.cpu_count() or 2
    return max(1, min(load, cpus // 2, MAX_DEFAULT_CLIENTS))


def split_concurrency(max_concurrency: Optional[int], clients: int) -> list[Optional[int]]:
    """Each client's share of the cap (None: no cap); `clients` is at most the cap."""
    if max_concurrency is None:
        return [None] * clients
    return [max_concurrency // clients + (j < max_concurrency % clients) for j in range(clients)]


async def run_jobs(client, model: str, jobs: list[Job], start: float,
                   limit: Optional[int], temperature: float
                   ) -> list[tuple[int, RequestResult, float]]:
    """Send each job at `start + job.offset` (monotonic clock) through `client`, at most
    `limit` at once; (index, result, send lag) per job."""
    sem = asyncio.Semaphore(limit) if limit else None

    async def one(job: Job):
        delay = start + job.offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(0.0, time.monotonic() - (start + job.offset))
        if sem is None:
            res = await stream_completion(client, model, job.prompt, job.max_tokens,
                                          temperature, job.extra)
        else:
            async with sem:
                res = await stream_completion(client, model, job.prompt, job.max_tokens,
                                              temperature, job.extra)
        return job.index, res, lag

    return await asyncio.gather(*(one(j) for j in jobs))


async def _client_main(index: int, url: str, headers: dict, model: str, jobs: list[Job],
                       limit: Optional[int], temperature: float, ready, go,
                       start_at) -> ClientReport:
    import httpx
    n = max(limit or len(jobs), 1) + 2
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600.0),
                                 limits=httpx.Limits(max_connections=n,
                                                     max_keepalive_connections=n)) as client:
        ready.put(index)
        await asyncio.to_thread(go.wait)  # every client starts on the same event ...
        start = start_at.value  # ... at the same moment
        cpu0 = time.process_time()
        done = await run_jobs(client, model, jobs, start, limit, temperature)
        return ClientReport(index, [(i, r) for i, r, _ in done], start=start,
                            end=time.monotonic(), cpu_sec=time.process_time() - cpu0,
                            send_lag=[lag for _, _, lag in done])


def client_process(index: int, url: str, headers: dict, model: str, jobs: list[Job],
                   limit: Optional[int], temperature: float, ready, go, start_at,
                   reports) -> None:
    """Entry point of a client process (multiprocessing, spawn)."""
    try:
        report = asyncio.run(_client_main(index, url, headers, model, jobs, limit, temperature,
                                          ready, go, start_at))
    except BaseException as e:  # noqa: BLE001 - the parent must hear about it, not hang
        report = ClientReport(index, [], error=f"{type(e).__name__}: {e}")
        ready.put(index)  # in case it failed before saying it was ready
    reports.put(report)


def collect(q, procs: list, n: int, what: str, timeout: float) -> list:
    """`n` items from `q`, failing (not hanging) if a process dies without sending."""
    items: list = []
    deadline = time.time() + timeout
    while len(items) < n:
        try:
            items.append(q.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode is not None and p.exitcode != 0]
        if dead or time.time() > deadline:
            try:  # a last look: it may have sent just before it exited
                items.append(q.get(timeout=1.0))
                continue
            except queue.Empty:
                pass
            why = (f"client process exited with code {dead[0].exitcode}" if dead
                   else f"timed out after {timeout:.0f} s")
            raise RuntimeError(f"waiting for {what}: {why}")
    return items


def stop_clients(procs: list) -> None:
    """Join the client processes (they have reported), killing one that hangs."""
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def checked(reports: list[ClientReport]) -> list[ClientReport]:
    """The reports in client order; a client that failed raises."""
    failed = [r for r in reports if r.error]
    if failed:
        raise RuntimeError(f"client {failed[0].index} failed: {failed[0].error}")
    return sorted(reports, key=lambda r: r.index)


def run_open_loop(url: str, model: str, jobs: list[Job], *, clients: int,
                  max_concurrency: Optional[int] = None, temperature: float = 0.0,
                  headers: Optional[dict] = None, start_timeout: float = 300.0
                  ) -> tuple[list[RequestResult], float, list[ClientReport]]:
    """Send `jobs` from `clients` processes (see the docstring). Returns the results in job
    order, the run's duration (start to the last answer) and each client's report."""
    k = max(1, min(clients, len(jobs), max_concurrency or len(jobs)))
    ctx = mp.get_context("spawn")
    ready, reports, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=client_process, daemon=True,
                         args=(j, url, headers or {}, model, jobs[j::k], limit, temperature,
                               ready, go, start_at, reports))
             for j, limit in enumerate(split_concurrency(max_concurrency, k))]
    for p in procs:
        p.start()
    try:
        collect(ready, procs, k, "the clients to connect", start_timeout)
        start_at.value = time.monotonic() + 0.05
        go.set()
        got: list[ClientReport] = collect(reports, procs, k, "the clients' results", 24 * 3600)
    finally:
        stop_clients(procs)
    got = checked(got)
    results = dict(x for r in got for x in r.results)
    duration = max(r.end for r in got) - got[0].start
    return [results[j.index] for j in jobs], duration, got
