"""Why the main thread's GPU calls of a constrained step run slower after a wait: an idle GPU,
or the wait itself? And would fewer calls (a CUDA graph) avoid it?

The main thread's part of a constrained step (the bitmask's copy to the GPU and the masked argmax's
launch) takes several times longer right after a wait for another thread than back to back
(benchmarks/experiments/structured_outputs/structured_fill_threads.py, structured_wait_ways.py);
every slow case there followed a CUDA synchronize, so the GPU was idle at the launch. Here the part
runs after each of several conditions, with the GPU idle (synchronized) or busy (a 1 ms, or for the
sleep 5 ms, `torch.cuda._sleep` queued first), the thread going on at once, spinning 0.2 ms (it
never leaves the CPU), blocking 0.2 ms on a lock another thread releases, or sleeping 3 ms. Three
ways to run the part, each timed in host microseconds (median of 200): as the engine does (`to` a
new device tensor, an event recorded, `masked_argmax`), the copy into a preallocated buffer instead,
and all of it as one CUDA graph replay. For the first two the copy, event and launch are also timed
apart. Needs a CUDA GPU (~1 min).

    python benchmarks/experiments/structured_outputs/structured_launch_after_wait.py

writes structured_launch_after_wait_<gpu>.json beside this script.
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

ROWS, VOCAB = 64, 151936


def main() -> None:
    import torch

    from minipaged.lessons.bench import environment
    from minipaged.sampling import kernels as K
    from minipaged.sampling.params import TokenMask
    dev = torch.device("cuda")
    words = (VOCAB + 31) // 32
    host_bitmask = torch.zeros(ROWS, words, dtype=torch.int32).pin_memory()
    logits = torch.randn(ROWS, VOCAB, device=dev).to(torch.bfloat16)
    masked = torch.ones(ROWS, dtype=torch.int32, device=dev)
    keep = torch.full((words,), -1, dtype=torch.int32, device=dev)
    static = torch.zeros(ROWS, words, dtype=torch.int32, device=dev)
    event = torch.cuda.Event()

    def timed_part(copy):  # -> (copy, event, launch, whole) seconds
        def part():
            t0 = time.perf_counter()
            bitmask = copy()
            t1 = time.perf_counter()
            event.record()
            t2 = time.perf_counter()
            K.masked_argmax(logits, TokenMask(bitmask, masked, keep))
            t3 = time.perf_counter()
            return t1 - t0, t2 - t1, t3 - t2, t3 - t0
        return part
    as_the_engine = timed_part(lambda: host_bitmask.to(dev, non_blocking=True))
    into_a_buffer = timed_part(lambda: static.copy_(host_bitmask, non_blocking=True))
    for _ in range(5):
        into_a_buffer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(host_bitmask, non_blocking=True)
        graph_out = K.masked_argmax(logits, TokenMask(static, masked, keep))

    def replayed():
        t0 = time.perf_counter()
        graph.replay()
        return (None, None, None, time.perf_counter() - t0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, K.masked_argmax(logits, TokenMask(static, masked, keep)))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)

    def busy(ms: float) -> None:
        torch.cuda._sleep(int(ms * cycles_per_ms))

    def spin() -> None:
        until = time.perf_counter() + 0.0002
        while time.perf_counter() < until:
            pass

    def blocking_wait() -> None:
        lock = threading.Lock()
        lock.acquire()
        threading.Timer(0.0002, lock.release).start()
        lock.acquire()  # the GIL released, woken by the other thread
    sync = torch.cuda.synchronize
    conditions = {
        "back to back": lambda: None,
        "GPU idle, at once": sync,
        "GPU idle, spin 0.2 ms": lambda: (sync(), spin()),
        "GPU idle, blocking wait 0.2 ms": lambda: (sync(), blocking_wait()),
        "GPU idle, sleep 3 ms": lambda: (sync(), time.sleep(0.003)),
        "GPU busy, at once": lambda: busy(1.0),
        "GPU busy, spin 0.2 ms": lambda: (busy(1.0), spin()),
        "GPU busy, blocking wait 0.2 ms": lambda: (busy(1.0), blocking_wait()),
        "GPU busy, sleep 3 ms": lambda: (busy(5.0), time.sleep(0.003))}
    results = {}
    for way, part in (("as the engine", as_the_engine), ("into a buffer", into_a_buffer),
                      ("one graph replay", replayed)):
        for _ in range(50):
            part()
        results[way] = {}
        for name, condition in conditions.items():
            times = []
            for _ in range(200):
                condition()
                times.append(part())
            sync()
            us = [None if times[0][i] is None else
                  round(1e6 * statistics.median(t[i] for t in times), 1) for i in range(4)]
            results[way][name] = dict(zip(("copy_us", "event_us", "launch_us", "whole_us"), us))
            print(f"{way:17s} {name:32s} {us}")
    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "cuda"
    path = Path(__file__).resolve().parent / f"structured_launch_after_wait_{gpu}.json"
    path.write_text(json.dumps({
        "benchmark": "structured_launch_after_wait",
        "command": ("python benchmarks/experiments/structured_outputs/"
                    "structured_launch_after_wait.py"),
        "rows": ROWS,
        "vocab": VOCAB, "host_us_median_of_200": results,
        "environment": environment()}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
