"""Stage 3, `prepare_inputs` (lesson 02b): one engine step flattened into the model's tensors.

Write `ModelRunner.prepare_inputs` (minipaged/worker/model_runner.py). It takes `self`, a real
`ModelRunner`; while the grader runs, yours replaces the real method, and the model, the
attention backends and the whole engine read the tensors you build. Grade it with

    minipaged exercise check prepare_inputs

Needs from stage 2 (block_manager): nothing it calls. The scheduler hands every scheduled
sequence over with its block table (`ScheduledSeq.block_table`); the runner never asks the
block manager. The module docstring of model_runner.py shows the tensors of a two-sequence step.

What you have: `self.block_size`, `self.device`; per `s` in `sched.scheduled` (step order):
`s.seq.token_ids`, `s.seq.num_computed_tokens` (the first new token's position),
`s.num_new_tokens`, `s.block_table`, `s.samples` (it reaches its last known token: one logits
row), `s.spec_token_ids` (guesses it verifies after its newest token, lesson 10; usually empty).
`to_device(values, device, dtype)` makes a tensor, and `AttentionMetadata` (its fields are
documented in minipaged/attention/metadata.py) holds what attention reads.
"""
from __future__ import annotations

import torch  # noqa: F401

from minipaged.attention import AttentionMetadata  # noqa: F401
from minipaged.engine.scheduler import SchedulerOutput
from minipaged.utils import to_device  # noqa: F401
from minipaged.worker.model_runner import ModelRunner  # noqa: F401  (what `self` is)


def prepare_inputs(self, sched: SchedulerOutput):
    """Flatten the step into tensors: (input_ids, positions, attn_metadata, sample_rows)."""
    # Per scheduled sequence, its new tokens run from position start = num_computed_tokens to
    # start + n: their ids (then its spec_token_ids), positions, and cache slots
    # block_table[p // bs] * bs + p % bs; its query length n and context length start + n; the
    # flat index of its last token when it samples (a speculating sequence: every verified
    # position). Then block tables padded with 0 to one width, cu_seqlens_q as prefix sums of
    # the query lengths, and the AttentionMetadata (int64 slots, int32 tables and lengths).
    raise NotImplementedError("exercise: write ModelRunner.prepare_inputs")
