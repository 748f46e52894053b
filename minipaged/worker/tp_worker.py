"""Tensor parallelism's two loops over one step (lesson 09).

Driver (rank 0, the engine's process): `TPDriverRunner.execute(sched)` is `ModelRunner.execute`
with one line added: after building the step's tensors it broadcasts them to the workers
(distributed/step_inputs.py), then runs its own shard of the forward. The row-parallel layers'
all-reduces and the LM head's gather meet the workers' inside the forward; the logits come out
whole on the driver, which samples as on one device.

Worker (ranks 1 .. N-1): `run_worker` loads its shard, allocates its KV cache (the driver's
num_blocks, its 1/N of the KV heads) and its shard of the swap pool, and then waits for a step, runs it, waits again, until the
driver says STOP. It never sees a sequence, the scheduler or the block manager.

The runner inside either is the single-device one (`ModelRunner`, or `GPUModelRunner` with its
CUDA graphs, which every rank captures in the same order and whose `forward` replays them),
built by `single_device_runner` (runners.py); the driver's wraps it (worker/wrapper.py).
"""
from __future__ import annotations

import torch

from minipaged.distributed.parallel_state import TPGroup, shutdown_barrier
from minipaged.distributed.step_inputs import (STEP, STOP, StepInputs, broadcast_sizes,
                                               broadcast_step, recv_header, recv_step)
from minipaged.worker.kv_cache import copy_blocks
from minipaged.worker.kv_dtype import raw
from minipaged.worker.runners import single_device_runner
from minipaged.worker.wrapper import RunnerWrapper
from minipaged.worker.swap import (allocate_cpu_cache, determine_num_cpu_blocks, swap_in_blocks,
                                   swap_out_blocks)


def make_driver_runner(config, model, kv_cache, backend) -> "TPDriverRunner":
    tp = model.tp
    num_blocks = kv_cache.shape[2]  # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    num_cpu_blocks = determine_num_cpu_blocks(config, raw(kv_cache)[:, :, 0].nbytes, num_blocks)
    broadcast_sizes(tp, num_blocks, num_cpu_blocks)  # the workers size their caches from them
    return TPDriverRunner(single_device_runner(config, model, kv_cache, backend), tp)


class TPDriverRunner(RunnerWrapper):
    """The driver's runner: the single-device runner, plus the broadcast of every step."""

    def __init__(self, runner, tp: TPGroup):
        super().__init__(runner)
        self.tp = tp

    @torch.inference_mode()
    def execute(self, sched, *pending) -> torch.Tensor:
        """Broadcast the step, run this rank's shard; logits (num_sampling_seqs, vocab)."""
        workers = self.tp.workers
        if workers is not None and workers.failed is not None:
            raise type(workers.failed)(*workers.failed.args)  # a dead engine, every call
        try:
            r = self.runner
            copy_blocks(r.kv_cache, sched.blocks_to_copy)
            input_ids, positions, metadata, sample_rows = r.prepare_inputs(sched, *pending)
            broadcast_step(self.tp, StepInputs(input_ids, positions, metadata, sample_rows,
                                               sched.blocks_to_copy, sched.blocks_to_swap_out,
                                               sched.blocks_to_swap_in))
            hidden = r.forward(input_ids, positions, metadata)  # a CUDA graph where one fits
            return r.compute_logits(hidden, sample_rows)
        except RuntimeError as exc:  # a collective failed: was it a worker?
            if workers is None:
                raise
            failure = workers.failure(exc)
            if failure is exc:
                raise
            raise failure from exc


def run_worker(config, source, tp: TPGroup) -> None:
    """A worker's life: load the shard, size the KV cache with the driver, follow its steps."""
    from minipaged.attention import get_attention_backend
    from minipaged.models.config import parse_dtype
    from minipaged.models.loader import load_model
    from minipaged.worker.kv_cache import allocate_kv_cache
    from minipaged.worker.kv_dtype import kv_cache_torch_dtype

    device = torch.device(f"cuda:{torch.cuda.current_device()}" if config.is_cuda else "cpu")
    dtype = parse_dtype(config.dtype)
    backend = get_attention_backend(config.attention_backend, config.device)
    torch.manual_seed(config.seed)
    model, _ = load_model(source, dtype, device, backend, max_positions=config.max_model_len,
                          seed=config.seed, fused_ops=config.fused_ops, tp=tp,
                          quantization=config.quantization)
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    if config.is_cuda and config.num_blocks is None and config.kv_cache_memory is None:
        # the driver sizes its cache from a profiled forward: run it alongside (collectives)
        from minipaged.worker.gpu_model_runner import profile_peak_memory
        profile_peak_memory(model, backend, model.config, config, kv_dtype, device)
    num_blocks, num_cpu_blocks = broadcast_sizes(tp, 0, 0)
    kv_cache = allocate_kv_cache(model.config, num_blocks, config.block_size, kv_dtype, device,
                                 head_major=config.kv_head_major)
    cpu_cache = allocate_cpu_cache(kv_cache, num_cpu_blocks)  # its shard of the swap pool
    runner = single_device_runner(config, model, kv_cache, backend)
    with torch.inference_mode():
        while True:
            header = recv_header(tp)
            if header[0] == STOP:
                shutdown_barrier(tp.cpu_group)  # the driver waits there too, then both destroy
                return
            if header[0] != STEP:
                raise RuntimeError(f"unexpected message {header[0]} from the driver")
            step = recv_step(tp, header, device, config.block_size)
            # the driver's order: swap out, swap in (swap/runner.py), copy (CoW)
            swap_out_blocks(kv_cache, cpu_cache, step.blocks_to_swap_out)
            swap_in_blocks(cpu_cache, kv_cache, step.blocks_to_swap_in)
            copy_blocks(runner.kv_cache, step.blocks_to_copy)
            hidden = runner.forward(step.input_ids, step.positions, step.metadata)
            runner.compute_logits(hidden, step.sample_rows)  # its words' scores, to the driver
