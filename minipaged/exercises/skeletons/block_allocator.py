"""Stage 1, `block_allocator` (lesson 02): the physical blocks under every block table.

Write five methods of `BlockAllocator` (minipaged/engine/block_allocator.py) and `hash_block`.
Each method takes `self`, a real `BlockAllocator`; while the grader runs, your functions replace
the real ones, so the block manager, the scheduler and the whole engine run on your free queue
and your prefix-cache index. Grade them with

    minipaged exercise check block_allocator

Needs: nothing, this is the bottom of the engine. What the allocator keeps (its `__init__` and
the methods you do not write, `uncache` and `_drop_hash`, are given):

    self.blocks             one `Block(block_id, ref_count, block_hash, token_ids, extra_key)`
                            per physical block
    self.free_queue         OrderedDict of the ids of blocks with ref_count 0; the front is
                            handed out (and evicted from the prefix cache) next
    self.hash_to_block      the prefix-cache index: block hash -> block id
    self.num_cached_free    free blocks that still hold a hashed (reusable) prefix
    self.num_evictions      cached blocks handed out for new tokens so far

`OrderedDict.popitem(last=False)` pops the front; `free_queue[i] = None` appends at the back;
`del free_queue[i]` takes a block out wherever it is. `self._drop_hash(block)` forgets a
block's hash (and its index entry) and `self.enable_prefix_caching` says whether to keep any.
"""
from __future__ import annotations

from typing import Hashable, Optional

from minipaged.engine.block_allocator import Block, BlockAllocator  # noqa: F401  (what `self` is)


def allocate(self) -> Block:
    """Take the least recently freed block; if it still held a cached prefix, evict it."""
    # An empty free queue is the scheduler's bug: raise RuntimeError saying so. Pop the front;
    # a block with a hash is a cached prefix being evicted (index entry, counters); it leaves
    # with ref_count 1.
    raise NotImplementedError("exercise: write BlockAllocator.allocate")


def incref(self, block: Block) -> None:
    """One more block table holds `block`; a free (cached) block comes back into use."""
    # ref_count 0 means it sits in the free queue (as a cached prefix if it has a hash).
    raise NotImplementedError("exercise: write BlockAllocator.incref")


def decref(self, block: Block) -> None:
    """One block table less holds `block`; at 0 it goes to the back of the free queue,
    keeping its hash. Freeing a free block raises RuntimeError ("double free ...")."""
    raise NotImplementedError("exercise: write BlockAllocator.decref")


def lookup(self, block_hash: int, token_ids: tuple[int, ...],
           extra_key: Hashable = None) -> Optional[Block]:
    """The cached block holding exactly `token_ids` (under `extra_key`) at this hash, or None:
    a hash collision (other tokens, or another key) is a miss."""
    raise NotImplementedError("exercise: write BlockAllocator.lookup")


def register(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
             extra_key: Hashable = None) -> None:
    """Publish a full block to the prefix cache (first writer wins)."""
    # Nothing when prefix caching is off, when the block already has a hash, or when another
    # block already caches this hash. Otherwise the block keeps hash, tokens and key, and the
    # index points at it.
    raise NotImplementedError("exercise: write BlockAllocator.register")


def hash_block(parent_hash: Optional[int], token_ids: tuple[int, ...],
               extra_key: Hashable = None) -> int:
    """Prefix-aware block hash: equal hashes mean equal token prefixes up to this block, with the
    same `extra_key` (vLLM's extra keys, such as an adapter id; None or 0: none), so blocks are
    never shared across keys."""
    # Python's hash() of a tuple will do. A falsy extra_key must hash as if there were none.
    raise NotImplementedError("exercise: write hash_block")
