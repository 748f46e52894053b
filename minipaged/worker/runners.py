"""Which single-device runner a resolved `EngineConfig` asks for, chosen once (lessons 03, 08).

`make_model_runner` (worker/__init__.py) calls it for one device; with tensor parallelism every
rank wraps the runner it returns (tp_worker.py), so both import it from here.
"""
from __future__ import annotations


def single_device_runner(config, model, kv_cache, backend):
    """The readable `ModelRunner` on the CPU (`CPUModelRunner` with the CPU attention backend),
    `GPUModelRunner` on CUDA and wherever async scheduling gathers input tokens on the device."""
    if not config.gpu_tuned_inputs and config.attention_backend == "cpu":
        from minipaged.worker.cpu_model_runner import CPUModelRunner
        return CPUModelRunner(model, kv_cache, backend, config.block_size)
    if not config.gpu_tuned_inputs:
        from minipaged.worker.model_runner import ModelRunner
        return ModelRunner(model, kv_cache, backend, config.block_size)
    from minipaged.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner(model, kv_cache, backend, config.block_size,
                          max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                          cuda_graphs=config.use_cuda_graphs,
                          logits_in_graphs=config.tensor_parallel_size == 1)
