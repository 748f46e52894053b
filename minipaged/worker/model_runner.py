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
samples nothing).
"""
from __future__ import annotations

import numpy as np
import torch

from minipaged.attention import AttentionBackend, AttentionMetadata
from minipaged.attention.metadata import BLOCK_TABLE_WIDTH_MULTIPLE
from minipaged.engine.block_manager import BlockManager
from minipaged.worker.kv_cache import copy_blocks, to_device
from minipaged.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model, kv_cache: torch.Tensor, block_manager: BlockManager,
                 backend: AttentionBackend, device: torch.device, *, max_num_seqs: int = 256,
                 max_model_len: int = 2048, enforce_eager: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.backend = backend
        self.device = device
        self.block_size = block_manager.block_size
        self.graph_runner = None
        # Order the flat batch decodes first, each group longest context first (GPU only; the
        # lessons print the CPU's batches in scheduler order).
        self.longest_first = device.type == "cuda"
        if device.type == "cuda" and not enforce_eager and backend.name == "triton":
            from minipaged.worker.cuda_graphs import CUDAGraphRunner
            self.graph_runner = CUDAGraphRunner(model, kv_cache, backend, max_num_seqs=max_num_seqs,
                                                max_model_len=max_model_len,
                                                block_size=self.block_size, device=device)
            self.graph_runner.capture()

    def prepare_inputs(self, sched: SchedulerOutput, pending=None):
        """Flatten the step into tensors: (input_ids, positions, attn_metadata, sample_rows).

        With async scheduling a decode's input token may still be a PLACEHOLDER: the token the
        previous step sampled, which is only on the GPU (`pending.tokens`). It is gathered there.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        # index (in input_ids) of the last token of each sampling sequence, in scheduler order
        sample_row: dict[int, int] = {}
        from_gpu: list[int] = []  # input_ids index <- ...
        gpu_rows: list[int] = []  # ... row of pending.tokens (async scheduling)
        block_tables = self.block_manager.block_tables
        entries = sched.scheduled
        if self.longest_first:
            # The attention kernel's programs start in this order and the GPU hands out
            # programs as SMs free up: longest contexts first keeps a short one from finishing
            # the step alone (the sampled rows are gathered back into scheduler order below).
            # Decodes (one new token) go before prefills: the Triton backend then attends to
            # the two groups in two launches, each with its own tile shape.
            entries = sorted(entries, key=lambda s: (s.num_new_tokens != 1,
                                                     -(s.seq.num_computed_tokens + s.num_new_tokens)))
        for s in entries:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            table = block_tables[seq.seq_id]
            if seq.num_pending_tokens:  # its newest token is still on the GPU
                if n != 1 or pending is None or seq.seq_id not in pending.row_of:
                    raise RuntimeError(f"{seq!r}: input token not sampled by the previous step")
                from_gpu.append(len(input_ids))
                gpu_rows.append(pending.row_of[seq.seq_id])
            if n == 1:  # decode: the common case, kept cheap
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:start + n]
                pos = range(start, start + n)
                positions += pos
                slot_mapping += [table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if s.samples:
                sample_row[id(s)] = len(input_ids) - 1
        num_seqs, num_tokens = len(tables), len(input_ids)
        m = BLOCK_TABLE_WIDTH_MULTIPLE  # (see its comment)
        width = -(-max(map(len, tables)) // m) * m
        # The int32 inputs share one host buffer and the int64 inputs another, so that a step
        # makes two host-to-device copies, not seven. Each part starts at a multiple of 32
        # elements: Triton compiles a kernel variant per pointer alignment it sees, and a
        # misaligned part would compile new variants in the middle of a run.
        i32, spans32 = _pack(np.int32, num_seqs * width, num_seqs, num_seqs + 1)
        bt, ctx, cu = (i32[a:a + n] for a, n in spans32)
        bt = bt.reshape(num_seqs, width)  # block tables, padded with 0
        for i, table in enumerate(tables):
            bt[i, :len(table)] = table
        ctx[:] = context_lens
        np.cumsum(query_lens, out=cu[1:])  # cu_seqlens_q, cu[0] = 0
        values = (input_ids, positions, slot_mapping, from_gpu, gpu_rows)
        i64, spans64 = _pack(np.int64, *map(len, values))
        for (a, n), v in zip(spans64, values):
            i64[a:a + n] = v
        i32_dev, i64_dev = to_device(i32, self.device), to_device(i64, self.device)
        bt_dev, ctx_dev, cu_dev = (i32_dev[a:a + n] for a, n in spans32)
        ids, pos_dev, slots_dev, dst, src = (i64_dev[a:a + n] for a, n in spans64)
        metadata = AttentionMetadata(
            slot_mapping=slots_dev,
            block_tables=bt_dev.view(num_seqs, width),
            context_lens=ctx_dev,
            cu_seqlens_q=cu_dev,
            query_lens=query_lens,
            context_lens_host=context_lens,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
            num_decode_tokens=query_lens.count(1),
        )
        sample_rows = [sample_row[id(s)] for s in sched.scheduled if s.samples]
        if from_gpu:  # (num_tokens,): the placeholders' real values, gathered on the device
            ids = ids.index_copy(0, dst, pending.tokens[src])
        return ids, pos_dev, metadata, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, pending=None) -> torch.Tensor:
        """Queue one step; returns logits (num_sampling_seqs, vocab) in the model's dtype, without
        waiting for them.

        `pending` (engine.PendingStep): the previous step's sampled tokens, when the host has
        not read them yet (async scheduling)."""
        copy_blocks(self.kv_cache, sched.blocks_to_copy)
        input_ids, positions, metadata, sample_rows = self.prepare_inputs(sched, pending)
        graphs = self.graph_runner
        if graphs is not None and metadata.max_query_len == 1 and graphs.can_run(metadata.num_seqs):
            hidden = graphs.run(input_ids, positions, metadata)  # decode step: replay a graph
        else:
            self.backend.prepare(metadata)
            hidden = self.model(input_ids, positions, self.kv_cache, metadata)  # (num_tokens, hidden)
        if sample_rows != list(range(hidden.shape[0])):
            hidden = hidden[to_device(sample_rows, self.device, torch.long)]
        return self.model.compute_logits(hidden)  # (num_sampling_seqs, vocab)


_ALIGN = 32  # elements; parts of a packed buffer start at multiples of this


def _pack(dtype, *sizes: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A zeroed host buffer for parts of the given sizes, each starting aligned; returns the
    buffer and each part's (start, size)."""
    spans, total = [], 0
    for n in sizes:
        spans.append((total, n))
        total += -(-n // _ALIGN) * _ALIGN
    return np.zeros(max(total, 1), dtype=dtype), spans
