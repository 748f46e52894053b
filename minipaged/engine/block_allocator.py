"""The physical layer of the paged KV cache (lesson 02).

`BlockAllocator` owns `num_blocks` physical blocks: a free queue, a reference count per block,
and the prefix-cache index (block hash -> block). A block whose ref count drops to 0 goes to the
*back* of the free queue but keeps its hash, so a later request with the same prefix can take it
back ("cached"); new allocations pop from the *front*, evicting the least recently freed block
first. `BlockManager` (block_manager.py) builds the per-sequence block tables on top of it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None  # set once the block is full (or being filled this step)
    token_ids: tuple[int, ...] = ()  # the tokens a hashed block holds, to verify cache hits
    extra_key: Hashable = None  # ... and the block manager's extra hash key for them


class BlockAllocator:
    """Physical blocks, their ref counts, the free queue (LRU order) and the prefix-hash index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count == 0, front = next to be handed out (and evicted from the cache).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_cached_free = 0  # free blocks that still hold a reusable, hashed prefix
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced blocks included)."""
        return len(self.free_queue)

    def allocate(self) -> Block:
        """Take the least recently freed block; if it still held a cached prefix, evict it."""
        if not self.free_queue:
            raise RuntimeError("BlockAllocator is out of blocks; the scheduler must check "
                               "can_allocate/can_append before allocating")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._drop_hash(block)
            self.num_cached_free -= 1
            self.num_evictions += 1
        block.ref_count = 1
        return block

    def incref(self, block: Block) -> None:
        if block.ref_count == 0:  # a cached free block comes back into use
            del self.free_queue[block.block_id]
            if block.block_hash is not None:
                self.num_cached_free -= 1
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block.block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block.block_id] = None  # back of the queue: evicted last
            if block.block_hash is not None:
                self.num_cached_free += 1

    # --- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               extra_key: Hashable = None) -> Optional[Block]:
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.extra_key != extra_key:
            return None  # a hash collision is a miss
        return block

    def register(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
                 extra_key: Hashable = None) -> None:
        """Publish a full block to the prefix cache (first writer wins)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.hash_to_block:
            return  # another block already caches this prefix
        block.block_hash = block_hash
        block.token_ids, block.extra_key = token_ids, extra_key
        self.hash_to_block[block_hash] = block.block_id

    def uncache(self, block: Block) -> None:
        """Take `block` out of the prefix cache (it keeps its place in the free queue)."""
        if block.block_hash is None:
            return
        self._drop_hash(block)
        if block.ref_count == 0:
            self.num_cached_free -= 1

    def _drop_hash(self, block: Block) -> None:
        if self.hash_to_block.get(block.block_hash) == block.block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = ()


def hash_block(parent_hash: Optional[int], token_ids: tuple[int, ...],
               extra_key: Hashable = None) -> int:
    """Prefix-aware block hash: equal hashes mean equal token prefixes up to this block, with the
    same `extra_key` (vLLM's extra keys, such as an adapter id; None or 0: none), so blocks are
    never shared across keys."""
    return hash((parent_hash, token_ids, extra_key) if extra_key else (parent_hash, token_ids))
