"""The physical KV cache: one tensor holding every layer's K and V blocks.

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              layer ─┘    └─ 0 = K, 1 = V

Per layer this is vLLM's Triton layout `[num_blocks, block_size, num_kv_heads, head_dim]`: one
block-table entry addresses a contiguous slab. Slot `s` is (block s // block_size, offset
s % block_size). On CUDA with the Triton backend the same logical tensor is stored head-major,
`[num_blocks, num_kv_heads, block_size, head_dim]` in memory and transposed back in the view:
every kernel follows strides, and a decode program, which reads one KV head of a sequence, then
reads each block as one contiguous run (16 x 128 bf16 = 4 KB) instead of 16 runs of 256 bytes;
on the H200 that reads 1-2% faster (benchmarks/attention_workload.py --head-major). Code that
needs flat slots (`torch_ref`) keeps the plain layout. Lesson 00 derives the size formula

    bytes per token = 2 x num_layers x num_kv_heads x head_dim x bytes_per_element

and lesson 01 shows why handing it out block by block wastes so little.

How many blocks: an explicit `num_blocks`, else an explicit `kv_cache_memory` (bytes), else on
CUDA what is left of `gpu_memory_utilization x total memory` after weights and a profiled forward
pass at `max_num_batched_tokens`, else on CPU enough for `max_num_seqs` full-length sequences,
capped at 4 GiB.

With `preemption_mode="swap"` a second tensor of the same layout in CPU memory (pinned on CUDA)
holds the blocks of swapped-out sequences (lesson 06): `swap_out_blocks` / `swap_in_blocks`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from minipaged.config import GiB, EngineConfig, kv_cache_too_small_error
from minipaged.models.config import ModelConfig

CPU_DEFAULT_CAP = 4 * GiB


FP8_MAX = 448.0  # the largest float8 e4m3 value


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`EngineConfig.kv_cache_dtype` as a torch dtype ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K/V in the cache's dtype; float8 clamps first (an out-of-range value would be NaN)."""
    if x.dtype == cache_dtype:
        return x
    if is_fp8(cache_dtype):
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes when the dtype is float8, whose indexing ops torch lacks; block
    copies and slot writes move bytes, so they go through this view."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def to_device(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Small host data (a list or numpy array) as a tensor on `device`, copied without making the
    host wait for the GPU: `torch.tensor(values, device="cuda")`, or a copy from ordinary pageable
    memory, can wait for every kernel already queued; a copy from pinned memory does not."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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
        want = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
        num_blocks = max(1, min(want, CPU_DEFAULT_CAP // per_block))
        available, source = num_blocks * per_block, "CPU default"
    if num_blocks * cfg.block_size < cfg.max_model_len:
        raise kv_cache_too_small_error(max_model_len=cfg.max_model_len,
                                       bytes_per_token=model_cfg.kv_bytes_per_token(dtype),
                                       available_bytes=max(available, 0),
                                       block_size=cfg.block_size, source=source)
    return int(num_blocks)


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


# --- swap preemption (lesson 06) ------------------------------------------------------------
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
