"""A block manager's accounting and its self-check, read from its public state (lessons 01, 02).

`block_usage(bm)` counts the cache exactly from the block tables: blocks used, cached and free,
the tokens they store and the empty slots at the tails (`BlockUsage`, what lesson 01 plots; the
engine records one per step with `record_block_tables`); `blocks_saved_by_sharing(bm)` what
forks and prefix hits save (lesson 06, in every StepRecord). `check_invariants(bm)` raises if ref
counts, the free queue or the prefix-cache index disagree with the tables: the property tests
call it after every operation, a lesson after every step. Neither is part of the algorithm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from minipaged.engine.block_allocator import BlockAllocator
from minipaged.engine.block_manager import BlockManager
from minipaged.swap.block_manager import SwapBlockManager


@dataclass
class BlockUsage:
    """A snapshot of the cache for the lessons' plots (lesson 01)."""

    num_blocks: int
    block_size: int
    num_used_blocks: int  # ref_count > 0
    num_cached_blocks: int  # ref_count == 0 but holding a reusable prefix
    num_free_blocks: int  # ref_count == 0 and empty (cached blocks not included)
    num_tokens_stored: int  # token slots in used blocks that hold a token (shared blocks once)
    num_slots_allocated: int  # num_used_blocks * block_size

    @property
    def internal_fragmentation(self) -> int:
        """Slots in used blocks that hold no token (the tail of each sequence's last block)."""
        return self.num_slots_allocated - self.num_tokens_stored

    @property
    def token_state_share(self) -> float:
        """Share of allocated KV slots that hold a token's state (vLLM paper, Fig. 2)."""
        return self.num_tokens_stored / self.num_slots_allocated if self.num_slots_allocated else 1.0


def block_usage(bm: BlockManager) -> BlockUsage:
    """Exact counts from the tables: used / cached / free blocks, tokens and empty slots."""
    bs = bm.block_size
    filled: dict[int, int] = {}  # physical block -> slots holding a token (max over sharers)
    for seq_id, table in bm.block_tables.items():
        n = bm.num_slots[seq_id]
        for i, b in enumerate(table):
            filled[b] = max(filled.get(b, 0), min(bs, max(n - i * bs, 0)))
    a = bm.allocator
    num_used = a.num_blocks - a.num_free_blocks
    return BlockUsage(
        num_blocks=a.num_blocks, block_size=bs, num_used_blocks=num_used,
        num_cached_blocks=a.num_cached_free,
        num_free_blocks=a.num_free_blocks - a.num_cached_free,
        num_tokens_stored=sum(filled.values()), num_slots_allocated=num_used * bs)


def blocks_saved_by_sharing(bm: BlockManager) -> int:
    """Block-table entries that point at a block another table also uses: the blocks the
    same sequences would take without sharing (fork, prefix hits), minus what they take
    (lesson 06)."""
    return bm.num_block_refs - (bm.num_blocks - bm.num_free_blocks)


def check_invariants(bm: BlockManager, live_seq_ids: Optional[Iterable[int]] = None) -> None:
    """Raise if ref counts, the free queue or the hash index disagree with the tables, or (given
    `live_seq_ids`) if a table belongs to no live sequence; swap preemption's CPU pool too."""
    refs = check_allocator(bm.allocator, bm.block_tables.values(), "block")
    if live_seq_ids is not None and set(live_seq_ids) != set(bm.block_tables):
        raise AssertionError("block tables exist for sequences that are not live")
    if bm.num_block_refs != sum(refs):
        raise AssertionError(f"num_block_refs {bm.num_block_refs} != {sum(refs)} table entries")
    if isinstance(bm, SwapBlockManager) and bm.cpu_allocator is not None:
        check_allocator(bm.cpu_allocator, bm.cpu_block_tables.values(), "CPU block")


def check_allocator(a: BlockAllocator, tables: Iterable[list[int]], what: str) -> list[int]:
    """Raise unless every block's ref count equals its number of entries in `tables`, a
    block is in the free queue exactly when nothing references it, and the hash index and
    the cached count agree with the blocks. Returns the references counted per block."""
    refs = [0] * a.num_blocks
    for table in tables:
        for b in table:
            refs[b] += 1
    for block in a.blocks:
        if block.ref_count != refs[block.block_id]:
            raise AssertionError(f"{what} {block.block_id}: ref_count {block.ref_count} "
                                 f"but {refs[block.block_id]} table references")
        in_free = block.block_id in a.free_queue
        if in_free != (block.ref_count == 0):
            raise AssertionError(f"{what} {block.block_id}: ref_count {block.ref_count}, "
                                 f"in free queue: {in_free}")
    for h, b in a.hash_to_block.items():
        if a.blocks[b].block_hash != h:
            raise AssertionError(f"hash index points at {what} {b} whose hash differs")
    cached = sum(1 for b in a.free_queue if a.blocks[b].block_hash is not None)
    if cached != a.num_cached_free:
        raise AssertionError(f"num_cached_free {a.num_cached_free} != {cached}")
    return refs
