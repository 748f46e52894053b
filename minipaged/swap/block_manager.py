"""Swap preemption's side of the block manager (lesson 06, `preemption_mode="swap"`).

`SwapBlockManager` is the `BlockManager` (engine/block_manager.py) plus a second
`BlockAllocator` that owns the blocks of a CPU pool (no prefix cache there), and the block tables
of the sequences swapped out to it. `swap_out` moves a gang of sequences' tables there (a block
shared inside the gang gets one CPU block, so sharing survives the trip) and returns the (GPU,
CPU) block pairs whose contents the engine must copy (worker/swap.py); `swap_in` is the way back.
"""
from __future__ import annotations

from minipaged.engine.block_allocator import BlockAllocator
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.sequence import Sequence


def _move(table: list[int], src: BlockAllocator, dst: BlockAllocator,
          mapping: dict[int, int]) -> list[int]:
    """`table` rebuilt from `dst`'s blocks: a block already moved for another sequence of the
    gang (`mapping`, src -> dst id) is referenced once more, any other is allocated; the `src`
    references are dropped, tail first. Returns the new table."""
    for b in table:
        if b in mapping:
            dst.incref(dst.blocks[mapping[b]])
        else:
            mapping[b] = dst.allocate().block_id
    for b in reversed(table):
        src.decref(src.blocks[b])
    return [mapping[b] for b in table]


class SwapBlockManager(BlockManager):
    """A `BlockManager` with a CPU pool of `num_cpu_blocks` blocks (0: none, never swaps)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_key=None, *, num_cpu_blocks: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching, extra_key)
        self.cpu_allocator = (BlockAllocator(num_cpu_blocks, block_size, False)
                              if num_cpu_blocks > 0 else None)
        self.cpu_block_tables: dict[int, list[int]] = {}  # seq_id -> CPU block ids

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        if self.cpu_allocator is None:
            return False
        blocks = {b for s in seqs for b in self.block_tables[s.seq_id]}
        return len(blocks) <= self.cpu_allocator.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' tables to the CPU pool; returns (gpu, cpu) blocks to copy.

        A block shared by several of them maps to one CPU block (ref counts follow). A block
        also used outside the gang (a prefix hit) stays on the GPU for its other users.
        """
        mapping: dict[int, int] = {}
        for s in seqs:
            self.cache_full_blocks(s)  # blocks published for a step they leave are withdrawn
            table = self.block_tables.pop(s.seq_id)
            self.num_block_refs -= len(table)
            self.cpu_block_tables[s.seq_id] = _move(table, self.allocator, self.cpu_allocator,
                                                    mapping)
        return list(mapping.items())

    def num_swap_in_blocks(self, seqs: list[Sequence]) -> int:
        """GPU blocks `swap_in(seqs)` takes."""
        return len({b for s in seqs for b in self.cpu_block_tables[s.seq_id]})

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped-out tables back to fresh GPU blocks; returns (cpu, gpu) blocks to copy.

        Full blocks are published to the prefix cache again (first writer wins).
        """
        mapping: dict[int, int] = {}
        a = self.allocator
        bs = self.block_size
        for s in seqs:
            table = _move(self.cpu_block_tables.pop(s.seq_id), self.cpu_allocator, a, mapping)
            self.block_tables[s.seq_id] = table
            self.num_block_refs += len(table)
            key = self.hash_key(s)
            for i, h in enumerate(self._hashes[s.seq_id]):
                a.register(a.blocks[table[i]], h, tuple(s.token_ids[i * bs:(i + 1) * bs]), key)
        return list(mapping.items())

    def free(self, seq: Sequence) -> None:
        """`BlockManager.free`, or, for a sequence swapped out, its CPU blocks."""
        cpu_table = self.cpu_block_tables.pop(seq.seq_id, None)
        if cpu_table is None:
            return super().free(seq)
        for b in reversed(cpu_table):
            self.cpu_allocator.decref(self.cpu_allocator.blocks[b])
        del self.num_slots[seq.seq_id]
        del self._hashes[seq.seq_id]
