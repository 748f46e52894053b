"""The process groups of tensor parallelism, and the checks that a model splits N ways.

Rank 0 is the *driver*: the process that holds the engine (scheduler, block manager, sampler)
and also computes its 1/N share of every layer. Ranks 1 .. N-1 are *workers*: they hold their
shard of the weights and of the KV cache and run the same forward from the inputs the driver
broadcasts each step (launch.py, step_inputs.py).

Two groups over the same N processes, as vLLM has:

    device_group   the model's collectives (all-reduce, gather) and the step's tensors:
                   NCCL on CUDA, gloo on the CPU
    cpu_group      gloo, small control messages on the host: "here comes a step of this size",
                   "stop". Workers wait on it between steps, for as long as the engine sits idle,
                   so it has no practical timeout; a peer that dies closes its sockets and the
                   waiting side gets an error at once.

Start-up is `tcp://127.0.0.1:<free port>` when the driver spawns its workers, or `env://`
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) when a launcher such as torchrun
started every rank: the same variables carry the group across machines.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("minipaged.distributed")
# A step's collectives finish in well under this; a peer that hangs (alive, not answering)
# makes the other side raise after it. MINIPAGED_TP_TIMEOUT (seconds) overrides it.
DEFAULT_TIMEOUT_S = 300.0
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait on the cpu group between steps
SHUTDOWN_TIMEOUT = datetime.timedelta(seconds=10)  # every rank meets after STOP (shutdown_barrier)


@dataclass
class TPGroup:
    """Who this process is among the N, and the groups it talks through (passed explicitly to
    the parallel layers: no global state of our own)."""

    rank: int
    world_size: int
    device_group: Optional[dist.ProcessGroup]
    cpu_group: Optional[dist.ProcessGroup]
    backend: str  # "gloo" or "nccl": the device group's
    workers: Optional[object] = None  # the driver's launch.Workers (spawned ranks)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("MINIPAGED_TP_TIMEOUT",
                                                           DEFAULT_TIMEOUT_S)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_env() -> bool:
    """True when a launcher (torchrun, or the user) set RANK and WORLD_SIZE for this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_groups(rank: int, world_size: int, cuda: bool,
                init_method: Optional[str] = None) -> TPGroup:
    """Join the N processes: `init_method` tcp://host:port, or None for env://."""
    if dist.is_initialized():
        import gc
        gc.collect()  # a dropped engine's shards: their finalizer stops its workers
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process. Delete the other LLM (its workers stop with it) first.")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=world_size, timeout=collective_timeout())
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, world_size, device_group, cpu_group, backend)


def shutdown_barrier(cpu_group) -> None:
    """Every rank calls this after the STOP header, before destroying any group: the driver
    right after sending it, each worker right after receiving it. A peer that does not arrive
    within SHUTDOWN_TIMEOUT (it died or hangs) gets a warning: shutdown goes on without it.

    Why wait at all: a finished collective's tensor is released by one of gloo's C++ threads,
    a moment after the caller's wait() returned, and releasing a tensor made in Python takes
    the GIL. A driver that sent STOP and went straight on to interpreter exit could meet that
    thread there; CPython ends a thread that asks for the GIL during finalization, and ending
    a C++ thread that way aborts the process ("terminate called without an active
    exception", SIGABRT). While every rank waits here, with the GIL released, those threads
    finish; and no rank tears down its sockets while another still uses them."""
    try:  # gloo only (the cpu group is); its error names the ranks that did not arrive
        dist.monitored_barrier(group=cpu_group, timeout=SHUTDOWN_TIMEOUT)
    except RuntimeError as exc:
        logger.warning("tensor-parallel shutdown: %s", str(exc).splitlines()[0])


def destroy_groups(tp: Optional[TPGroup] = None) -> None:
    """Destroy every process group (torch destroys them newest first, the same order on every
    rank). Dropping `tp`'s references as well ends the C++ groups now, joining gloo's threads
    while Python still runs, rather than leaving them alive until the interpreter exits."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by a dead peer: nothing left to tidy
            pass
    if tp is not None:
        tp.device_group = tp.cpu_group = None


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum `x` over the N ranks, in place (row-parallel layers and the vocab-parallel embedding)."""
    dist.all_reduce(x, group=tp.device_group)
    return x


def gather_to_driver(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> Optional[torch.Tensor]:
    """Concatenate every rank's `x` along `dim` on the driver (the LM head's logits); None on
    the workers."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)] if tp.is_driver else None
    dist.gather(x, parts, dst=0, group=tp.device_group)
    return torch.cat(parts, dim=dim) if tp.is_driver else None


# --- does the model split N ways? -----------------------------------------------------------
def _divisors(n: int, limit: int = 16) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def check_tensor_parallel(config, model_config) -> None:
    """Raise a ValueError that names the numbers unless every split is even and N devices exist.

    Each rank holds num_attention_heads / N query heads, num_key_value_heads / N KV heads,
    intermediate_size / N MLP columns and vocab_size / N rows of the embedding and LM head.
    """
    n = config.tensor_parallel_size
    sizes = [("num_attention_heads", model_config.num_attention_heads, "query heads"),
             ("num_key_value_heads", model_config.num_key_value_heads, "KV heads"),
             ("intermediate_size", model_config.intermediate_size, "MLP columns"),
             ("vocab_size", model_config.vocab_size, "rows of the embedding and LM head")]
    for name, value, what in sizes:
        if value % n:
            fits = [d for d in range(1, 17) if all(v % d == 0 for _, v, _ in sizes)]
            raise ValueError(
                f"tensor_parallel_size={n} must divide the model's {name}={value}: each rank "
                f"holds an equal share of the {what}, and {value} / {n} = {value / n:.2f}. "
                f"{name}={value} splits evenly {_divisors(value)} ways; this model "
                f"(num_attention_heads={model_config.num_attention_heads}, num_key_value_heads="
                f"{model_config.num_key_value_heads}, intermediate_size="
                f"{model_config.intermediate_size}, vocab_size={model_config.vocab_size}) runs "
                f"with tensor_parallel_size in {fits}.")
    if config.is_cuda:
        count = torch.cuda.device_count()
        if launched_by_env():  # one GPU per process on each machine: LOCAL_RANK picks it
            return
        if n > count:
            raise ValueError(
                f"tensor_parallel_size={n} needs {n} GPUs (one process per GPU), but this machine "
                f"has {count}. Use tensor_parallel_size <= {count}, device='cpu' (gloo, any N), or "
                f"launch the ranks across machines with torchrun (env://, see docs/guides/tensor_parallelism.md).")
