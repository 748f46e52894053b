"""The physical KV cache: one tensor holding every layer's K and V blocks.

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              layer ─┘    └─ 0 = K, 1 = V

Per layer this is vLLM's Triton layout `[num_blocks, block_size, num_kv_heads, head_dim]`: one
block-table entry addresses a contiguous slab. Slot `s` is (block s // block_size, offset
s % block_size). On CUDA with the Triton backend the same logical tensor is stored head-major,
`[num_blocks, num_kv_heads, block_size, head_dim]` in memory and transposed back in the view:
every kernel follows strides, and a decode program, which reads one KV head of a sequence, then
reads each block as one contiguous run (16 x 128 bf16 = 4 KB) instead of 16 runs of 256 bytes.
Code that needs flat slots (`torch_ref`) keeps the plain layout. Lesson 00 derives the size formula

    bytes per token = 2 x num_layers x num_kv_heads x head_dim x bytes_per_element

and lesson 01 shows why handing it out block by block wastes so little.

How many blocks: an explicit `num_blocks`, else an explicit `kv_cache_memory` (bytes), else on
CUDA what is left of `gpu_memory_utilization x total memory` after weights and a profiled forward
pass at `max_num_batched_tokens`, else on CPU enough for `max_num_seqs` full-length sequences,
capped at 4 GiB.

With `preemption_mode="swap"` a second tensor in CPU memory holds the blocks of swapped-out
sequences (lesson 06): `worker/swap.py`. What the cache stores (kv_cache_dtype, float8's
rules) is `worker/kv_dtype.py`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from minipaged.config import GiB, EngineConfig, kv_cache_too_small_error
from minipaged.models.config import ModelConfig
from minipaged.utils import cdiv, to_device
# the dtype helpers live in a leaf module (the attention backends read them); their old home
# re-exports them
from minipaged.worker.kv_dtype import (FP8_MAX, is_fp8, kv_cache_torch_dtype,  # noqa: F401
                                       raw, to_cache_dtype)

CPU_DEFAULT_CAP = 4 * GiB


def block_bytes(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return model_cfg.kv_bytes_per_token(dtype) * block_size


def determine_num_blocks(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                         device: torch.device, profile: Optional[Callable[[], int]] = None) -> int:
    """Number of blocks the cache gets; raises if one `max_model_len` sequence does not fit.

    `profile()` (CUDA only) runs a dummy forward at the largest step and returns the peak bytes of
    activations it needed on top of what was allocated before.
    """
    per_block = block_bytes(model_cfg, cfg.block_size, dtype)
    if cfg.num_blocks is not None:
        num_blocks, available, source = cfg.num_blocks, cfg.num_blocks * per_block, \
            f"num_blocks={cfg.num_blocks}"
    elif cfg.kv_cache_memory is not None:
        available, source = int(cfg.kv_cache_memory), f"kv_cache_memory={cfg.kv_cache_memory}"
        num_blocks = available // per_block
    elif device.type == "cuda":
        activations = profile() if profile is not None else 0
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free  # our weights, and anything else already on the GPU
        available = int(total * cfg.gpu_memory_utilization) - in_use - activations
        source = (f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / GiB:.2f} GiB, "
                  f"minus {in_use / GiB:.2f} GiB already in use (weights, other engines or "
                  f"processes) and {activations / GiB:.2f} GiB peak activations")
        num_blocks = max(available, 0) // per_block
    else:
        want = cfg.max_num_seqs * cdiv(cfg.max_model_len, cfg.block_size)
        num_blocks = max(1, min(want, CPU_DEFAULT_CAP // per_block))
        available, source = num_blocks * per_block, "CPU default"
    if num_blocks * cfg.block_size < cfg.max_model_len:
        raise kv_cache_too_small_error(max_model_len=cfg.max_model_len,
                                       bytes_per_token=model_cfg.kv_bytes_per_token(dtype),
                                       available_bytes=max(available, 0),
                                       block_size=cfg.block_size,
                                       source=source + _per_rank(cfg, model_cfg))
    return int(num_blocks)


def _per_rank(cfg: EngineConfig, model_cfg: ModelConfig) -> str:
    n = cfg.tensor_parallel_size
    if n == 1:
        return ""
    return (f"; per rank: with tensor_parallel_size={n} each of the {n} processes holds "
            f"{model_cfg.num_key_value_heads} of the {model_cfg.num_key_value_heads * n} KV "
            f"heads, so every number here is one rank's share")


def allocate_kv_cache(model_cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device,
                      head_major: bool = False) -> torch.Tensor:
    """(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), zeroed; with `head_major`
    a transposed view of (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim) memory."""
    layers, heads, dim = model_cfg.num_hidden_layers, model_cfg.num_key_value_heads, model_cfg.head_dim
    if head_major:
        return torch.zeros((layers, 2, num_blocks, heads, block_size, dim), dtype=dtype,
                           device=device).transpose(3, 4)
    return torch.zeros((layers, 2, num_blocks, block_size, heads, dim), dtype=dtype, device=device)


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicate whole blocks, every layer, K and V at once."""
    if not copies:
        return
    src = to_device([s for s, _ in copies], kv_cache.device)
    dst = to_device([d for _, d in copies], kv_cache.device)
    kv_cache = raw(kv_cache)
    kv_cache[:, :, dst] = kv_cache[:, :, src]
