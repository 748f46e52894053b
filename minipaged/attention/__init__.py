"""Attention backends: how a step's queries read the paged KV cache.

* `torch_ref` (torch_ref.py): gathers each sequence's K/V through its block table and runs
  causal attention, one sequence at a time. The definition, and the oracle for every other one.
* `cpu` (cpu_backend.py): the same attention batched (batched_sdpa.py: one masked SDPA per group
  of sequences) with a paged decode path for decode-only steps (whole blocks gathered in L2-sized
  chunks, small KV heads packed into one SDPA problem). Default on the CPU.
* `triton` (triton_kernels.py): the Triton kernels of lesson 05. Default on CUDA.

Every backend implements `AttentionBackend` (metadata.py): `prepare(metadata)` once per step
(work that is the same for every layer), then `store_kv(...)` and `attend(...)` once per layer.
The model never knows which one runs; `EngineConfig.resolve` picks it (`default_backend_name`,
selector.py).
"""
from __future__ import annotations

from minipaged.attention.metadata import AttentionBackend, AttentionMetadata
from minipaged.attention.selector import BACKENDS, default_backend_name, triton_available


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    if name == "torch_ref":
        from minipaged.attention.torch_ref import TorchRefBackend
        return TorchRefBackend()
    if name == "cpu":
        from minipaged.attention.cpu_backend import CPUBackend
        return CPUBackend()
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the `triton` package, which ships "
                             "Linux wheels only; use attention_backend='torch_ref' here")
        import os
        if not str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' on the CPU needs TRITON_INTERPRET=1 in the "
                             "environment before minipaged is imported (the Triton interpreter); "
                             "or use attention_backend='torch_ref'")
        from minipaged.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose one of {BACKENDS}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend", "default_backend_name",
           "BACKENDS"]
