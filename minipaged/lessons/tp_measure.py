"""Lesson 09's measurements: one tensor-parallel decode step timed with gloo, split into
compute and communication (the pictures and shards are in tp.py).

    measure(world_size, models, ...)
        spawns `world_size` processes (one torch thread each) that run one step of each model
        the engine's way (TPDriverRunner.execute on rank 0, run_worker's loop on the others),
        counting the collectives its forward makes; then the same step's collectives alone and
        its compute alone (wall and CPU time), then all-reduces of several sizes; best of
        `repeats` each. Returns `StepSplit`s (tp.py) and the all-reduce times.

The measured step is one decode step of `num_seqs` sequences built as the scheduler would
(`ModelRunner.prepare_inputs` on a stand-in SchedulerOutput), so the tensors, the broadcast, the
forward and the collectives are the engine's own. Nothing here is on the engine's path.
"""
from __future__ import annotations

import os
import time
import traceback
from types import SimpleNamespace
from typing import Sequence

import torch

from minipaged.lessons.tp import RANDOM_NAME, StepSplit, model_label, model_source


# --- measuring ----------------------------------------------------------------------------------
def decode_sched(num_seqs: int, context_len: int, block_size: int, vocab: int):
    """A stand-in SchedulerOutput: `num_seqs` sequences of `context_len` tokens, each decoding
    its last one, blocks allotted back to back (what prepare_inputs reads of a real one)."""
    per = -(-context_len // block_size)
    items = []
    for i in range(num_seqs):
        seq = SimpleNamespace(num_computed_tokens=context_len - 1,
                              token_ids=[(7 * i + 3 * p) % vocab for p in range(context_len)])
        items.append(SimpleNamespace(seq=seq, num_new_tokens=1, samples=True, spec_token_ids=[],
                                     block_table=list(range(i * per, (i + 1) * per))))
    return SimpleNamespace(scheduled=items, blocks_to_copy=[], blocks_to_swap_out=[],
                           blocks_to_swap_in=[]), num_seqs * per


def _best(fn, repeats: int, sync=None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread): the least of each over `repeats` calls,
    every call started together with the other ranks by `sync` (a barrier)."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.thread_time() - c0)
    return wall, cpu


def _build(model: str, tp, block_size: int, num_blocks: int):
    from minipaged.attention import get_attention_backend
    from minipaged.models.loader import load_model
    from minipaged.worker.kv_cache import allocate_kv_cache
    from minipaged.worker.model_runner import ModelRunner
    source = model_source(model)
    backend = get_attention_backend("torch_ref", "cpu")
    torch.manual_seed(0)
    net, _ = load_model(source, torch.float32, torch.device("cpu"), backend, max_positions=1024,
                        seed=0, tp=tp)
    kv = allocate_kv_cache(net.config, num_blocks, block_size, torch.float32, torch.device("cpu"))
    return ModelRunner(net, kv, backend, block_size), net


def _rank_main(rank, world, init_method, models, num_seqs, context_len, sizes, repeats,
               sweep_repeats, queue):
    """One rank of `measure`: every phase in lockstep with the others."""
    try:
        torch.set_num_threads(1)
        out = _rank_phases(rank, world, init_method, models, num_seqs, context_len, sizes,
                           repeats, sweep_repeats)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from minipaged.distributed.parallel_state import destroy_groups
        destroy_groups()


def _rank_phases(rank, world, init_method, models, num_seqs, context_len, sizes, repeats,
                 sweep_repeats):
    import torch.distributed as dist
    import minipaged.models.parallel_layers as pl
    from minipaged.distributed.step_inputs import (STOP, StepInputs, broadcast_step, recv_header,
                                                   recv_step, send_header)
    from minipaged.models.config import ModelConfig

    tp = None
    if world > 1:
        from minipaged.distributed.parallel_state import init_groups
        tp = init_groups(rank, world, False, init_method)
    sync = (lambda: dist.barrier(group=tp.device_group)) if tp else None
    block_size = 16
    results = {"steps": [], "all_reduce": {}}
    real_all_reduce, real_gather = pl.all_reduce, pl.gather_to_driver
    for model in models:
        cfg, label = ModelConfig.from_dict(model_source(model).config), model_label(model)
        sched, num_blocks = decode_sched(num_seqs, context_len, block_size, cfg.vocab_size)
        runner, net = _build(model, tp, block_size, num_blocks)
        params = sum(p.numel() for p in net.parameters())
        with torch.inference_mode():
            ids, pos, meta, rows = runner.prepare_inputs(sched)

            def compute_only():
                runner.compute_logits(runner.forward(ids, pos, meta), rows)

            if tp is None:  # N = 1: the engine's ModelRunner.execute, nothing to communicate
                compute_only()
                t, cpu = _best(lambda: runner.execute(sched), repeats)
                results["steps"].append(StepSplit(label, 1, num_seqs, t, 0.0, t, cpu, {},
                                                  params))
                continue
            from minipaged.worker.tp_worker import TPDriverRunner
            # 1. the engine's step: the driver's execute, the workers' loop (run_worker's body)
            counts: dict = {}

            def counting(real, key):
                def wrapped(x, *a, **k):
                    counts[(key, tuple(x.shape))] = counts.get((key, tuple(x.shape)), 0) + 1
                    return real(x, *a, **k)
                return wrapped

            pl.all_reduce = counting(real_all_reduce, "all_reduce")
            pl.gather_to_driver = counting(real_gather, "gather")
            if rank == 0:
                driver = TPDriverRunner(runner, tp)
                driver.execute(sched)  # counted, and warm
                pl.all_reduce, pl.gather_to_driver = real_all_reduce, real_gather
                step_s, _ = _best(lambda: driver.execute(sched), repeats)
                send_header(tp.cpu_group, STOP)
            else:
                first = True
                while True:
                    header = recv_header(tp)
                    if header[0] == STOP:
                        break
                    step = recv_step(tp, header, runner.device, block_size)
                    runner.compute_logits(runner.forward(step.input_ids, step.positions,
                                                         step.metadata), step.sample_rows)
                    if first:
                        pl.all_reduce, pl.gather_to_driver = real_all_reduce, real_gather
                        first = False
            # 2. the same collectives alone, same order and sizes
            hidden = torch.zeros(ids.shape[0], cfg.hidden_size)
            part = torch.zeros(len(rows), cfg.vocab_size // world)

            def comm_only():
                if rank == 0:
                    broadcast_step(tp, StepInputs(ids, pos, meta, rows, []))
                else:
                    recv_step(tp, recv_header(tp), runner.device, block_size)
                for _ in range(1 + 2 * cfg.num_hidden_layers):
                    real_all_reduce(hidden, tp)
                real_gather(part, tp)

            comm_only()
            comm_s, _ = _best(comm_only, repeats, sync)
            # 3. the same forward with its collectives skipped, every rank at once
            pl.all_reduce = lambda x, tp: x
            pl.gather_to_driver = lambda x, tp, dim=-1: x
            compute_only()
            compute_s, compute_cpu = _best(compute_only, repeats, sync)
            pl.all_reduce, pl.gather_to_driver = real_all_reduce, real_gather
            slowest = torch.tensor([compute_s, compute_cpu], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=tp.device_group)
            if rank == 0:
                collectives = {f"{k} {list(s)}": c for (k, s), c in sorted(counts.items())}
                results["steps"].append(StepSplit(label, world, num_seqs, step_s, comm_s,
                                                  float(slowest[0]), float(slowest[1]),
                                                  collectives, params))
        runner = net = None  # this model's weights go before the next one's
    if tp is not None:  # all-reduces of several sizes, nothing else running
        for size in sizes:
            x = torch.zeros(max(1, size // 4))
            real_all_reduce(x, tp)
            results["all_reduce"][size] = _best(lambda: real_all_reduce(x, tp), sweep_repeats,
                                                sync)[0]
    return results if rank == 0 else None


def measure(world_size: int, models: Sequence = ("stories260K", RANDOM_NAME),
            num_seqs: int = 32, context_len: int = 64, sizes: Sequence[int] = (),
            repeats: int = 5, sweep_repeats: int = 20, timeout: float = 300.0) -> dict:
    """Spawn `world_size` ranks (one torch thread each; N=1 runs in one spawned process too)
    and measure; returns {"steps": [StepSplit per model], "all_reduce": {bytes: seconds}}.

    `models`: names or random configs (see `model_source`). Per model: a decode step of
    `num_seqs` sequences of `context_len` tokens, best of `repeats` (the step, its collectives
    alone, its compute alone); then one all-reduce of each of `sizes` bytes, best of
    `sweep_repeats`."""
    return run_ranks(_rank_main, world_size, (tuple(models), num_seqs, context_len,
                                              tuple(sizes), repeats, sweep_repeats),
                     timeout, "a measuring rank")[0]


def run_ranks(target, world_size: int, args: tuple, timeout: float, what: str) -> dict:
    """Spawn `world_size` processes running `target(rank, world_size, init_method, *args,
    queue)` (one torch thread each) and collect what each puts on the queue: (rank, "ok",
    payload) or (rank, "error", traceback). Returns {rank: payload}; the first error raises."""
    from minipaged.distributed.launch import _main_module_hidden  # as the engine spawns
    from minipaged.distributed.parallel_state import free_port
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's OpenMP pools, before they start
    try:
        procs = [ctx.Process(target=target, daemon=True,
                             args=(r, world_size, init, *args, queue))
                 for r in range(world_size)]
        with _main_module_hidden():  # a notebook's or script's __main__ is not re-run
            for p in procs:
                p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    got, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size and not errors:
            rank, status, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(10 if not errors else 1)
            if p.is_alive():
                p.terminate()
                p.join(5)
    if errors:
        raise RuntimeError(f"{what} failed: " + "\n".join(errors))
    return got
