"""The model runner's GPU variant: the same step tensors, built for the GPU (lesson 08).

`GPUModelRunner` computes exactly what `ModelRunner.prepare_inputs` computes (lesson 03), with
four differences that only matter on a GPU:

* order: decodes first, then prefills, each longest context first. The attention kernel's
  programs start in this order and the GPU hands them out as SMs free up, so a long context
  never finishes the step alone; the Triton backend attends to decodes and prefills in two
  launches, each with its own tile shape. The sampled rows are gathered back to step order.
* packing: the inputs are written into one pinned host buffer, reused from step to step
  (staging.py), so a step makes one host-to-device copy, not seven, and pins nothing. Each part
  starts at a multiple of 256 bytes: Triton compiles a kernel variant per pointer alignment it
  sees.
* padding: block-table rows are padded to a multiple of `BLOCK_TABLE_WIDTH_MULTIPLE` entries
  (the row stride is a kernel argument; its divisibility picks the variant too).
* async scheduling (async_sched/step_loop.py): a decode whose input token is still on the GPU
  (sampled by the previous step, not yet read by the host) takes it from that step's token
  tensor, gathered on the device.

Decode steps replay CUDA graphs (cuda_graphs.py) when the config asks for them; so do
speculative verify steps (queries of up to k + 1 tokens, spec_decode/cuda_graphs.py): `forward`
asks the runner's registry (`CUDAGraphs`) for a set that fits the step. The decode graphs of up
to LOGITS_IN_GRAPH_MAX_BATCH sequences record the LM head too (`execute` takes their logits),
except under tensor parallelism, whose ranks take the hidden states. This file
also holds the engine's two CUDA-only set-up helpers: the activation profile that sizes the KV
cache, and the garbage-collector freeze.
"""
from __future__ import annotations

import gc

import numpy as np
import torch

from minipaged.attention import AttentionBackend, AttentionMetadata
from minipaged.attention.metadata import BLOCK_TABLE_WIDTH_MULTIPLE
from minipaged.attention.triton_backend import TritonBackend
from minipaged.engine.scheduler import SchedulerOutput
from minipaged.utils import cdiv
from minipaged.worker.cuda_graphs import DECODE, CUDAGraphRunner, CUDAGraphs
from minipaged.worker.kv_cache import copy_blocks
from minipaged.worker.model_runner import ModelRunner
from minipaged.worker.staging import StepStaging


