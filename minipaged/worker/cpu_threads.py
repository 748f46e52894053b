"""How many threads torch's CPU ops use: the `cpu_threads` knob of `EngineConfig`.

torch starts with one intra-op (OpenMP) thread per physical core. That is the wrong default for
the models of the lessons: stories260K's matrices are 64 wide, a layer's ops take microseconds,
and a second thread buys little (1.13x batched, 0.99x for one request, on idle cores). On a
shared machine it is far worse: when another process holds one of the cores, every parallel op waits
for the thread that is not running. On 2 shared cores with one of them busy, a 64-wide model
made 8,618 tok/s at one thread and 558 at torch's default of two
(benchmarks/experiments/cpu_path/cpu_threads.py).

The rule, decided once in `EngineConfig.resolve` (`resolve_cpu_threads`) and applied when the
engine is built (`apply_cpu_threads`, called by `LLMEngine.__init__`):

1. `cpu_threads=N` given: N threads, on any device.
2. On CUDA, with `cpu_threads` None: torch's threads are left as they are (None).
3. On the CPU, if the caller already chose a thread count, it is kept: `OMP_NUM_THREADS` or
   `MKL_NUM_THREADS` is set in the environment, or `torch.set_num_threads(k)` was called with a
   k other than torch's default. (A k equal to the default cannot be told apart from no choice;
   pass `cpu_threads=k` to be sure. An engine built earlier in the process counts as a caller
   too: a second engine keeps the first one's threads.)
4. Otherwise `auto_cpu_threads(hidden_size)`: one thread for narrow models, torch's default
   for wide ones.

torch's thread count is process-wide: building an engine on the CPU changes it for everything
else in the process (other models, HF baselines, numpy-heavy torch code) until someone sets it
again. `minipaged bench` relies on that: its HF baselines run with the thread count the engine
chose, so both sides of the comparison use the same setting.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

# Below this hidden size the default is one thread. benchmarks/experiments/cpu_path/cpu_threads.py
# measured tok/s at 2 threads over 1 (cpu_threads_sweep.json beside it: random 4-layer fp32 Llamas
# on 2 shared cores, 16 requests batched / one request alone; "busy": a `while True: pass` process
# on one core):
#     hidden size        64    128    256    512    1024   2048
#     idle, batched     1.13   1.21   1.42   1.45   1.68   1.79
#     idle, alone       0.99   1.05   1.19   1.35   1.78   1.87
#     busy, batched     0.09   0.16   0.11   0.14   0.39   0.59
#     busy, alone       0.08   0.53   0.10   0.07   0.17   0.40
# Below 1024 a second thread gains at most 1.45x on idle cores and loses 2-14x as soon as another
# process holds one; from 1024 on it gains 1.7-1.9x on idle cores and still loses 1.7-6x on a
# busy one, so on a machine shared with other work pass cpu_threads=1 for wide models too.
MIN_HIDDEN_SIZE_FOR_THREADS = 1024

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the ones torch reads at start-up


def torch_default_threads() -> int:
    """The intra-op thread count torch starts with when no environment variable sets it: one
    per physical core. torch sizes its inter-op pool from the same count
    (`TaskThreadPoolBase::defaultNumThreads`), and `set_num_threads` leaves that pool alone,
    so `get_num_interop_threads()` still reports the default after a caller changed the
    intra-op count (unless they also called `set_num_interop_threads`, which then counts as a
    choice of theirs)."""
    return torch.get_num_interop_threads()


def caller_chose_threads() -> Optional[str]:
    """Why the current thread count is the caller's choice, or None if it is torch's default."""
    for var in THREAD_ENV_VARS:
        if os.environ.get(var, "").strip():
            return f"{var}={os.environ[var]} in the environment"
    current, default = torch.get_num_threads(), torch_default_threads()
    if current != default:
        return f"torch.set_num_threads({current}) (torch's default here is {default})"
    return None


def auto_cpu_threads(hidden_size: int) -> int:
    """One thread below `MIN_HIDDEN_SIZE_FOR_THREADS`, else torch's default (a thread per
    physical core)."""
    if hidden_size < MIN_HIDDEN_SIZE_FOR_THREADS:
        return 1
    return torch_default_threads()


def resolve_cpu_threads(cpu_threads: Optional[int], device: str, hidden_size: int) -> Optional[int]:
    """The thread count the engine will run with (None: leave torch's setting alone)."""
    if cpu_threads is not None:
        return cpu_threads
    if device.startswith("cuda"):
        return None
    if caller_chose_threads() is not None:
        return torch.get_num_threads()
    return auto_cpu_threads(hidden_size)


def apply_cpu_threads(cpu_threads: Optional[int]) -> None:
    """Set torch's (process-wide) intra-op thread count; None leaves it alone."""
    if cpu_threads is not None and torch.get_num_threads() != cpu_threads:
        torch.set_num_threads(cpu_threads)
