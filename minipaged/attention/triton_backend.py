"""The Triton attention backend: `triton_kernels.py` behind the `AttentionBackend` interface.

Per step, `prepare` looks at the host copies of the step's lengths once (is this a decode-only
step? how long is the longest context? do decodes lead a mixed step?) and leaves a `TritonPlan`
on the metadata. Per layer, `forward` stores the new K/V into their slots and calls `attend`,
which launches the attention kernel (plus the split-KV reduction when the plan splits) once, or
twice for a mixed step whose decodes come first (decode tiles for those, prefill tiles for the
prompts); a model with `fused_ops` stores K/V in its own fused kernel and calls `attend` directly. Launch shapes come from host ints only: neither
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
    """One kernel launch over the sequences [first_seq, first_seq + num_seqs) of the step; the
    same for every layer of the step."""

    first_seq: int
    num_seqs: int
    tokens: Optional[tuple[int, int]]  # the rows of q those sequences own; None: all
    max_query_len: int
    config: tk.KernelConfig
    num_splits: int
    workspace: Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TritonPlan:
    decode_only: bool  # every sequence has query length 1
    num_seqs: int
    max_query_len: int
    max_context_len: int
    # A mixed step whose first `num_decodes` sequences have query length 1 (the GPU model runner
    # puts decodes first) attends in two launches: those sequences with the decode tiles, the
    # rest with the prefill tiles. One launch with prefill tiles would give each decode a tile
    # of 128 query rows of which 2 are real. 0: one launch for the whole step.
    num_decodes: int = 0
    max_decode_context_len: int = 0
    max_prefill_context_len: int = 0
    num_real_tokens: int = 0  # tokens that belong to a sequence (padding rows come after)
    # (num_heads, num_kv_heads, head_dim, dtype) -> launches; filled by the first layer's forward
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
        decode_only = metadata.max_query_len == 1
        num_decodes = max_decode_ctx = max_prefill_ctx = 0
        if not decode_only:
            lens = metadata.query_lens
            while num_decodes < len(lens) and lens[num_decodes] == 1:
                num_decodes += 1
            if num_decodes:
                max_decode_ctx = max(metadata.context_lens_host[:num_decodes])
                max_prefill_ctx = max(metadata.context_lens_host[num_decodes:], default=0)
        metadata.plan = TritonPlan(decode_only=decode_only, num_seqs=metadata.num_seqs,
                                   max_query_len=metadata.max_query_len,
                                   max_context_len=metadata.max_context_len,
                                   num_decodes=num_decodes, max_decode_context_len=max_decode_ctx,
                                   max_prefill_context_len=max_prefill_ctx,
                                   num_real_tokens=sum(metadata.query_lens))

    def _launches(self, plan: TritonPlan, q: torch.Tensor, k_cache: torch.Tensor) -> list[_Launch]:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        key = (num_heads, num_kv_heads, head_dim, q.dtype)
        launches = plan.launches.get(key)
        if launches is not None:
            return launches
        group = num_heads // num_kv_heads
        interpret = q.device.type == "cpu"

        def launch(first_seq, num_seqs, max_query_len, max_context_len, tokens=None):
            if max_query_len == 1:
                config = tk.decode_config(head_dim, group, interpret)
            else:
                config = tk.prefill_config(head_dim, group, max_query_len, interpret)
            num_splits = self.num_splits
            if num_splits is None:
                block_q = config.block_m // tk.triton.next_power_of_2(group)
                programs = num_seqs * tk.triton.cdiv(max_query_len, block_q) * num_kv_heads
                num_splits = tk.choose_num_splits(programs, max_context_len, config,
                                                  num_sms(q.device))
            workspace = None
            if num_splits > 1:  # shared by all layers of the step: they run one after another
                # rows are indexed by the token's place in the whole step: up to the launch's end
                rows = num_tokens if tokens is None else tokens[1]
                workspace = tk.split_workspace(rows, num_heads, head_dim, num_splits, q.device)
            return _Launch(first_seq, num_seqs, tokens, max_query_len, config, num_splits,
                           workspace)

        if plan.num_decodes and plan.num_decodes < plan.num_seqs:  # decodes first, then prefills
            nd = plan.num_decodes  # one token each: the decodes own rows 0 .. nd of q
            decodes = launch(0, nd, 1, plan.max_decode_context_len, tokens=(0, nd))
            prefills = launch(nd, plan.num_seqs - nd, plan.max_query_len,
                              plan.max_prefill_context_len, tokens=(nd, plan.num_real_tokens))
            launches = [decodes, prefills]
        else:
            launches = [launch(0, plan.num_seqs, plan.max_query_len, plan.max_context_len)]
        plan.launches[key] = launches
        return launches

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
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (num_tokens, heads, dim)
        for launch in self._launches(plan, q, k_cache):
            # the kernel finds each sequence's tokens through cu_seqlens_q, which holds positions
            # in the whole step: a launch over a slice of the sequences writes its rows of `out`
            seqs = slice(launch.first_seq, launch.first_seq + launch.num_seqs)
            tk.paged_attention(
                q, k_cache, v_cache, metadata.block_tables[seqs], metadata.context_lens[seqs],
                metadata.cu_seqlens_q[launch.first_seq:seqs.stop + 1], scale,
                num_seqs=launch.num_seqs, max_query_len=launch.max_query_len,
                config=launch.config, num_splits=launch.num_splits, workspace=launch.workspace,
                out=out, tokens=launch.tokens)
        return out
