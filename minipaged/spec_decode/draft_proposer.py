"""A draft model proposes: a smaller Llama with the target's vocabulary guesses k tokens.

Lesson 10 (speculative decoding) draws it.

The draft keeps its own paged KV cache, tensors of its own shape with the target's number of
blocks, indexed by the SAME block tables and slot mapping: slot s of the draft's cache holds
the draft's K/V of the token in slot s of the target's. So one block manager serves both (as in
vLLM): admission, prefix-cache hits, preemption and rollback move both caches at once.

Two things keep the draft's cache in step with the target's:

* `mirror(sched)`: after the target's forward, the draft runs the same step (same input ids,
  positions and slots: prefill chunks, decodes, verified proposals). Its valid K/V are then
  exactly the target's, and the target's rollback (num_computed_tokens) is the draft's too.
* `propose(entries)`: before the target's forward, for each sequence that reserved k slots,
  the draft decodes greedily from its newest token: one step on the token it has not seen,
  then k - 1 single-token steps on its own guesses, writing K/V into the reserved slots (which
  the mirror later rewrites with the same values, plus the last guess).

Proposals are the draft's argmax, a deterministic q, so rejection sampling stays lossless with
q one-hot. On CUDA the draft's single-token steps (and decode-only mirrored steps) replay its
own decode CUDA graphs (worker/cuda_graphs.py); its mirrored verify and prefill steps run
eagerly.
"""
from __future__ import annotations

import torch

from minipaged.attention import AttentionMetadata
from minipaged.config import format_bytes
from minipaged.models.loader import load_model, resolve_model
from minipaged.utils import to_device
from minipaged.worker.kv_cache import allocate_kv_cache, block_bytes, copy_blocks


class DraftModelProposer:
    def __init__(self, engine, spec):
        cfg = engine.config
        source = resolve_model(spec.model)
        self.model, self.model_config = load_model(
            source, engine.dtype, engine.device, engine.backend, max_positions=cfg.max_model_len,
            seed=cfg.seed, fused_ops=cfg.fused_ops)
        kv_cfg = self.model.config
        if engine.device.type == "cuda":
            need = engine.num_blocks * block_bytes(kv_cfg, cfg.block_size, engine.kv_dtype)
            free, _ = torch.cuda.mem_get_info(engine.device)
            if need > free:
                raise ValueError(
                    f"speculative_config['model']: the draft's KV cache needs "
                    f"{format_bytes(need)} for the target's {engine.num_blocks} blocks, but only "
                    f"{format_bytes(free)} of GPU memory is free. Lower gpu_memory_utilization "
                    f"or set num_blocks, so the target's cache leaves room for the draft's")
        self.kv_cache = allocate_kv_cache(kv_cfg, engine.num_blocks, cfg.block_size,
                                          engine.kv_dtype, engine.device,
                                          head_major=cfg.kv_head_major)
        if cfg.gpu_tuned_inputs:
            from minipaged.worker.gpu_model_runner import GPUModelRunner
            self.runner = GPUModelRunner(self.model, self.kv_cache, engine.backend,
                                         cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                         max_model_len=cfg.max_model_len,
                                         cuda_graphs=cfg.use_cuda_graphs)
        else:
            from minipaged.worker.model_runner import ModelRunner
            self.runner = ModelRunner(self.model, self.kv_cache, engine.backend, cfg.block_size)
        self.block_size = cfg.block_size
        self.device = engine.device

    @torch.inference_mode()
    def mirror(self, sched) -> None:
        """Run the target's step on the draft: its cache gets the same positions."""
        copy_blocks(self.kv_cache, sched.blocks_to_copy)
        input_ids, positions, metadata, _ = self.runner.prepare_inputs(sched)
        self.runner.forward(input_ids, positions, metadata)  # decode graphs where it has them

    @torch.inference_mode()
    def propose(self, entries) -> None:
        """Fill each entry's reserved `spec_token_ids` (k_r placeholders) with the draft's
        greedy guesses, k_r single-token steps, all rows of a step batched."""
        tokens = [s.seq.token_ids[-1] for s in entries]  # the newest token: not seen yet
        starts = [s.seq.num_computed_tokens for s in entries]  # its position
        for j in range(max(len(s.spec_token_ids) for s in entries)):
            rows = [i for i, s in enumerate(entries) if j < len(s.spec_token_ids)]
            metadata = self._decode_metadata([entries[i] for i in rows],
                                             [starts[i] + j for i in rows])
            ids = to_device([tokens[i] for i in rows], self.device, torch.int64)
            pos = to_device([starts[i] + j for i in rows], self.device, torch.int64)
            hidden = self.runner.forward(ids, pos, metadata)  # (rows, hidden)
            guesses = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, t in zip(rows, guesses):
                entries[i].spec_token_ids[j] = t
                tokens[i] = t

    def _decode_metadata(self, entries, positions: list[int]) -> AttentionMetadata:
        """One token per row at `positions`, written to the rows' reserved slots."""
        bs, dev = self.block_size, self.device
        width = max(len(s.block_table) for s in entries)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in entries]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(entries, positions)]
        context = [p + 1 for p in positions]
        n = len(entries)
        return AttentionMetadata(
            slot_mapping=to_device(slots, dev, torch.int64),  # (rows,)
            block_tables=to_device(tables, dev, torch.int32),  # (rows, width)
            context_lens=to_device(context, dev, torch.int32),  # (rows,)
            cu_seqlens_q=to_device(list(range(n + 1)), dev, torch.int32),  # (rows + 1,)
            query_lens=[1] * n, context_lens_host=context, max_query_len=1,
            max_context_len=max(context), block_size=bs, num_decode_tokens=n)
