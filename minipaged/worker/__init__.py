"""The device side of the engine: one step's tensors, the forward, the KV cache (lessons 03, 05, 08).

    model_runner.py   `SchedulerOutput` -> input_ids, positions, `AttentionMetadata` -> logits
    kv_cache.py       the KV cache tensor: sizing, allocation, copy-on-write, swap
    cuda_graphs.py    decode steps replayed from CUDA graphs (CUDA only)
"""
