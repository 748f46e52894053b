"""Stage 10, `fork` (lesson 06): one prompt prefilled once, then forked into its n samples.

Write the four pieces a request with `SamplingParams(n=...)` goes through when its prompt
reaches its first sample: `Sequence.fork` (a copy of the token stream), `BlockManager.fork` (the
copy shares every block), `GroupScheduling.fork` (the copies join the running set) and
`split_groups` (the engine's rows to sample, with the forks added). The three `fork`s are
named apart here: `fork_sequence`, `fork_block_table` and `fork_running`. While the grader
runs, yours replace the real ones. Grade them with

    minipaged exercise check fork

Needs from stage 2 (block_manager): after a fork the children and their parent share their
last, partly filled block; `append_slots` copies it (copy-on-write) before a sample writes.

What you can use: a `Sequence` is a dataclass (`dataclasses.replace` copies one with some fields
changed; `_seq_counter` below numbers them); `seq.group` is its `SequenceGroup` (`size`,
`seqs`, `forked`, `beam`: None unless a beam search); in the scheduler `self.running`,
`self.block_manager`, `self.num_reserved_seats` (seats a group's prompt holds for its forks);
in the block manager the per-sequence dicts of stage 2 (`block_tables`, `num_slots`,
`_hashes`, `num_block_refs`) and `self.allocator.incref(block)`.
"""
from __future__ import annotations

from dataclasses import replace  # noqa: F401

import torch

from minipaged.engine.block_manager import BlockManager  # noqa: F401
from minipaged.engine.scheduler import Scheduler
from minipaged.engine.sequence import Sequence, SequenceStatus, _seq_counter  # noqa: F401
from minipaged.groups.group import SequenceGroup  # noqa: F401
from minipaged.utils import to_device  # noqa: F401


def fork_sequence(self, index: int) -> "Sequence":
    """A copy with its own token lists and a new `seq_id` (the KV blocks are shared by
    `BlockManager.fork`, not here). Its RNG starts afresh from `seed + index`."""
    # New seq_id (next(_seq_counter)) and index; no generator and no detokenizer stream of
    # its own yet; copies of output_token_ids, token_ids and logprobs (None stays None).
    raise NotImplementedError("exercise: write Sequence.fork")


def fork_block_table(self, parent: Sequence, child: Sequence) -> None:
    """`child` shares every block of `parent` (ref counts +1); writes will copy-on-write."""
    # The child gets its own list holding the same block ids, and the parent's slot count,
    # hashes and number of computed tokens.
    raise NotImplementedError("exercise: write BlockManager.fork")


def fork_running(self, parent: Sequence, children: list[Sequence]) -> None:
    """`children` share the running `parent`'s blocks and run right after it (n > 1, beams).
    The first fork of a group turns the seats its prompt reserved into real sequences."""
    raise NotImplementedError("exercise: write GroupScheduling.fork")


def split_groups(logits: torch.Tensor, sampling: list[Sequence], scheduler: Scheduler):
    """Returns (logits rows to sample, the sequences they belong to, beam groups ready to step)."""
    # Row by row: a beam's row is set aside (group.beam.logits[seq_id] = a clone; its group is
    # ready once every live beam has one) and not sampled now. Any other row is sampled; a
    # group's prompt that has not forked yet forks here into size - 1 children (indices 1..),
    # which join group.seqs and sample from the same row. Index the logits only if the rows
    # changed.
    raise NotImplementedError("exercise: write split_groups")
