"""The model runner's CPU variant: decode-only steps laid out shortest context first.

`CPUModelRunner` builds exactly the tensors `ModelRunner.prepare_inputs` builds (lesson 03), in
another order when every scheduled sequence decodes one token: sorted by context length, the
order in which the CPU attention backend (`attention/cpu_backend.py`) attends to them in chunks
that each pad to their own longest context. With the tokens already in that order the backend
has nothing to reorder: no gather of each layer's queries into length order and no scatter of
each layer's output back (two ops per layer and step). The sampled rows are read back in the
scheduler's order, so the engine sees the same logits rows as from `ModelRunner`. Steps with a
prompt chunk in them keep the scheduler's order (the backend runs them through `torch_ref`).
It also makes the model's modules call their `forward` directly while they have no hooks
(`direct_calls.py`).

`make_model_runner` (worker/__init__.py) picks it once, with the CPU attention backend.
"""
from __future__ import annotations

import torch

from minipaged.attention import AttentionMetadata
from minipaged.engine.scheduler import SchedulerOutput
from minipaged.utils import to_device
from minipaged.worker.direct_calls import call_forward_directly
from minipaged.worker.model_runner import ModelRunner


class CPUModelRunner(ModelRunner):
    def __init__(self, model, kv_cache: torch.Tensor, backend, block_size: int):
        super().__init__(model, kv_cache, backend, block_size)
        call_forward_directly(model)  # no nn.Module.__call__ frames per layer (direct_calls.py)

    def step_order(self, sched: SchedulerOutput) -> list:
        """Decode-only steps: by context length (a stable sort); other steps: the scheduler's."""
        if any(s.num_new_tokens != 1 for s in sched.scheduled):
            return sched.scheduled
        return sorted(sched.scheduled, key=lambda s: s.seq.num_computed_tokens)

    def prepare_inputs(self, sched: SchedulerOutput):
        order = self.step_order(sched)
        if order is sched.scheduled:
            return super().prepare_inputs(sched)
        input_ids, positions, metadata = self._decode_inputs(order)
        # One token per sequence: sequence `s`'s token sits at its place in `order`. The rows to
        # sample, in the scheduler's order (the order the engine reads the logits in):
        row = {id(s): i for i, s in enumerate(order)}
        return input_ids, positions, metadata, [row[id(s)] for s in sched.scheduled if s.samples]

    def _decode_inputs(self, order: list):
        """`ModelRunner.prepare_inputs` for one new token per sequence, in list comprehensions
        (the same tensors; `tests/test_cpu_model_runner.py` compares them)."""
        bs, dev, n = self.block_size, self.device, len(order)
        positions = [s.seq.num_computed_tokens for s in order]  # each sequence's new token
        input_ids = [s.seq.token_ids[p] for s, p in zip(order, positions)]
        slot_mapping = [s.block_table[p // bs] * bs + p % bs for s, p in zip(order, positions)]
        context_lens = [p + 1 for p in positions]
        width = max(len(s.block_table) for s in order)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in order]
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, dev, torch.int64),  # (num_tokens,)
            block_tables=to_device(tables, dev, torch.int32),  # (num_seqs, width)
            context_lens=to_device(context_lens, dev, torch.int32),  # (num_seqs,)
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=dev),  # (num_seqs + 1,)
            query_lens=[1] * n,
            context_lens_host=context_lens,
            max_query_len=1,
            max_context_len=context_lens[-1],  # the order is by context length
            block_size=bs,
            num_decode_tokens=n,
        )
        return (to_device(input_ids, dev, torch.int64), to_device(positions, dev, torch.int64),
                metadata)
