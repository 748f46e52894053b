"""The device side of the engine: one step's tensors, the forward, the KV cache (lessons 03, 05, 08).

    model_runner.py       `SchedulerOutput` -> input_ids, positions, `AttentionMetadata` -> logits
    runners.py            which of the runners below a resolved config asks for
    cpu_model_runner.py   the same step with decodes in context-length order (CPU attention)
    direct_calls.py       the CPU runner's modules calling forward directly (no nn.Module frames)
    kv_cache.py           the KV cache tensor: sizing, allocation, copy-on-write
    swap.py               swap preemption's CPU block pool and its copies (lesson 06)
    gpu_model_runner.py   the same step built for a GPU: ordered, packed, padded; CUDA graphs
    cuda_graphs.py        decode steps recorded once per batch size and replayed; the runner's
                          registry of graph sets (decode, verify, LoRA's base)
    wrapper.py            RunnerWrapper: a runner around a runner, delegating explicitly
    tp_worker.py          tensor parallelism: the driver's runner that broadcasts each step, and
                          the loop a worker process runs (lesson 09)
"""
from __future__ import annotations


def make_model_runner(config, model, kv_cache, backend):
    """The runner a resolved `EngineConfig` asks for, chosen once: the single-device one
    (runners.py), or with tensor parallelism the driver's runner around it (tp_worker.py)."""
    if config.tensor_parallel_size > 1:
        from minipaged.worker.tp_worker import make_driver_runner
        return make_driver_runner(config, model, kv_cache, backend)
    from minipaged.worker.runners import single_device_runner
    return single_device_runner(config, model, kv_cache, backend)
