"""Exercise `block_manager` (lessons 02 and 06): grow, share and free a sequence's block table.

Write the four `BlockManager` methods below. Each takes `self`, a real `BlockManager` from
minipaged/engine/block_manager.py; while the grader runs, your functions replace the real methods
of that class, so everything else (the allocator, the prefix cache, `allocate`, `can_append`,
the scheduler and the engine, and the capabilities built on the class, such as swap/'s CPU
pool) runs on top of yours. Grade them with

    minipaged exercise check block_manager

What the manager keeps per sequence (the tests check every one of them):

    self.block_tables[seq_id]   physical block ids: logical block i lives in block_tables[seq_id][i]
    self.num_slots[seq_id]      token slots the table covers so far
    self._hashes[seq_id]        chain hashes of its full blocks (the prefix cache)
    self.num_block_refs         entries in all block tables together

and what the allocator offers: `self.allocator.allocate()` (a fresh `Block`, ref_count 1),
`.incref(block)`, `.decref(block)`, `.blocks[block_id]`; `self.block_size`,
`self.num_blocks_for(num_tokens)`. A token at position p of a sequence lands in logical block
p // block_size; the next token to compute sits at position `seq.num_computed_tokens`.
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.block_manager import BlockManager  # noqa: F401  (what `self` is)
from minipaged.engine.sequence import Sequence


def _needs_cow(self, seq: Sequence) -> Optional[int]:
    """Index of the block the next token lands in, if another sequence shares it."""
    # The next token goes to logical block seq.num_computed_tokens // block_size. If the table
    # has that block and its ref count is above 1, writing there would change what others read.
    raise NotImplementedError("exercise: write BlockManager._needs_cow")


def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
    """Make room for `num_new_tokens` more tokens; returns CoW copies as (src, dst) block ids."""
    # 1. copy-on-write: if the block the next token lands in is shared (`_needs_cow`), take a
    #    fresh block, drop one reference to the shared one, put the fresh one in the table, and
    #    report (shared, fresh) so the engine copies the K/V already written there.
    # 2. append fresh blocks until the table covers num_computed_tokens + num_new_tokens slots.
    # 3. keep num_slots and num_block_refs right.
    # 4. publish the blocks this step fills, before the forward (vLLM V1): a request admitted
    #    later in the same step may then share them: `self.cache_blocks(seq, num_tokens)` with
    #    num_tokens = num_computed_tokens + num_new_tokens.
    raise NotImplementedError("exercise: write BlockManager.append_slots")


def fork(self, parent: Sequence, child: Sequence) -> None:
    """`child` shares every block of `parent` (ref counts +1); writes will copy-on-write."""
    # The child gets its own list holding the same block ids, and the parent's slot count,
    # hashes and number of computed tokens.
    raise NotImplementedError("exercise: write BlockManager.fork")


def free(self, seq: Sequence) -> None:
    """Drop the sequence's references; tail blocks first, so they are evicted first.

    Full blocks not yet published go to the prefix cache first: a step loop that reads
    tokens a step late knows a sequence's last computed token only as it finishes it."""
    # A sequence without a table: nothing to do (freeing twice is fine). Otherwise publish its
    # full blocks, and unpublish those a step it leaves before running had published (both:
    # `self.cache_full_blocks(seq)`, while its table is still there), then drop its table,
    # decref its blocks last block first, keep num_block_refs right, and forget its num_slots
    # and _hashes entries.
    raise NotImplementedError("exercise: write BlockManager.free")
