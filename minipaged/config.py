"""`EngineConfig`: every knob of the engine in one place, checked before anything is allocated.

vLLM's names, vLLM's defaults where they make sense on a laptop, and errors that teach: each one
says what is wrong, the numbers involved, and which knob to turn (lesson 00 triggers them on
purpose).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GiB = 1024 ** 3
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    model: str = "stories260K"
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # None: see `resolve`
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: Optional[int] = None  # explicit cache size in blocks (wins over memory knobs)
    kv_cache_memory: Optional[int] = None  # explicit cache size in bytes (CPU default: see kv_cache)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap": preempted blocks wait in a CPU pool
    swap_space: Optional[float] = None  # GiB of CPU pool for "swap"; None: as large as the cache
    num_cpu_blocks: Optional[int] = None  # explicit CPU pool size in blocks (wins over swap_space)
    seed: int = 0
    device: str = "auto"
    attention_backend: Optional[str] = None  # None: "triton" on CUDA, "torch_ref" elsewhere
    # Fused Triton kernels for norms + residual adds, SiLU-and-multiply, q/k norm + RoPE + K/V
    # store (models/triton_ops.py). None: auto, on for CUDA with the triton backend. True needs
    # attention_backend="triton" (on the CPU under TRITON_INTERPRET=1: slow, for tests).
    fused_ops: Optional[bool] = None
    record_block_tables: bool = False  # snapshot every block table into the trace (lessons)
    enforce_eager: bool = False  # True: never replay decode steps from CUDA graphs
    # Plan and launch step t+1 while the GPU still runs step t; read step t's tokens one step
    # late (engine.py). None: on for CUDA, off on the CPU (no overlap to gain there).
    async_scheduling: Optional[bool] = None
    # What the KV cache stores: "auto" = the model's dtype; "fp8" (or "fp8_e4m3") = float8 e4m3,
    # one byte per element (vLLM's kv_cache_dtype): twice the tokens per GiB and half the bytes
    # each decode step reads, at 3 mantissa bits. Stored unscaled (vLLM's default scale of 1.0),
    # clamped to e4m3's range of +-448.
    kv_cache_dtype: str = "auto"

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r}: choose 'recompute' "
                             "(free the blocks, prefill again later) or 'swap' (copy the blocks "
                             "to CPU memory and back)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose one of "
                             f"{KV_CACHE_DTYPES}")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")

    def resolve(self, max_position_embeddings: int) -> None:
        """Fill the `None` defaults from the model and check them against it."""
        if self.max_model_len is None:
            self.max_model_len = max_position_embeddings
        elif self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={max_position_embeddings}: positions beyond the trained "
                f"context give garbage. Use max_model_len <= {max_position_embeddings}.")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (2048 if self.enable_chunked_prefill
                                           else max(self.max_model_len, 2048))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}; without chunked prefill a prompt that long "
                f"could never be scheduled. Raise max_num_batched_tokens, lower max_model_len, "
                f"or set enable_chunked_prefill=True.")


def kv_cache_too_small_error(*, max_model_len: int, bytes_per_token: int, available_bytes: int,
                             block_size: int, source: str) -> ValueError:
    """vLLM-style message: needed vs available GiB, the largest max_model_len that fits, knobs."""
    blocks_needed = -(-max_model_len // block_size)
    needed = blocks_needed * block_size * bytes_per_token
    fits = (available_bytes // (bytes_per_token * block_size)) * block_size
    return ValueError(
        f"To serve at least one request with max_model_len={max_model_len}, the KV cache needs "
        f"{needed / GiB:.4f} GiB ({bytes_per_token} bytes per token), but only "
        f"{available_bytes / GiB:.4f} GiB is available for it ({source}). The largest "
        f"max_model_len that fits is {fits}. Lower max_model_len, or give the cache more memory: "
        f"raise gpu_memory_utilization (on a GPU), or num_blocks / kv_cache_memory.")
