"""The Triton attention backend: `triton_kernels.py` behind the `AttentionBackend` interface.

Per step, `prepare` looks at the host copies of the step's lengths once (is this a decode-only
step? how long is the longest context? do decodes lead a mixed step?) and leaves a `TritonPlan`
on the metadata. Per layer, `forward` stores the new K/V into their slots and calls `attend`,
which launches the attention kernel (plus the split-KV reduction when the plan splits) once, or
twice for a mixed step whose decodes come first (decode tiles for those, prefill tiles for the
prompts); a model with `fused_ops` stores K/V in its own fused kernel and calls `attend`
directly. Launch shapes come from host ints only: neither reads a device tensor back (no
`.item()`, no `.tolist()`), so a decode step can be captured in a CUDA graph.

On the CPU this runs under the Triton interpreter (TRITON_INTERPRET=1): correct, and slow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import minipaged.attention.triton_kernels as tk
from minipaged.attention.metadata import (BLOCK_TABLE_WIDTH_MULTIPLE, AttentionBackend,
                                          AttentionMetadata)
from minipaged.utils import cdiv

_NUM_SMS: dict[str, int] = {}
MAX_SPLITS = 64  # the most parts `choose_num_splits` cuts a key range into


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
class _Part:
    """Sequences [first_seq, first_seq + num_seqs) of a step, attended to in one launch."""

    first_seq: int
    num_seqs: int
    tokens: Optional[tuple[int, int]]  # the rows of q those sequences own; None: all rows
    max_query_len: int
    max_context_len: int


@dataclass
class _Launch:
    """One part's launch; the same for every layer of the step."""

    part: _Part
    config: tk.KernelConfig
    num_splits: int
    workspace: Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TritonPlan:
    # Usually one part, the whole step. A mixed step whose first sequences have query length 1
    # (the GPU model runner puts decodes first) has two: those decodes, attended to with the
    # decode tiles, and the rest with the prefill tiles. One launch with prefill tiles would give
    # each decode a tile of 128 query rows of which 2 are real.
    parts: list[_Part]
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
        whole = _Part(0, metadata.num_seqs, None, metadata.max_query_len, metadata.max_context_len)
        parts = [whole]
        if metadata.max_query_len > 1 and metadata.query_lens[0] == 1:  # decodes lead a mixed step
            lens, ctx = metadata.query_lens, metadata.context_lens_host
            nd = next(i for i, n in enumerate(lens) if n != 1)  # one token each: rows 0 .. nd
            parts = [_Part(0, nd, (0, nd), 1, max(ctx[:nd])),
                     _Part(nd, len(lens) - nd, (nd, sum(lens)), metadata.max_query_len,
                           max(ctx[nd:]))]
        metadata.plan = TritonPlan(parts)

    def _launches(self, plan: TritonPlan, q: torch.Tensor, k_cache: torch.Tensor) -> list[_Launch]:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        key = (num_heads, num_kv_heads, head_dim, q.dtype)
        launches = plan.launches.get(key)
        if launches is not None:
            return launches
        group = num_heads // num_kv_heads
        interpret = q.device.type == "cpu"
        launches = plan.launches[key] = []
        for part in plan.parts:
            if part.max_query_len == 1:
                config = tk.decode_config(head_dim, group, interpret)
            else:
                config = tk.prefill_config(head_dim, group, part.max_query_len, interpret)
            num_splits = self.num_splits
            if num_splits is None:
                block_q = config.block_m // tk.triton.next_power_of_2(group)
                programs = part.num_seqs * tk.triton.cdiv(part.max_query_len, block_q) * num_kv_heads
                num_splits = tk.choose_num_splits(programs, part.max_context_len, config,
                                                  num_sms(q.device), MAX_SPLITS)
            workspace = None
            if num_splits > 1:  # shared by all layers of the step: they run one after another
                # rows are indexed by the token's place in the whole step: up to the part's end
                rows = num_tokens if part.tokens is None else part.tokens[1]
                workspace = tk.split_workspace(rows, num_heads, head_dim, num_splits, q.device)
            launches.append(_Launch(part, config, num_splits, workspace))
        return launches

    @staticmethod
    def kernel_variants(num_heads: int, num_kv_heads: int,
                        head_dim: int) -> list[tuple[tk.KernelConfig, int, int]]:
        """(tile config, query length, split factor) for each attention kernel variant a step
        of this model can launch on a GPU: every tile shape `decode_config` / `prefill_config`
        return (query lengths past 256 give the same as 256), with and without split-KV, and
        the reduction's variant for each split factor `choose_num_splits` can pick (once, with
        the decode tiles)."""
        group = num_heads // num_kv_heads
        configs = {tk.decode_config(head_dim, group, False): 1}  # config -> a query length
        for q_len in (2, 4, 8, 16, 32, 64, 128, 256):
            configs.setdefault(tk.prefill_config(head_dim, group, q_len, False), q_len)
        return [(config, q_len, num_splits) for config, q_len in configs.items()
                for num_splits in ([1 << i for i in range(MAX_SPLITS.bit_length())]
                                   if q_len == 1 else [1, 2])]

    @torch.inference_mode()
    def compile_variants(self, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         dtype: torch.dtype) -> int:
        """Launch the attention kernels once in every variant of `kernel_variants`; returns how
        many launches that took.

        Triton compiles a kernel the first time it meets a new set of constants: here a new tile
        shape or split factor. Without this the first request that meets one (a prompt whose
        prefix is cached leaves a short query; a mixed step of a few tokens) waits about a
        second for the compiler in the middle of serving. The GPU runner calls this once at
        build, before CUDA-graph capture. The queries are zeros and every key is read from
        block 0 of the cache; nothing is written to it.
        """
        num_kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
        variants = self.kernel_variants(num_heads, num_kv_heads, head_dim)
        device, m = k_cache.device, BLOCK_TABLE_WIDTH_MULTIPLE  # a step's row-stride divisibility
        for config, q_len, num_splits in variants:
            context = max(q_len, num_splits * config.block_n)  # a key tile for each split
            width = cdiv(cdiv(context, block_size), m) * m
            tk.paged_attention(
                torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device),
                k_cache, v_cache, torch.zeros(1, width, dtype=torch.int32, device=device),
                torch.tensor([context], dtype=torch.int32, device=device),
                torch.tensor([0, q_len], dtype=torch.int32, device=device), 1.0,
                num_seqs=1, max_query_len=q_len, config=config, num_splits=num_splits)
        return len(variants)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        # each new token's K/V into its slot (slot -1 = padding, skipped in the kernel)
        tk.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """The step's K/V are already in the cache (`store_kv`, or the fused q/k/v kernel of
        `models/fused_layers.py`). Returns (num_tokens, heads, dim)."""
        if metadata.plan is None or not isinstance(metadata.plan, TritonPlan):
            self.prepare(metadata)
        plan: TritonPlan = metadata.plan
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (num_tokens, heads, dim)
        for launch in self._launches(plan, q, k_cache):
            # the kernel finds each sequence's tokens through cu_seqlens_q, which holds positions
            # in the whole step: a launch over a slice of the sequences writes its rows of `out`
            part = launch.part
            seqs = slice(part.first_seq, part.first_seq + part.num_seqs)
            tk.paged_attention(
                q, k_cache, v_cache, metadata.block_tables[seqs], metadata.context_lens[seqs],
                metadata.cu_seqlens_q[part.first_seq:seqs.stop + 1], scale,
                num_seqs=part.num_seqs, max_query_len=part.max_query_len,
                config=launch.config, num_splits=launch.num_splits, workspace=launch.workspace,
                out=out, tokens=part.tokens)
        return out
