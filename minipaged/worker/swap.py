"""Swap preemption (lesson 06): a CPU pool of KV blocks, and the copies out to it and back.

With `preemption_mode="swap"` a preempted sequence's blocks are copied to a second tensor in CPU
memory (pinned on CUDA, so the copies are asynchronous DMA) instead of being dropped; the block
manager keeps its CPU block table (swap/block_manager.py), and the copies come back into fresh
GPU blocks when the scheduler readmits it (swap/scheduler.py). This module does the copies.
"""
from __future__ import annotations

from typing import Optional

import torch

from minipaged.config import GiB, EngineConfig
from minipaged.utils import to_device
from minipaged.worker.kv_dtype import raw

def determine_num_cpu_blocks(cfg: EngineConfig, per_block_bytes: int, num_gpu_blocks: int) -> int:
    """CPU pool size for `preemption_mode="swap"`: `num_cpu_blocks`, else `swap_space` GiB,
    else as many blocks as the KV cache (every preempted block then fits). 0 without swap."""
    if cfg.preemption_mode != "swap":
        return 0
    if cfg.num_cpu_blocks is not None:
        return cfg.num_cpu_blocks
    if cfg.swap_space is not None:
        return int(cfg.swap_space * GiB) // per_block_bytes
    return num_gpu_blocks


def allocate_cpu_cache(kv_cache: torch.Tensor, num_cpu_blocks: int) -> Optional[torch.Tensor]:
    """The CPU block pool, block-major: (num_cpu_blocks, num_layers, 2, block_size, kv_heads,
    head_dim), so that a run of CPU blocks is one contiguous piece of memory (one transfer). Pinned
    (page-locked) when the cache is on a GPU, so that copies to and from it are asynchronous DMA."""
    if num_cpu_blocks <= 0:
        return None
    shape = (num_cpu_blocks,) + kv_cache.shape[:2] + kv_cache.shape[3:]
    return torch.empty(shape, dtype=kv_cache.dtype, device="cpu",
                       pin_memory=kv_cache.device.type == "cuda")


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in `ids`, first id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def swap_out_blocks(kv_cache: torch.Tensor, cpu_cache: torch.Tensor,
                    mapping: list[tuple[int, int]]) -> None:
    """Copy GPU blocks to CPU blocks, (gpu, cpu) pairs, every layer, K and V.

    One indexing kernel gathers the blocks into a contiguous block-major buffer on the device;
    each run of consecutive CPU block ids is then one transfer (the CPU allocator hands blocks
    out in order, so usually there is one run). A swap is a few large copies whatever the block
    size. vLLM v0 issued one cudaMemcpyAsync per block, layer and K/V instead, which is why the
    paper found small blocks slow to swap (`benchmarks/preemption.py --micro` times both).
    """
    if not mapping:
        return
    mapping = sorted(mapping, key=lambda m: m[1])
    idx = to_device([g for g, _ in mapping], kv_cache.device, torch.long)
    staged = raw(kv_cache)[:, :, idx].movedim(2, 0).contiguous()  # (n, layers, 2, block, heads, dim)
    for i, c, r in _runs([c for _, c in mapping]):
        raw(cpu_cache)[c:c + r].copy_(staged[i:i + r], non_blocking=True)


def swap_in_blocks(cpu_cache: torch.Tensor, kv_cache: torch.Tensor,
                   mapping: list[tuple[int, int]]) -> None:
    """Copy CPU blocks back into GPU blocks, (cpu, gpu) pairs: `swap_out_blocks` reversed."""
    if not mapping:
        return
    mapping = sorted(mapping)
    staged = torch.empty((len(mapping),) + cpu_cache.shape[1:], dtype=raw(kv_cache).dtype,
                         device=kv_cache.device)
    for i, c, r in _runs([c for c, _ in mapping]):
        staged[i:i + r].copy_(raw(cpu_cache)[c:c + r], non_blocking=True)
    idx = to_device([g for _, g in mapping], kv_cache.device, torch.long)
    raw(kv_cache)[:, :, idx] = staged.movedim(0, 2)
