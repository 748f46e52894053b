"""The device side of the engine: one step's tensors, the forward, the KV cache (lessons 03, 05, 08).

    model_runner.py       `SchedulerOutput` -> input_ids, positions, `AttentionMetadata` -> logits
    cpu_model_runner.py   the same step with decodes in context-length order (CPU attention)
    direct_calls.py       the CPU runner's modules calling forward directly (no nn.Module frames)
    kv_cache.py           the KV cache tensor: sizing, allocation, copy-on-write
    swap.py               swap preemption's CPU block pool and its copies (lesson 06)
    gpu_model_runner.py   the same step built for a GPU: ordered, packed, padded; CUDA graphs
    cuda_graphs.py        decode steps recorded once per batch size and replayed
    tp_worker.py          tensor parallelism: the driver's runner that broadcasts each step, and
                          the loop a worker process runs (lesson 09)
"""
from __future__ import annotations


def make_model_runner(config, model, kv_cache, backend):
    """The runner a resolved `EngineConfig` asks for, chosen once: the readable `ModelRunner`
    on the CPU (`CPUModelRunner` with the CPU attention backend), `GPUModelRunner` on CUDA and
    wherever async scheduling gathers input tokens on the device. With tensor parallelism, the
    same runner drives the workers too (tp_worker.py)."""
    if config.tensor_parallel_size > 1:
        from minipaged.worker.tp_worker import make_driver_runner
        return make_driver_runner(config, model, kv_cache, backend)
    if not config.gpu_tuned_inputs and config.attention_backend == "cpu":
        from minipaged.worker.cpu_model_runner import CPUModelRunner
        return CPUModelRunner(model, kv_cache, backend, config.block_size)
    if not config.gpu_tuned_inputs:
        from minipaged.worker.model_runner import ModelRunner
        return ModelRunner(model, kv_cache, backend, config.block_size)
    from minipaged.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner(model, kv_cache, backend, config.block_size,
                          max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                          cuda_graphs=config.use_cuda_graphs)
