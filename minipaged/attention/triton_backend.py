"""The Triton attention backend: `triton_kernels.py` behind the `AttentionBackend` interface.

Per step, `prepare` looks at the host copies of the step's lengths once (is this a decode-only
step? how long is the longest context?) and leaves a `TritonPlan` on the metadata. Per layer,
`forward` stores the new K/V into their slots and calls `attend`, which launches the attention
kernel (plus the split-KV reduction when the plan splits); a model with `fused_ops` stores K/V in
its own fused kernel and calls `attend` directly. Launch shapes come from host ints only: neither
reads a device tensor back (no `.item()`, no `.tolist()`), so a decode step can be captured in a
CUDA graph.

On the CPU this runs under the Triton interpreter (TRITON_INTERPRET=1): correct, and slow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minipaged.attention import triton_kernels as tk
from minipaged.attention.metadata import AttentionBackend, AttentionMetadata

_NUM_SMS: dict[str, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill (132 on an H200). The CPU interpreter runs programs one
    after another, so there we pretend to have 1 and split only very long contexts."""
    if device.type != "cuda":
        return 1
    key = str(device)
    if key not in _NUM_SMS:
        _NUM_SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[key]


@dataclass
class _Launch:
    """Everything one layer's launch needs; identical for every layer of a step."""

    config: tk.KernelConfig
    num_splits: int
    workspace: Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TritonPlan:
    decode_only: bool  # every sequence has query length 1
    num_seqs: int
    max_query_len: int
    max_context_len: int
    # (num_heads, num_kv_heads, head_dim, dtype) -> launch; filled by the first layer's forward
    launches: dict = field(default_factory=dict)


class TritonBackend(AttentionBackend):
    """Paged attention through the Triton kernels of lesson 05.

    `num_splits` forces the split-KV factor (tests, benchmarks, CUDA-graph capture, which needs
    the same factor in every replay); by default `choose_num_splits` picks it per step.
    """

    name = "triton"

    def __init__(self, num_splits: Optional[int] = None):
        self.num_splits = num_splits

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.plan = TritonPlan(decode_only=metadata.max_query_len == 1,
                                   num_seqs=metadata.num_seqs,
                                   max_query_len=metadata.max_query_len,
                                   max_context_len=metadata.max_context_len)

    def _launch(self, plan: TritonPlan, q: torch.Tensor, k_cache: torch.Tensor) -> _Launch:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        key = (num_heads, num_kv_heads, head_dim, q.dtype)
        launch = plan.launches.get(key)
        if launch is not None:
            return launch
        group = num_heads // num_kv_heads
        interpret = q.device.type == "cpu"
        if plan.decode_only:
            config = tk.decode_config(head_dim, group, interpret)
        else:
            config = tk.prefill_config(head_dim, group, plan.max_query_len, interpret)
        num_splits = self.num_splits
        if num_splits is None:
            block_q = config.block_m // tk.triton.next_power_of_2(group)
            programs = plan.num_seqs * tk.triton.cdiv(plan.max_query_len, block_q) * num_kv_heads
            num_splits = tk.choose_num_splits(programs, plan.max_context_len, config,
                                              num_sms(q.device))
        workspace = None
        if num_splits > 1:  # shared by all layers of the step: they run one after another
            workspace = tk.split_workspace(num_tokens, num_heads, head_dim, num_splits, q.device)
        launch = plan.launches[key] = _Launch(config, num_splits, workspace)
        return launch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        # 1. store: each new token's K/V into its slot (slot -1 = padding, skipped in the kernel)
        tk.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        # 2. attend over the cache, which now holds this step's keys too
        return self.attend(q, k_cache, v_cache, metadata, scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention only: the step's K/V are already in the cache (`forward` stored them, or the
        model's fused q/k/v kernel did, see `models/triton_ops.py`). Returns (num_tokens, heads, dim)."""
        if metadata.plan is None or not isinstance(metadata.plan, TritonPlan):
            self.prepare(metadata)
        plan: TritonPlan = metadata.plan
        launch = self._launch(plan, q, k_cache)
        return tk.paged_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.context_lens,
            metadata.cu_seqlens_q, scale, num_seqs=plan.num_seqs,
            max_query_len=plan.max_query_len, config=launch.config,
            num_splits=launch.num_splits, workspace=launch.workspace)
