"""All-reduce bus bandwidth on this machine, nccl-tests' way, for benchmarks/tp_scaling.py.

    measure(world_size, sizes, device="cuda", dtype=torch.bfloat16)   -> [row per size]

Spawns `world_size` ranks with torch.multiprocessing (one GPU each; gloo on the CPU), and for
each message size in bytes all-reduces (sum) one tensor of that many bytes: `warmup` times,
then `iters` times back to back, timed with CUDA events (perf_counter on the CPU). A size's
time is the slowest rank's mean. nccl-tests' definitions (doc/PERFORMANCE.md):

    algbw = bytes / time
    busbw = algbw * 2 (N - 1) / N     # what each link carries in a ring all-reduce

The NCCL environment (NCCL_NVLS_ENABLE and the rest) is left as the caller set it. The sizes a
decode step sends are `decode_message_sizes`: a (batch, hidden) activation in the model's dtype,
all-reduced 1 + 2 x num_layers times per step (the embedding, then o_proj and down_proj).
"""
from __future__ import annotations

import time
import traceback
from typing import Iterable, Sequence

import torch

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in bytes/s: algbw * 2 (N-1) / N."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds} must be > 0")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def decode_message_sizes(hidden_sizes: Iterable[int], element_size: int,
                         batches: Sequence[int] = DECODE_BATCHES) -> list[int]:
    """Bytes of the (batch, hidden) all-reduces a decode step sends, for every batch and
    hidden size, sorted, without repeats."""
    return sorted({b * h * element_size for h in hidden_sizes for b in batches})


def sweep_sizes(max_bytes: int, min_bytes: int = 1024) -> list[int]:
    """Powers of two from `min_bytes` to `max_bytes` (nccl-tests' -b / -e / -f 2)."""
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return out


def _rank(rank, world, init_method, sizes, device, dtype, warmup, iters, queue):
    import torch.distributed as dist
    try:
        torch.set_num_threads(1)
        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method,
                                rank=rank, world_size=world)
        dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
        elem = torch.tensor([], dtype=dtype).element_size()
        times = []
        first = torch.zeros(1, dtype=dtype, device=dev)
        for _ in range(20):  # connections and the first calls' costs, before any size
            dist.all_reduce(first)
        for nbytes in sizes:
            x = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=dev)
            for _ in range(warmup):
                dist.all_reduce(x)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(iters):
                    dist.all_reduce(x)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / iters)
            else:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                times.append((time.perf_counter() - t0) / iters)
        slowest = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        queue.put((rank, "ok", slowest.cpu().tolist()))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(world_size: int, sizes: Sequence[int], device: str = "cuda",
            dtype: torch.dtype = torch.bfloat16, warmup: int = 5, iters: int = 20,
            timeout: float = 300.0) -> list[dict]:
    """One row per size: bytes, time_us (slowest rank's mean), algbw_gbps, busbw_gbps (1e9 B/s)."""
    from minipaged.lessons.tp_measure import run_ranks
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: an all-reduce needs at least 2 ranks")
    got = run_ranks(_rank, world_size, (list(sizes), device, dtype, warmup, iters), timeout,
                    "an all-reduce rank")
    rows = []
    for nbytes, t in zip(sizes, got[0]):
        rows.append({"bytes": nbytes, "time_us": round(t * 1e6, 2),
                     "algbw_gbps": round(nbytes / t / 1e9, 4),
                     "busbw_gbps": round(bus_bandwidth(nbytes, t, world_size) / 1e9, 4)})
    return rows