def in_flight_tokens(ids: torch.Tensor, from_gpu: list[int], gpu_rows: list[int],
                     dst: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`ids` (num_tokens,) on the device with ids[from_gpu[i]] = tokens[gpu_rows[i]]: the tokens
    the previous step sampled and the host has not read (`dst`, `src`: the two lists on the
    device). A decode step of the same sequences in the same order, the common case, takes a
    slice of `tokens` as it is, with no kernel; a contiguous run, one copy; else a gather."""
    k = len(from_gpu)
    first = gpu_rows[0]
    if from_gpu[-1] - from_gpu[0] == k - 1 and gpu_rows == list(range(first, first + k)):
        run = tokens[first:first + k]
        if k == ids.shape[0]:
            return run
        ids[from_gpu[0]:from_gpu[0] + k].copy_(run)
        return ids
    return ids.index_copy_(0, dst, tokens.index_select(0, src))


LOGITS_IN_GRAPH_MAX_BATCH = 16  # decode graphs of up to this many sequences run the LM head too


class GPUModelRunner(ModelRunner):
    def __init__(self, model, kv_cache: torch.Tensor, backend: AttentionBackend, block_size: int,
                 *, max_num_seqs: int, max_model_len: int, cuda_graphs: bool,
                 logits_in_graphs: bool = True):
        super().__init__(model, kv_cache, backend, block_size)
        self.cuda_graphs = CUDAGraphs()  # spec_decode/ and lora/ register their sets here too
        self.staging = StepStaging(self.device)  # the pinned buffers a step's inputs go through
        if self.device.type == "cuda" and isinstance(backend, TritonBackend):
            # every attention kernel variant compiled now, not when a request first needs it
            backend.compile_variants(model.config.num_attention_heads, kv_cache[0, 0],
                                     kv_cache[0, 1], model.model.embed_tokens.weight.dtype)
        if cuda_graphs:
            decode = CUDAGraphRunner(model, kv_cache, backend, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, block_size=block_size,
                                     device=self.device, logits_max_batch=(
                                         LOGITS_IN_GRAPH_MAX_BATCH if logits_in_graphs else 0))
            decode.capture()
            self.cuda_graphs.register(DECODE, decode)

    def step_order(self, sched: SchedulerOutput) -> list:
        """Decodes first, then prefills, each longest context first (see the docstring)."""
        return sorted(sched.scheduled, key=lambda s: (
            s.num_new_tokens != 1, -(s.seq.num_computed_tokens + s.num_new_tokens)))

    def prepare_inputs(self, sched: SchedulerOutput, pending=None):
        """`ModelRunner.prepare_inputs`, ordered, packed and padded for the GPU. `pending`
        (async_scheduling.PendingStep): the previous step's tokens, not read by the host yet."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_row: dict[int, int] = {}  # id(entry) -> row of its last token
        from_gpu: list[int] = []  # input_ids index <- ...
        gpu_rows: list[int] = []  # ... row of pending.tokens
        entries = self.step_order(sched)
        for s in entries:
            seq, n, table = s.seq, s.num_new_tokens, s.block_table
            start = seq.num_computed_tokens
            if start >= seq.num_tokens:  # its input token is still on the GPU
                if n != 1 or pending is None or seq.seq_id not in pending.row_of:
                    raise RuntimeError(f"{seq!r}: input token not sampled by the previous step")
                from_gpu.append(len(input_ids))
                gpu_rows.append(pending.row_of[seq.seq_id])
                input_ids.append(0)  # overwritten on the device below
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            elif n == 1:  # decode: the common case, kept cheap
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:  # a prefill chunk, or a speculating sequence's token + proposals
                input_ids += seq.token_ids[start:start + n] + s.spec_token_ids
                pos = range(start, start + n)
                positions += pos
                slot_mapping += [table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if s.samples:
                sample_row[id(s)] = len(input_ids) - 1
        num_seqs = len(tables)
        m = BLOCK_TABLE_WIDTH_MULTIPLE
        width = cdiv(max(map(len, tables)), m) * m
        values = (input_ids, positions, slot_mapping, from_gpu, gpu_rows)
        staged = self.staging.stage([(torch.int32, num_seqs * width), (torch.int32, num_seqs),
                                     (torch.int32, num_seqs + 1)]
                                    + [(torch.int64, len(v)) for v in values])
        bt, ctx, cu, *host64 = staged.host
        bt = bt.reshape(num_seqs, width)  # block tables, padded with 0
        bt.fill(0)
        for i, table in enumerate(tables):
            bt[i, :len(table)] = table
        ctx[:] = context_lens
        cu[0] = 0
        np.cumsum(query_lens, out=cu[1:])  # cu_seqlens_q
        for part, v in zip(host64, values):
            part[:] = v
        bt_dev, ctx_dev, cu_dev, ids, pos_dev, slots_dev, dst, src = staged.to_device()
        metadata = AttentionMetadata(
            slot_mapping=slots_dev, block_tables=bt_dev.view(num_seqs, width),
            context_lens=ctx_dev, cu_seqlens_q=cu_dev, query_lens=query_lens,
            context_lens_host=context_lens, max_query_len=max(query_lens),
            max_context_len=max(context_lens), block_size=bs,
            num_decode_tokens=query_lens.count(1))
        sample_rows = [row for s in sched.scheduled if s.samples  # speculating: k + 1 rows
                       for row in range(sample_row[id(s)] - len(s.spec_token_ids),
                                        sample_row[id(s)] + 1)]
        if from_gpu:  # (num_tokens,): the in-flight tokens' values, gathered on the device
            ids = in_flight_tokens(ids, from_gpu, gpu_rows, dst, src, pending.tokens)
        return ids, pos_dev, metadata, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, pending=None,
                decode_variant: str = DECODE) -> torch.Tensor:
        """Queue one step; returns logits (num_sampling_seqs, vocab) without waiting for them.
        `decode_variant`: which decode graphs a decode step replays (lora/runner.py picks)."""
        copy_blocks(self.kv_cache, sched.blocks_to_copy)
        input_ids, positions, metadata, sample_rows = self.prepare_inputs(sched, pending)
        graphs = self.cuda_graphs.find(metadata, decode_variant)
        if graphs is not None and graphs.has_logits(metadata.num_seqs):  # the LM head replayed too
            logits = graphs.run_logits(input_ids, positions, metadata)  # (num_seqs, vocab)
            return self.sampled_rows(logits, sample_rows)
        hidden = self.forward(input_ids, positions, metadata, decode_variant)
        return self.compute_logits(hidden, sample_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata, decode_variant: str = DECODE) -> torch.Tensor:
        """`ModelRunner.forward`, replayed from a CUDA graph where one fits the step (a decode
        step, or a speculative verify step: cuda_graphs.py); (num_tokens, hidden)."""
        graphs = self.cuda_graphs.find(metadata, decode_variant)
        if graphs is not None:
            return graphs.run(input_ids, positions, metadata)
        return super().forward(input_ids, positions, metadata)


def profile_peak_memory(model, backend, model_config, config, kv_dtype, device) -> int:
    """Peak activation bytes of one forward at max_num_batched_tokens (no KV cache yet): what
    `kv_cache.determine_num_blocks` keeps free on a GPU."""
    n = config.max_num_batched_tokens
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    bs = config.block_size
    blocks = cdiv(n, bs)
    cfg = model_config
    kv = torch.zeros((cfg.num_hidden_layers, 2, blocks, bs, cfg.num_key_value_heads, cfg.head_dim),
                     dtype=kv_dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(blocks, device=device, dtype=torch.int32)[None],
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device), query_lens=[n],
        context_lens_host=[n], max_query_len=n, max_context_len=n, block_size=bs)
    with torch.inference_mode():
        backend.prepare(meta)
        hidden = model(torch.zeros(n, dtype=torch.long, device=device),
                       torch.arange(n, device=device) % config.max_model_len, kv, meta)
        model.compute_logits(hidden[-min(n, config.max_num_seqs):])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - kv.numel() * kv.element_size()
    del kv, hidden
    torch.cuda.empty_cache()
    return peak


def freeze_gc_heap() -> None:
    """Collect once, then leave every object alive now out of all later garbage collections.

    Python's cycle collector now and then runs a full (generation 2) pass that walks every
    object the process holds: torch, Triton, transformers and the model add up to about half a
    million, and the GPU idles while the host walks them (async scheduling keeps one step
    queued). What exists once the engine is built lives as long as the engine, so walking it
    again finds nothing; vLLM freezes its heap after start-up for the same reason. Frozen
    objects are still freed by reference counting; only garbage *cycles* among them would stay,
    and a dropped engine leaves none (tests/test_engine.py checks it).
    """
    gc.collect()
    gc.freeze()
