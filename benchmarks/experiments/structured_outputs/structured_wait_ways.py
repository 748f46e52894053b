"""How the main thread waits for another thread, against how fast its next GPU calls run.

The main thread's part of a constrained step (the bitmask's copy to the GPU and the masked argmax's
launch: `token_mask` and `sample_masked`) takes ~3x as long in the engine as back to back
(benchmarks/experiments/structured_outputs/structured_fill_threads.py). Here another thread releases
a lock 0.2 ms after the main thread starts waiting for it (as the grammar worker does), and the main
thread waits five ways: a blocking acquire; polling with sleep(0), sleep(10 us) or sleep(50 us);
spinning on sched_yield. Per way: how long after the release the main thread went on, and the host
time of that step part right after. Each wait follows a CUDA synchronize (the GPU idle); "back to
back" calls the part in a loop with no wait and no synchronize. Needs a CUDA GPU (~15 s).

    python benchmarks/experiments/structured_outputs/structured_wait_ways.py

writes structured_wait_ways_<gpu>.json beside this script.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))


def blocking(lock) -> None:
    lock.acquire()


def polling(pause: float):
    def wait(lock) -> None:
        while not lock.acquire(blocking=False):
            time.sleep(pause)
    return wait


def spinning(lock) -> None:
    while not lock.acquire(blocking=False):
        os.sched_yield()  # (releases the GIL)


def main() -> None:
    import torch

    from structured_fill_threads import ROWS, VOCAB, step_part_timer

    from minipaged.lessons.bench import environment
    bitmask = torch.zeros(ROWS, (VOCAB + 31) // 32, dtype=torch.int32).pin_memory()
    step_part = step_part_timer(bitmask)
    for _ in range(50):
        step_part()
    ways = {"blocking acquire": blocking, "poll sleep(0)": polling(0),
            "poll sleep(10us)": polling(1e-5), "poll sleep(50us)": polling(5e-5),
            "spin sched_yield": spinning}
    results = {}
    for name, wait in ways.items():
        delays, after = [], []
        for _ in range(300):
            torch.cuda.synchronize()
            lock = threading.Lock()
            lock.acquire()
            released = [0.0]

            def release():
                time.sleep(0.0002)
                released[0] = time.perf_counter()
                lock.release()
            other = threading.Thread(target=release)
            other.start()
            wait(lock)
            delays.append(time.perf_counter() - released[0])
            after.append(step_part())
            other.join()
        results[name] = {"woken_us_after_the_release": round(1e6 * statistics.median(delays), 1),
                         "woken_us_p90": round(1e6 * sorted(delays)[270], 1),
                         "step_part_us_after": round(1e6 * statistics.median(after), 1)}
        print(name, results[name])
    back_to_back = round(1e6 * statistics.median(step_part() for _ in range(300)), 1)
    print(f"back to back: {back_to_back} us")
    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "cuda"
    path = Path(__file__).resolve().parent / f"structured_wait_ways_{gpu}.json"
    path.write_text(json.dumps({
        "benchmark": "structured_wait_ways",
        "command": "python benchmarks/experiments/structured_outputs/structured_wait_ways.py",
        "rows": ROWS, "vocab": VOCAB, "by_way": results,
        "step_part_us_back_to_back": back_to_back,
        "environment": environment()}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
