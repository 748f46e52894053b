"""One engine step on the model: flatten the scheduled work, run the forward, return logits.

Lesson 03 prints what this file builds. For a step with sequences A (prefill chunk of 3 tokens,
nothing cached) and B (decode, 5 tokens already cached), block_size 4:

    input_ids      [a0 a1 a2 | b5]          the new tokens, end to end (no padding)
    positions      [ 0  1  2 |  5]
    slot_mapping   [A0*4+0, A0*4+1, A0*4+2 | B1*4+1]   where each new K/V is written
    cu_seqlens_q   [0, 3, 4]                  sequence i owns tokens cu[i]:cu[i+1]
    context_lens   [3, 6]                     tokens in the cache after this step
    block_tables   [[A0, 0], [B0, B1]]        padded with 0

These go into an `AttentionMetadata` that is passed explicitly to every layer. Only the rows of
sequences that reach their last known token are turned into logits (a partial prefill chunk
samples nothing); a speculating sequence (spec_decode/) gets one at every position it verifies.
Everything comes in the `SchedulerOutput`, block tables included: the worker never reads the
block manager. The CPU's and the GPU's runners build the same tensors faster (worker/__init__.py).
"""
from __future__ import annotations

import torch

from minipaged.attention import AttentionBackend, AttentionMetadata
from minipaged.engine.scheduler import SchedulerOutput
from minipaged.utils import to_device
from minipaged.worker.kv_cache import copy_blocks


class ModelRunner:
    cuda_graphs = None  # every step eager; the GPU runner's graph registry (cuda_graphs.py)

    def __init__(self, model, kv_cache: torch.Tensor, backend: AttentionBackend, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = kv_cache.device

    def step_order(self, sched: SchedulerOutput) -> list:
        """The scheduled sequences in the order their tokens are laid out: the scheduler's."""
        return sched.scheduled

    def prepare_inputs(self, sched: SchedulerOutput):
        """Flatten the step into tensors: (input_ids, positions, attn_metadata, sample_rows)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []  # the last token of each sequence that samples
        for s in sched.scheduled:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            pos = range(start, start + n)  # the new tokens' positions
            # (a speculating sequence: its newest token, then the proposals it verifies)
            input_ids += s.seq.token_ids[start:start + n] + s.spec_token_ids
            positions += pos
            slot_mapping += [s.block_table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(n)
            context_lens.append(start + n)
            if s.samples:  # speculating: logits at every verified position, not just the last
                sample_rows += range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids))
        width = max(len(s.block_table) for s in sched.scheduled)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in sched.scheduled]
        cu_seqlens_q = [0]
        for n in query_lens:
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, dev, torch.int64),  # (num_tokens,)
            block_tables=to_device(tables, dev, torch.int32),  # (num_seqs, width)
            context_lens=to_device(context_lens, dev, torch.int32),  # (num_seqs,)
            cu_seqlens_q=to_device(cu_seqlens_q, dev, torch.int32),  # (num_seqs + 1,)
            query_lens=query_lens,
            context_lens_host=context_lens,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
            num_decode_tokens=query_lens.count(1),
        )
        return (to_device(input_ids, dev, torch.int64), to_device(positions, dev, torch.int64),
                metadata, sample_rows)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns logits (num_sampling_seqs, vocab) in the model's dtype (on a GPU,
        queued: nothing here waits for them)."""
        copy_blocks(self.kv_cache, sched.blocks_to_copy)
        input_ids, positions, metadata, sample_rows = self.prepare_inputs(sched)
        hidden = self.forward(input_ids, positions, metadata)  # (num_tokens, hidden)
        return self.compute_logits(hidden, sample_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        self.backend.prepare(metadata)  # per-step work shared by every layer
        return self.model(input_ids, positions, self.kv_cache, metadata)  # (num_tokens, hidden)

    def compute_logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        return self.model.compute_logits(self.sampled_rows(hidden, sample_rows))  # (seqs, vocab)

    def sampled_rows(self, rows: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        """The rows of `rows` (one per token of the step) that sample, in the sampler's order."""
        if sample_rows == list(range(rows.shape[0])):
            return rows
        return rows[to_device(sample_rows, self.device, torch.long)]
