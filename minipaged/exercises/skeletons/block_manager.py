"""Stage 2, `block_manager` (lessons 02 and 06): block tables that grow, share and shrink.

Write eight `BlockManager` methods (minipaged/engine/block_manager.py): the prefix lookup
and publishing (`get_computed_blocks`, `cache_blocks`), admission (`can_allocate`, `allocate`),
growth with copy-on-write (`_needs_cow`, `can_append`, `append_slots`) and `free`. Each takes `self`, a real `BlockManager`; while the grader runs, your
functions replace the real methods, so the scheduler, the engine and the capabilities built on
the class (swap/'s CPU pool, groups/' forks) run on top of yours. Grade them with

    minipaged exercise check block_manager

Needs from stage 1 (block_allocator), through `self.allocator`: `allocate()` (a fresh `Block`,
ref_count 1), `incref(block)`, `decref(block)`, `lookup(hash, token_ids, key)`, `.blocks[id]`,
`.num_free_blocks`; and `hash_block(parent_hash, token_ids, key)` (imported below).

What the manager keeps per sequence (the tests check every one of them):

    self.block_tables[seq_id]   physical block ids: logical block i lives in block_tables[seq_id][i]
    self.num_slots[seq_id]      token slots the table covers so far
    self._hashes[seq_id]        chain hashes of its full blocks (the prefix cache)
    self.num_block_refs         entries in all block tables together

and what is given: `self.block_size`, `self.num_blocks_for(num_tokens)`, `self.hash_key(seq)`
(the extra key of seq's hashes), `self.enable_prefix_caching`, `self.prefix_queries` and
`self.prefix_hits` (statistics), `self.cache_full_blocks(seq)` (publish what is computed,
unpublish what a step that never ran had published), and `self._uncomputed` /
`self._uncomputed_of` / `self._uncomputed_hits` (blocks published ahead of their K/V: block id
-> (seq, logical index, hash), their ids by seq_id, and who was admitted with a hit on one). A token at
position p of a sequence lands in logical block p // block_size; the next token to compute sits
at position `seq.num_computed_tokens`.
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.block_allocator import Block, hash_block  # noqa: F401
from minipaged.engine.block_manager import BlockManager  # noqa: F401  (what `self` is)
from minipaged.engine.sequence import Sequence


def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
    """Longest cached prefix of `seq` in whole blocks: (blocks, number of tokens they hold).
    At least one token is left to compute: its logits sample the next (vLLM does the same).
    Nothing for a sequence that computes every token (`skip_reading_prefix_cache`).

    That is: only blocks inside `token_ids[:-1]` can be hits, since the engine needs the logits
    of the last token to sample the next one; `skip_reading_prefix_cache` is set for a request
    whose prompt logprobs need every token computed.
    """
    # Nothing with prefix caching off or seq.skip_reading_prefix_cache set. Walk seq.token_ids
    # block by block, chaining hash_block(parent, chunk, key); stop at the first miss of
    # self.allocator.lookup.
    raise NotImplementedError("exercise: write BlockManager.get_computed_blocks")


def can_allocate(self, seq: Sequence, computed_blocks: list[Block], num_new_tokens: int) -> bool:
    """Can `seq` (no blocks yet) get its cached prefix plus room for `num_new_tokens`?"""
    # Fresh blocks for the tokens past the hit, plus every hit whose ref_count is 0: it sits
    # in the free queue, so reviving it takes a free block too.
    raise NotImplementedError("exercise: write BlockManager.can_allocate")


def allocate(self, seq: Sequence, computed_blocks: list[Block], num_new_tokens: int,
             publish: bool = True) -> None:
    """Give a new (or recomputing) sequence its block table: cached prefix + fresh blocks,
    and publish the full blocks its `num_new_tokens` fill (`publish=False`: the caller
    schedules fewer of them this step and publishes those itself, `cache_blocks`)."""
    # A sequence that has a table already: RuntimeError. Otherwise: incref the hits, append
    # fresh blocks, fill block_tables / num_block_refs / num_slots / _hashes (the hits' hashes),
    # set seq.num_computed_tokens to the tokens the hits hold (and seq.num_cached_tokens, unless
    # the sequence was preempted before), count prefix_queries / prefix_hits, remember in
    # self._uncomputed_hits[seq_id] = (seq, index) a hit on a block in self._uncomputed, and
    # publish (cache_blocks) up to the tokens it now has slots for.
    raise NotImplementedError("exercise: write BlockManager.allocate")


def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
    """Publish the full blocks among the first `num_tokens` slots, computed or about to be
    computed by the step being planned (vLLM's `cache_blocks`). Only blocks whose tokens the
    host knows: never a guessed token, nor one still on its way from the GPU."""
    # Only tokens seq.token_ids holds (min(num_tokens, seq.num_tokens)); only full blocks past
    # those already hashed (self._hashes[seq_id]), and inside the table. For each: chain its
    # hash on the previous one, append it to the sequence's hashes, register the block with
    # the allocator; and if the block's K/V are not computed yet (its end is past
    # seq.num_computed_tokens) and the block now carries this hash, remember it in
    # self._uncomputed[block_id] = (seq, i, h) and self._uncomputed_of[seq_id].
    raise NotImplementedError("exercise: write BlockManager.cache_blocks")


def _needs_cow(self, seq: Sequence) -> Optional[int]:
    """Index of the block the next token lands in, if another sequence shares it."""
    # The next token goes to logical block seq.num_computed_tokens // block_size. If the table
    # has that block and its ref count is above 1, writing there would change what others read.
    raise NotImplementedError("exercise: write BlockManager._needs_cow")


def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
    """Are there free blocks for `num_new_tokens` more tokens of `seq`, counting the block a
    copy-on-write would take?"""
    raise NotImplementedError("exercise: write BlockManager.can_append")


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


def free(self, seq: Sequence) -> None:
    """Drop the sequence's references, tail blocks first (evicted first). Full blocks not yet
    published go to the prefix cache first (a step loop may read the last token late).

    A step loop that reads tokens a step late knows a sequence's last computed token only as it
    finishes it, so its last full blocks are published here."""
    # A sequence without a table: nothing to do (freeing twice is fine). Otherwise publish its
    # full blocks, and unpublish those a step it leaves before running had published (both:
    # `self.cache_full_blocks(seq)`, while its table is still there), then drop its table,
    # decref its blocks last block first, keep num_block_refs right, and forget its num_slots
    # and _hashes entries.
    raise NotImplementedError("exercise: write BlockManager.free")
