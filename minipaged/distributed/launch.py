"""Starting, watching and stopping the worker processes of tensor parallelism.

    start_tensor_parallel(config, source)   called once by the engine, before it loads its shard

Spawned (the default): the engine's process is rank 0, the driver; it starts ranks 1 .. N-1
with torch.multiprocessing (spawn: a fresh interpreter, no forked CUDA or thread state), each
given the resolved EngineConfig and the model's location once, at start-up. They meet over
tcp://127.0.0.1:<free port>. Each worker has a pipe back to the driver for two messages only:
"started" and, if it fails, its traceback.

env:// (torchrun, or RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by hand): every rank runs
the user's script; in rank 0 `LLM(...)` returns an engine as usual, in the other ranks it runs
the worker loop and the process exits when the driver stops. The same variables reach across
machines (docs/guides/tensor_parallelism.md).

Failure handling, so that the driver never hangs:
  * a worker that raises sends its traceback through its pipe and exits; the driver's next
    collective fails (its peer closed the connection) and `Workers.failure` turns that into one
    RuntimeError naming the rank and quoting the worker's error;
  * a worker that is killed closes its sockets the same way; the error names its exit signal;
  * with NCCL, whose collectives wait on the GPU rather than a socket, a watcher thread aborts
    the process group when a worker dies, so the waiting kernels fail instead of hanging;
  * workers stop when the engine is garbage-collected or the interpreter exits: a STOP header,
    then every rank meets at `shutdown_barrier` (with a timeout) before destroying its groups,
    and on their own when the driver dies (their cpu_group wait fails, and a thread watching
    the parent process ends them).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Optional

import torch

from minipaged.distributed.parallel_state import (TPGroup, destroy_groups, free_port,
                                                  init_groups, launched_by_env,
                                                  shutdown_barrier)

logger = logging.getLogger("minipaged.distributed")
START_TIMEOUT_S = 120.0  # a worker imports torch and minipaged before it says "started"


def start_tensor_parallel(config, source) -> TPGroup:
    """Join (env://) or start (spawn) the N ranks; returns the driver's TPGroup. In an env://
    worker rank this runs the worker loop and exits the process when the driver stops."""
    n, cuda = config.tensor_parallel_size, config.is_cuda
    if launched_by_env():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != n:
            raise ValueError(f"WORLD_SIZE={world} (set by the launcher) must equal "
                             f"tensor_parallel_size={n}: one process per rank.")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        tp = init_groups(rank, world, cuda, init_method=None)
        if rank != 0:
            from minipaged.worker.tp_worker import run_worker
            run_worker(config, source, tp)
            destroy_groups(tp)
            sys.exit(0)  # this rank's LLM(...) never returns: the driver's script goes on
        workers = Workers()  # no processes of ours: stop() only sends STOP to the ranks
        tp.workers, workers.cpu_group, workers.tp = workers, tp.cpu_group, weakref.ref(tp)
        weakref.finalize(tp, workers.stop)
        return tp
    if cuda:
        torch.cuda.set_device(0)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    workers = Workers()
    for rank in range(1, n):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker_process, name=f"minipaged-tp-{rank}", daemon=True,
                           args=(rank, n, init_method, config, source, theirs, os.getpid(),
                                 torch.get_num_threads()))
        with _main_module_hidden():
            proc.start()
        theirs.close()
        workers.add(rank, proc, ours)
    workers.wait_started()
    tp = init_groups(0, n, cuda, init_method)
    tp.workers, workers.cpu_group, workers.tp = workers, tp.cpu_group, weakref.ref(tp)
    weakref.finalize(tp, workers.stop)  # the workers live as long as the model's shards
    workers.watch(tp.backend)
    return tp


@contextlib.contextmanager
def _main_module_hidden():
    """Spawn re-runs the parent's __main__ script in the child unless told it has none: a
    script calling LLM(...) at top level would start its workers' workers. A worker needs only
    minipaged, so the child is started as if from an interactive session."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__.pop(k) for k in ("__file__",) if main and k in main.__dict__}
    spec = getattr(main, "__spec__", None)
    if main is not None:
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            main.__spec__ = spec


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker failed or died: the engine cannot go on without its shard."""


class Workers:
    """The driver's handle on its worker processes (`TPGroup.workers`). `stop` runs when the
    driver's TPGroup is garbage-collected (with the engine that holds the model) or at exit."""

    def __init__(self):
        self.procs: dict[int, object] = {}
        self.pipes: dict[int, object] = {}
        self.errors: dict[int, str] = {}  # rank -> the traceback it sent
        self.cpu_group = None
        self.tp: Optional[weakref.ref] = None  # the driver's TPGroup, not kept alive by us
        self.failed: Optional[WorkerFailed] = None
        self.stopped = False

    def add(self, rank: int, proc, pipe) -> None:
        self.procs[rank], self.pipes[rank] = proc, pipe

    def _read(self, rank: int, timeout: float = 0.0) -> Optional[tuple]:
        try:
            if self.pipes[rank].poll(timeout):
                msg = self.pipes[rank].recv()
                if msg[0] == "error":
                    self.errors[rank] = msg[1]
                return msg
        except (EOFError, OSError):
            pass
        return None

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> None:
        waiting, deadline = set(self.procs), time.monotonic() + timeout
        while waiting:
            for rank in list(waiting):
                msg = self._read(rank, 0.05)
                if msg is not None and msg[0] == "started":
                    waiting.discard(rank)
                elif not self.procs[rank].is_alive():
                    self.stop()
                    raise self.failure(None)
            if waiting and time.monotonic() > deadline:
                self.stop()
                raise WorkerFailed(f"tensor-parallel workers {sorted(waiting)} did not start "
                                   f"within {timeout:.0f} s")

    def dead(self) -> dict[int, Optional[int]]:
        """Ranks whose process has exited or reported an error: their exit codes."""
        for rank in self.pipes:
            while self._read(rank) is not None:
                pass
        return {r: p.exitcode for r, p in self.procs.items()
                if not p.is_alive() or r in self.errors}

    def failure(self, cause: Optional[BaseException], wait: float = 10.0) -> BaseException:
        """The error the driver raises for `cause` (a failed collective): it names the worker
        that failed and quotes its traceback. `cause` itself when every worker is fine."""
        if self.failed is not None:
            return self.failed
        deadline = time.monotonic() + wait
        dead = self.dead()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)  # a worker that raised exits right after sending its traceback
            dead = self.dead()
        if not dead:
            return cause
        parts = []
        for rank, code in sorted(dead.items()):
            if rank in self.errors:
                lines = self.errors[rank].strip().splitlines()
                what = "raised:\n    " + "\n    ".join(lines[-12:])
            elif code is not None and code < 0:
                what = f"was killed by {signal.Signals(-code).name}"
            else:
                what = f"exited with code {code}"
            parts.append(f"tensor-parallel worker rank {rank} (pid {self.procs[rank].pid}) {what}")
        self.failed = WorkerFailed(
            "\n".join(parts) + "\nEach process holds only 1/N of the model, so the engine "
            "cannot go on without that shard; its requests are lost. Build a new LLM / engine "
            "(after fixing the worker's error, if it raised).")
        self.stop()  # end the other workers and the process groups now: nothing can use them
        return self.failed

    def watch(self, backend: str) -> None:
        """NCCL only: abort the process group when a worker dies, so that kernels waiting for
        it fail instead of hanging (gloo's sockets fail by themselves)."""
        if backend != "nccl":
            return

        def watcher():
            while not self.stopped:
                if self.dead():
                    try:  # first: the kernels waiting for the dead rank fail, not hang
                        torch.distributed.distributed_c10d._abort_process_group()
                    except Exception:  # noqa: BLE001 (best effort; the error is logged)
                        pass
                    logger.error("%s", self.failure(None, wait=0))
                    return
                time.sleep(0.5)

        threading.Thread(target=watcher, name="minipaged-tp-watch", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Send STOP (while the group still works), wait, then end whoever is left."""
        if self.stopped:
            return
        self.stopped = True
        procs = list(self.procs.values())
        if (self.cpu_group is not None and self.failed is None
                and all(p.is_alive() for p in procs)):
            try:  # then meet the workers before any group goes (shutdown_barrier says why)
                from minipaged.distributed.step_inputs import STOP, send_header
                send_header(self.cpu_group, STOP)
                shutdown_barrier(self.cpu_group)
            except Exception:  # noqa: BLE001 (a worker died meanwhile: ended below)
                pass
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for pipe in self.pipes.values():
            pipe.close()
        destroy_groups(self.tp() if self.tp is not None else None)
        self.cpu_group = None


def _worker_process(rank: int, world_size: int, init_method: str, config, source, pipe,
                    parent_pid: int, num_threads: int) -> None:
    """A spawned worker: join the group, load the shard, follow the driver's steps."""
    try:
        torch.set_num_threads(getattr(config, "cpu_threads", None) or num_threads)  # the driver's
        _exit_with_parent(parent_pid)
        if config.is_cuda:
            torch.cuda.set_device(rank)
        pipe.send(("started",))
        tp = init_groups(rank, world_size, config.is_cuda, init_method)
        from minipaged.worker.tp_worker import run_worker
        run_worker(config, source, tp)
        destroy_groups(tp)
    except BaseException:  # noqa: BLE001 (reported to the driver, then this process ends)
        try:
            pipe.send(("error", traceback.format_exc()))
            pipe.close()
        finally:
            os._exit(1)
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker soon after the driver dies (a driver killed by SIGKILL runs no exit
    handlers; with NCCL nothing else would notice)."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="minipaged-tp-parent", daemon=True).start()
