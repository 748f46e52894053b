"""Paged KV-cache bookkeeping: which physical block holds which tokens of which sequence.

Lesson 02 walks through this file. Like an operating system's page allocator it only hands out
block *ids* (the K/V live in kv_cache.py). `BlockAllocator` (block_allocator.py) owns the
physical blocks; `BlockManager` owns one `block_table` per sequence (logical block i -> physical
block id) and speaks the scheduler's language: `can_allocate / allocate / can_append /
append_slots / fork / free`, and `truncate`. Copy-on-write: a sequence about to write into a
block another one references gets a private copy first, and the caller is told what to copy.

A block's hash covers its whole prefix (`hash_block`, with `extra_key(seq)` chosen at build). A
full block is published when its slots are handed out (`cache_blocks`, vLLM V1's rule), before
the forward writes them, so requests of one prompt arriving together prefill it once (each layer
stores the step's K/V before any attention reads them). It leaves the prefix cache again if its
step never runs (`cache_full_blocks`, `drop_uncomputed_blocks`).
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional

from minipaged.engine.block_allocator import Block, BlockAllocator, hash_block
from minipaged.engine.sequence import Sequence
from minipaged.utils import cdiv


class BlockManager:
    """Per-sequence block tables on top of a `BlockAllocator` (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_key: Optional[Callable[[Sequence], Hashable]] = None):
        self.block_size = block_size
        self.extra_key = extra_key  # seq -> what its hashes mix in besides tokens (None: nothing)
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> physical block ids
        self.num_slots: dict[int, int] = {}  # seq_id -> token slots its table covers so far
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chain hashes of its full blocks
        # Blocks published at allocation whose K/V the step has not written yet:
        # block id -> (the sequence that computes it, its logical index, its hash); by seq_id.
        self._uncomputed: dict[int, tuple[Sequence, int, int]] = {}
        self._uncomputed_of: dict[int, list[int]] = {}
        # Sequences admitted with a hit on such a block: seq_id -> (seq, first such index).
        self._uncomputed_hits: dict[int, tuple[Sequence, int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache ...
        self.prefix_hits = 0  # ... and found there
        self.num_block_refs = 0  # entries in all block tables (accounting: block_usage.py)

    # --- sizes ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def hash_key(self, seq: Sequence) -> Hashable:
        """What `seq`'s block hashes mix in besides its tokens (`extra_key`; None: nothing)."""
        return None if self.extra_key is None else self.extra_key(seq)

    # --- admission --------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
        """Longest cached prefix of `seq` in whole blocks: (blocks, number of tokens they hold).
        At least one token is left to compute: its logits sample the next (vLLM does the same).
        Nothing for a sequence that computes every token (`skip_reading_prefix_cache`)."""
        if not self.enable_prefix_caching or seq.skip_reading_prefix_cache:
            return [], 0
        bs = self.block_size
        tokens = seq.token_ids
        key = self.hash_key(seq)
        hits: list[Block] = []
        parent: Optional[int] = None
        for start in range(0, len(tokens) - 1 - bs + 1, bs):  # only blocks inside tokens[:-1]
            chunk = tuple(tokens[start:start + bs])
            h = hash_block(parent, chunk, key)
            block = self.allocator.lookup(h, chunk, key)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits, len(hits) * bs

    def can_allocate(self, seq: Sequence, computed_blocks: list[Block], num_new_tokens: int) -> bool:
        """Can `seq` (no blocks yet) get its cached prefix plus room for `num_new_tokens`?"""
        num_computed = len(computed_blocks) * self.block_size
        needed = self.num_blocks_for(num_computed + num_new_tokens) - len(computed_blocks)
        # Cached hits with ref_count 0 sit in the free queue: reusing them also takes free blocks.
        needed += sum(1 for b in computed_blocks if b.ref_count == 0)
        return needed <= self.allocator.num_free_blocks

    def allocate(self, seq: Sequence, computed_blocks: list[Block], num_new_tokens: int,
                 publish: bool = True) -> None:
        """Give a new (or recomputing) sequence its block table: cached prefix + fresh blocks,
        and publish the full blocks its `num_new_tokens` fill (`publish=False`: the caller
        schedules fewer of them this step and publishes those itself, `cache_blocks`)."""
        if seq.seq_id in self.block_tables:
            raise RuntimeError(f"sequence {seq.seq_id} already has a block table")
        for block in computed_blocks:
            self.allocator.incref(block)
        table = [b.block_id for b in computed_blocks]
        num_computed = len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        table += [self.allocator.allocate().block_id
                  for _ in range(self.num_blocks_for(total) - len(table))]
        self.block_tables[seq.seq_id] = table
        self.num_block_refs += len(table)
        self.num_slots[seq.seq_id] = total
        self._hashes[seq.seq_id] = [self.allocator.blocks[b].block_hash for b in table[:len(computed_blocks)]]
        seq.num_computed_tokens = num_computed
        if not seq.num_preemptions:  # the request's own hit, not a readmission after preemption
            seq.num_cached_tokens = num_computed
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_computed
            first = next((i for i, b in enumerate(computed_blocks)
                          if b.block_id in self._uncomputed), None)
            if first is not None:  # a block this very step computes for another sequence
                self._uncomputed_hits[seq.seq_id] = (seq, first)
        if publish:
            self.cache_blocks(seq, total)

    # --- growth -----------------------------------------------------------------------------
    def _needs_cow(self, seq: Sequence) -> Optional[int]:
        """Index of the block the next token lands in, if another sequence shares it."""
        table = self.block_tables[seq.seq_id]
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(table) and self.allocator.blocks[table[idx]].ref_count > 1:
            return idx
        return None

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        table = self.block_tables[seq.seq_id]
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table)
        needed = max(needed, 0) + (1 if self._needs_cow(seq) is not None else 0)
        return needed <= self.allocator.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens; returns CoW copies as (src, dst) block ids."""
        table = self.block_tables[seq.seq_id]
        copies: list[tuple[int, int]] = []
        idx = self._needs_cow(seq)
        if idx is not None:  # copy-on-write: never write into a block someone else reads
            src = self.allocator.blocks[table[idx]]
            dst = self.allocator.allocate()
            self.allocator.decref(src)
            table[idx] = dst.block_id
            copies.append((src.block_id, dst.block_id))
        total = seq.num_computed_tokens + num_new_tokens
        while len(table) < self.num_blocks_for(total):
            table.append(self.allocator.allocate().block_id)
            self.num_block_refs += 1
        self.num_slots[seq.seq_id] = max(self.num_slots[seq.seq_id], total)
        self.cache_blocks(seq, total)  # publish what this step will fill (vLLM V1)
        return copies

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the full blocks among the first `num_tokens` slots, computed or about to be
        computed by the step being planned (vLLM's `cache_blocks`). Only blocks whose tokens the
        host knows: never a guessed token, nor one still on its way from the GPU."""
        bs = self.block_size
        hashes = self._hashes[seq.seq_id]
        known = min(num_tokens, seq.num_tokens)
        if not self.enable_prefix_caching or known // bs <= len(hashes):
            return  # (the common case: no block fills up)
        table = self.block_tables[seq.seq_id]
        a = self.allocator
        key = self.hash_key(seq)
        for i in range(len(hashes), min(known // bs, len(table))):
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(hashes[-1] if hashes else None, chunk, key)
            hashes.append(h)
            block = a.blocks[table[i]]
            a.register(block, h, chunk, key)
            if (i + 1) * bs > seq.num_computed_tokens and block.block_hash == h:
                self._uncomputed[block.block_id] = (seq, i, h)  # published ahead of its K/V
                self._uncomputed_of.setdefault(seq.seq_id, []).append(block.block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """The sequence's K/V are now its first `num_computed_tokens` (after a step, or as it is
        freed): publish the blocks that filled up; a block published at allocation counts as
        computed if it lies inside, and leaves the prefix cache if not (its step never ran)."""
        computed = seq.num_computed_tokens
        for b in self._uncomputed_of.pop(seq.seq_id, ()):
            owner, i, _ = self._uncomputed.get(b, (None, 0, 0))
            if owner is not seq:
                continue  # (reallocated and published by another sequence since)
            if (i + 1) * self.block_size <= computed:
                del self._uncomputed[b]
            else:
                self._withdraw(b)
        del self._hashes[seq.seq_id][computed // self.block_size:]  # hashed for a step not run
        self.cache_blocks(seq, computed)

    def _withdraw(self, block_id: int) -> None:
        """Take a block published at allocation out of the prefix cache (its K/V never came),
        and its hash off its sequence's chain (so it is hashed again once computed)."""
        seq, i, h = self._uncomputed.pop(block_id)
        block = self.allocator.blocks[block_id]
        if block.block_hash == h:
            self.allocator.uncache(block)
        hashes = self._hashes.get(seq.seq_id)
        if hashes is not None:
            del hashes[seq.num_computed_tokens // self.block_size:]

    def drop_uncomputed_blocks(self) -> None:
        """As a scheduling pass starts: blocks still published ahead of their K/V belong to a
        step whose forward raised. They leave the prefix cache; a sequence admitted with a hit
        on one is truncated before it (the scheduler gives it the rest as prefill)."""
        hits, self._uncomputed_hits = self._uncomputed_hits, {}
        if not self._uncomputed:
            return  # (the common case: the last step ran)
        bs = self.block_size
        for seq, first in hits.values():
            if seq.seq_id in self.block_tables and seq.num_computed_tokens > first * bs:
                self.truncate(seq, first * bs)
        for b in list(self._uncomputed):
            self._withdraw(b)
        self._uncomputed_of.clear()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks of the first `num_tokens` tokens, now all that is computed of
        `seq`; the tail goes to the back of the free queue. For a step that ran only in part
        (rejected guesses, lesson 10; `drop_uncomputed_blocks`)."""
        table = self.block_tables[seq.seq_id]
        keep = self.num_blocks_for(num_tokens)
        while len(table) > keep:
            self.allocator.decref(self.allocator.blocks[table.pop()])
            self.num_block_refs -= 1
        seq.num_computed_tokens = num_tokens
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)
        self.num_slots[seq.seq_id] = num_tokens
        del self._hashes[seq.seq_id][num_tokens // self.block_size:]

    # --- sharing and release ----------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (ref counts +1); writes will copy-on-write."""
        table = list(self.block_tables[parent.seq_id])
        for b in table:
            self.allocator.incref(self.allocator.blocks[b])
        self.block_tables[child.seq_id] = table
        self.num_block_refs += len(table)
        self.num_slots[child.seq_id] = self.num_slots[parent.seq_id]
        self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail blocks first (evicted first). Full blocks not yet
        published go to the prefix cache first (a step loop may read the last token late)."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return  # (freed already)
        self.cache_full_blocks(seq)
        del self.block_tables[seq.seq_id]
        for b in reversed(table):
            self.allocator.decref(self.allocator.blocks[b])
        self.num_block_refs -= len(table)
        del self.num_slots[seq.seq_id]
        del self._hashes[seq.seq_id]

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    # --- accounting -------------------------------------------------------------------------
    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
