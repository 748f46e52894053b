"""Tests for `minipaged/engine/block_manager.py`: property tests over random operation sequences, then
unit tests for the prefix cache, LRU eviction and the accounting (`block_usage`).

The state machine drives `BlockManager` the way the scheduler and engine do (admit with
`get_computed_blocks + can_allocate + allocate`, grow with `can_append + append_slots`, then the
engine's post-step rule `num_computed_tokens += n; cache_full_blocks(seq)`), plus `fork` and
`free`, and the same-step cases of publishing at allocation: two requests of one prompt in one
pass (the second hits the first's blocks before they are computed; or that step's forward
raises) and a sequence preempted in the pass that planned it. Beside the manager it keeps its
own model of what every physical block holds (the token ids written into its slots and the
token prefix before it), so it can check that a prefix-cache hit really holds the request's
tokens, that between steps every published block holds its tokens, and that no write ever lands
in a block another sequence reads (except the one computing a block another admission of the
same pass hit).
"""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

import minipaged.engine.block_manager as bm_module
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.block_usage import block_usage, check_invariants
from minipaged.sampling import SamplingParams
from minipaged.engine.sequence import Sequence

# Prompts built from a few bases that share prefixes, cut anywhere, plus a short random tail
# from a tiny vocabulary: many requests share whole blocks, many diverge inside a block.
BASES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9],
    [7] * 12,
    [1, 2] * 6,
]
TOKEN = st.integers(0, 2)


def make_seq(tokens, name="r", **params) -> Sequence:
    return Sequence(request_id=name, prompt_token_ids=list(tokens),
                    sampling_params=SamplingParams(**params))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free over one `BlockManager`; see the module docstring."""

    prefix_caching = True

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.seqs: dict[int, Sequence] = {}
        self.origin: dict[int, list[str]] = {}  # seq_id -> per logical block: fresh/hit/fork/cow
        self.slots: dict[int, list[int]] = {}  # physical block -> token ids written in its slots
        self.prefix: dict[int, tuple[int, ...]] = {}  # physical block -> tokens before it
        self.names = 0

    # --- helpers ----------------------------------------------------------------------------
    def _blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    def _refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for table in self.bm.block_tables.values():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def _check_fits(self, answer: bool, op, seq: Sequence, blocks=()) -> None:
        """Run `op` on a deep copy: it must raise (out of blocks) exactly when `answer` is False."""
        bm2, seq2, blocks2 = copy.deepcopy((self.bm, seq, list(blocks)))
        try:
            op(bm2, seq2, blocks2)
            fitted = True
        except RuntimeError:
            fitted = False
        assert fitted == answer, f"can_* answered {answer} but the operation {'fit' if fitted else 'did not fit'}"

    def _fresh(self, block_ids, used_before: set[int]) -> None:
        for b in block_ids:
            assert b not in used_before, f"block {b} handed out while still in a table"
            self.slots[b] = []  # a fresh block holds garbage: forget what it held
            self.prefix[b] = None

    def _compute(self, seq: Sequence, n: int) -> None:
        """The model step: write tokens [computed, computed + n) into the table's blocks."""
        table = self.bm.block_tables[seq.seq_id]
        start = seq.num_computed_tokens
        for pos in range(start, start + n):
            i, off = divmod(pos, self.bs)
            b = table[i]
            # Shared only with an admission of the same pass that hit it (published at
            # allocation, vLLM V1): the readers want exactly what this write puts there.
            assert (self.bm.allocator.blocks[b].ref_count == 1
                    or self.bm._uncomputed.get(b, (None,))[0] is seq), (
                f"seq {seq.seq_id} writes position {pos} into block {b}, which has ref_count "
                f"{self.bm.allocator.blocks[b].ref_count}: copy-on-write missed")
            assert len(self.slots[b]) >= off, "a write skips slots"
            self.slots[b] = self.slots[b][:off] + [seq.token_ids[pos]]
            self.prefix[b] = tuple(seq.token_ids[:i * self.bs])
        # The engine's post-step rule.
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    def _pick(self, data) -> Sequence:
        return self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]

    # --- rules ------------------------------------------------------------------------------
    @initialize(bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 24))
    def setup(self, bs, num_blocks):
        self.bs = bs
        self.bm = BlockManager(num_blocks, bs, enable_prefix_caching=self.prefix_caching)

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 12),
          tail=st.lists(TOKEN, max_size=5), data=st.data())
    def admit(self, base, cut, tail, data):
        prompt = base[:cut] + tail or [0]
        self.names += 1
        seq = make_seq(prompt, f"r{self.names}")
        hits, num_cached = self.bm.get_computed_blocks(seq)
        ids = [b.block_id for b in hits]
        if not self.prefix_caching:
            assert hits == [] and num_cached == 0
        assert num_cached == len(hits) * self.bs
        assert num_cached <= len(prompt) - 1, "a prefix hit must leave >= 1 token to compute"
        assert len(set(ids)) == len(ids), f"one block twice in a prefix hit: {ids}"
        for i, b in enumerate(ids):
            assert self.slots.get(b) == prompt[i * self.bs:(i + 1) * self.bs], (
                f"hit block {b} at {i} holds {self.slots.get(b)}, prompt has "
                f"{prompt[i * self.bs:(i + 1) * self.bs]}")
            assert self.prefix.get(b) == tuple(prompt[:i * self.bs]), "hit block has another prefix"
        n = data.draw(st.integers(1, len(prompt) - num_cached), label="chunk")
        ok = self.bm.can_allocate(seq, hits, n)
        event(f"admit: {'prefix hit' if hits else 'no hit'}, {'fits' if ok else 'does not fit'}")
        self._check_fits(ok, lambda m, s, bl: m.allocate(s, bl, n), seq, hits)
        if not ok:
            return
        used_before = set(self._refs())
        refs_before = {b: self.bm.allocator.blocks[b].ref_count for b in ids}
        self.bm.allocate(seq, hits, n)
        table = self.bm.block_tables[seq.seq_id]
        assert table[:len(ids)] == ids
        assert len(table) == self._blocks_for(num_cached + n)
        for b in ids:
            assert self.bm.allocator.blocks[b].ref_count == refs_before[b] + 1
        assert seq.num_computed_tokens == num_cached
        self._fresh(table[len(ids):], used_before)
        self.seqs[seq.seq_id] = seq
        self.origin[seq.seq_id] = ["hit"] * len(ids) + ["fresh"] * (len(table) - len(ids))
        self._compute(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(new_tokens=st.lists(TOKEN, max_size=3), data=st.data())
    def append(self, new_tokens, data):
        seq = self._pick(data)
        if not new_tokens and seq.num_uncomputed_tokens == 0:
            new_tokens = [0]  # a decode: the sampled token is appended before it is computed
        for t in new_tokens:
            seq.append_token(t)
        self._append(seq, data.draw(st.integers(1, seq.num_uncomputed_tokens), label="n"))

    def _append(self, seq: Sequence, n: int) -> None:
        ok = self.bm.can_append(seq, n)
        self._check_fits(ok, lambda m, s, _: m.append_slots(s, n), seq)
        if not ok:
            event("append: does not fit")
            return
        old = list(self.bm.block_tables[seq.seq_id])
        idx = seq.num_computed_tokens // self.bs
        shared = idx < len(old) and self.bm.allocator.blocks[old[idx]].ref_count > 1
        event(f"append: {'copy-on-write' if shared else 'no copy'}")
        old_ref = self.bm.allocator.blocks[old[idx]].ref_count if idx < len(old) else None
        used_before = set(self._refs())
        copies = self.bm.append_slots(seq, n)
        table = self.bm.block_tables[seq.seq_id]
        assert len(table) == self._blocks_for(seq.num_computed_tokens + n)
        full = min(seq.num_computed_tokens + n, seq.num_tokens) // self.bs
        assert len(self.bm._hashes[seq.seq_id]) == (full if self.prefix_caching else 0), (
            "append_slots publishes the full blocks this step fills (cache_blocks)")
        if shared:
            assert copies == [(old[idx], table[idx])], f"expected one CoW of block {old[idx]}, got {copies}"
            assert table[idx] != old[idx]
            assert self.bm.allocator.blocks[old[idx]].ref_count == old_ref - 1
            self._fresh([table[idx]], used_before)
            self.slots[table[idx]] = list(self.slots[old[idx]])  # the engine copies the K/V
            self.prefix[table[idx]] = self.prefix[old[idx]]
            self.origin[seq.seq_id][idx] = "cow"
        else:
            assert copies == []
        for i, b in enumerate(old):
            if not (shared and i == idx):
                assert table[i] == b, f"append_slots moved logical block {i}"
        self._fresh(table[len(old):], used_before)
        self.origin[seq.seq_id] += ["fresh"] * (len(table) - len(old))
        if idx < len(table):
            assert self.bm.allocator.blocks[table[idx]].ref_count == 1
        self._compute(seq, n)

    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 12), tail=st.lists(TOKEN, max_size=3),
          runs=st.booleans(), data=st.data())
    def admit_together(self, base, cut, tail, runs, data):
        """Two requests of one prompt in one scheduling pass: the second hits the full blocks
        the first was just given slots for (published at allocation). `runs=False`: the step's
        forward raises; the next pass (`drop_uncomputed_blocks`) must unpublish those blocks and
        cut the second request back to the blocks before them."""
        prompt = base[:cut] + tail
        self.names += 2
        a, b = make_seq(prompt, f"r{self.names - 1}"), make_seq(prompt, f"r{self.names}")
        hits_a, cached_a = self.bm.get_computed_blocks(a)
        n_a = data.draw(st.integers(1, len(prompt) - cached_a), label="chunk a")
        if not self.bm.can_allocate(a, hits_a, n_a):
            return
        used_before = set(self._refs())
        self.bm.allocate(a, hits_a, n_a)
        table_a = self.bm.block_tables[a.seq_id]
        self._fresh(table_a[len(hits_a):], used_before)
        self.seqs[a.seq_id] = a
        self.origin[a.seq_id] = ["hit"] * len(hits_a) + ["fresh"] * (len(table_a) - len(hits_a))
        hits_b, cached_b = self.bm.get_computed_blocks(b)
        if self.prefix_caching:  # a's blocks filled by this step are found already
            expect = min(cached_a + n_a, len(prompt) - 1) // self.bs
            assert len(hits_b) >= expect
            for i, h in enumerate(hits_b[:expect]):
                if h.block_id == table_a[i]:
                    continue
                # An older block that still caches this prefix (its parent's block was evicted
                # and `a` registered the parent again: first writer wins): computed K/V of the
                # same tokens after the same prefix, so as good as a's.
                bs = self.bs
                assert h.block_id not in self.bm._uncomputed, f"hit on unwritten block {h.block_id}"
                assert self.slots.get(h.block_id) == prompt[i * bs:(i + 1) * bs]
                assert self.prefix.get(h.block_id) == tuple(prompt[:i * bs])
        n_b = len(prompt) - cached_b
        if not self.bm.can_allocate(b, hits_b, n_b):
            if not runs:
                self.bm.drop_uncomputed_blocks()
            self._compute(a, n_a)
            return
        used_before = set(self._refs())
        self.bm.allocate(b, hits_b, n_b)
        table_b = self.bm.block_tables[b.seq_id]
        self._fresh(table_b[len(hits_b):], used_before)
        self.seqs[b.seq_id] = b
        self.origin[b.seq_id] = ["hit"] * len(hits_b) + ["fresh"] * (len(table_b) - len(hits_b))
        event(f"admit together: {'runs' if runs else 'forward raises'}, "
              f"{'same-step hit' if cached_b > cached_a else 'no same-step hit'}")
        if not runs:
            self.bm.drop_uncomputed_blocks()  # the next pass; then the step is tried again
            self._compute(a, n_a)
            if b.num_computed_tokens == cached_b:  # its hits were all computed before
                self._compute(b, n_b)
                return
            assert b.num_computed_tokens <= cached_a, "kept a hit on an unrun block"
            table_b = self.bm.block_tables[b.seq_id]
            assert len(table_b) == self._blocks_for(b.num_computed_tokens)
            del self.origin[b.seq_id][len(table_b):]
            self._append(b, b.num_uncomputed_tokens)
            return
        self._compute(a, n_a)
        self._compute(b, n_b)

    @precondition(lambda self: self.seqs)
    @rule(new_tokens=st.lists(TOKEN, min_size=1, max_size=5), data=st.data())
    def plan_then_preempt(self, new_tokens, data):
        """A sequence is given slots for its next tokens (their full blocks are published),
        then preempted in the same pass, before any forward: freed uncomputed."""
        seq = self._pick(data)
        for t in new_tokens:
            seq.append_token(t)
        n = seq.num_uncomputed_tokens
        if not self.bm.can_append(seq, n):
            return
        used_before = set(self._refs())
        old = list(self.bm.block_tables[seq.seq_id])
        self.bm.append_slots(seq, n)
        table = self.bm.block_tables[seq.seq_id]
        fresh = [b for i, b in enumerate(table) if i >= len(old) or b != old[i]]
        self._fresh(fresh, used_before)
        self.bm.free(seq)  # (an invariant checks no published block holds unwritten slots)
        del self.seqs[seq.seq_id], self.origin[seq.seq_id]

    @precondition(lambda self: self.seqs)
    @rule(token=TOKEN, data=st.data())
    def fork_and_decode(self, token, data):
        """Fork, then the child decodes one token: a copy-on-write when the last block is partial."""
        child = self._fork(self._pick(data))
        if child.num_uncomputed_tokens == 0:
            child.append_token(token)
            self._append(child, 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(self._pick(data))

    def _fork(self, parent: Sequence) -> Sequence:
        self.names += 1
        child = make_seq(parent.token_ids, f"r{self.names}")
        refs_before = self._refs()
        self.bm.fork(parent, child)
        table = self.bm.block_tables[child.seq_id]
        assert table == self.bm.block_tables[parent.seq_id]
        assert table is not self.bm.block_tables[parent.seq_id]
        for b in table:
            assert self.bm.allocator.blocks[b].ref_count == refs_before[b] + 1
        assert child.num_computed_tokens == parent.num_computed_tokens
        self.seqs[child.seq_id] = child
        self.origin[child.seq_id] = ["fork"] * len(table)
        return child

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data)
        table = list(self.bm.block_tables[seq.seq_id])
        refs_before = self._refs()
        free_before = self.bm.num_free_blocks
        self.bm.free(seq)
        del self.seqs[seq.seq_id], self.origin[seq.seq_id]
        for b in table:
            assert self.bm.allocator.blocks[b].ref_count == refs_before[b] - 1
        assert self.bm.num_free_blocks == free_before + sum(1 for b in table if refs_before[b] == 1)
        self.bm.free(seq)  # freeing twice is a no-op, not a double decref
        assert self.bm.num_free_blocks == free_before + sum(1 for b in table if refs_before[b] == 1)

    # --- invariants -------------------------------------------------------------------------
    @invariant()
    def tables_are_consistent(self):
        if self.bm is None:
            return
        bm = self.bm
        check_invariants(bm, self.seqs.keys())
        refs = self._refs()
        for block in bm.allocator.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert bm.num_free_blocks == bm.num_blocks - len(refs)
        holders: dict[int, list[str]] = {}
        for seq_id, seq in self.seqs.items():
            table = bm.block_tables[seq_id]
            assert len(set(table)) == len(table), f"seq {seq_id} holds one block twice: {table}"
            assert len(table) == self._blocks_for(seq.num_computed_tokens)
            for i, b in enumerate(table):
                holders.setdefault(b, []).append(self.origin[seq_id][i])
                k = min(self.bs, seq.num_computed_tokens - i * self.bs)
                assert self.slots[b][:k] == seq.token_ids[i * self.bs:i * self.bs + k], (
                    f"seq {seq_id} block {i} (physical {b}) holds {self.slots[b][:k]}, "
                    f"expected {seq.token_ids[i * self.bs:i * self.bs + k]}")
                assert self.prefix[b] == tuple(seq.token_ids[:i * self.bs])
        for b, origins in holders.items():
            owners = [o for o in origins if o in ("fresh", "cow")]
            assert len(owners) <= 1, f"block {b} handed out to {len(owners)} tables"
            assert bm.allocator.blocks[b].ref_count == len(origins)
        # block_usage: every used block counted once, its filled slots the max over its holders.
        u = block_usage(bm)
        filled: dict[int, int] = {}
        for seq_id, seq in self.seqs.items():
            for i, b in enumerate(bm.block_tables[seq_id]):
                filled[b] = max(filled.get(b, 0), min(self.bs, seq.num_computed_tokens - i * self.bs))
        assert u.num_used_blocks == len(refs)
        assert u.num_tokens_stored == sum(filled.values())
        assert u.num_slots_allocated == len(refs) * self.bs
        assert u.internal_fragmentation == len(refs) * self.bs - sum(filled.values())
        assert u.num_free_blocks + u.num_cached_blocks == bm.num_free_blocks
        # Between steps the prefix cache publishes only blocks whose slots hold their tokens.
        assert not bm._uncomputed, "a block published at allocation outlived its step"
        for h, b in bm.allocator.hash_to_block.items():
            block = bm.allocator.blocks[b]
            assert self.slots.get(b) == list(block.token_ids), (
                f"published block {b} holds {self.slots.get(b)}, its hash says {block.token_ids}")
        if not self.prefix_caching:
            assert u.num_cached_blocks == 0

    def teardown(self):
        if self.bm is None:
            return
        for seq in list(self.seqs.values()):
            self.bm.free(seq)
        check_invariants(self.bm, [])
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.allocator.blocks)
        u = block_usage(self.bm)
        assert (u.num_used_blocks, u.num_tokens_stored, u.num_slots_allocated) == (0, 0, 0)


class BlockManagerMachineNoPrefixCache(BlockManagerMachine):
    prefix_caching = False


STATEFUL = settings(max_examples=60, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("machine", [BlockManagerMachine, BlockManagerMachineNoPrefixCache],
                         ids=["prefix-cache", "no-prefix-cache"])
def test_block_manager_state_machine(machine):
    run_state_machine_as_test(machine, settings=STATEFUL)


# --- unit tests -----------------------------------------------------------------------------
def run(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Admit `seq` and compute n of its tokens (all, by default), as scheduler + engine do."""
    hits, num_cached = bm.get_computed_blocks(seq)
    n = seq.num_tokens - num_cached if n is None else n
    assert bm.can_allocate(seq, hits, n)
    bm.allocate(seq, hits, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_prefix_hit_returns_the_cached_blocks_and_token_count():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(1, 11))  # 10 tokens: blocks [1-4] [5-8] and a partial [9, 10]
    run(bm, a)
    table_a = bm.get_block_table(a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44])
    hits, num_cached = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == table_a[:2]
    assert num_cached == 8
    run(bm, b)
    assert bm.get_block_table(b)[:2] == table_a[:2]
    assert bm.get_block_table(b)[2] != table_a[2]
    assert b.num_cached_tokens == 8
    assert [bm.allocator.blocks[i].ref_count for i in table_a] == [2, 2, 1]
    # Diverging inside the second block: only the first block is shared.
    c = make_seq([1, 2, 3, 4, 5, 6, 0, 8, 9])
    hits, num_cached = bm.get_computed_blocks(c)
    assert [h.block_id for h in hits] == table_a[:1] and num_cached == 4
    # Same second block behind a different first block: the chained hash makes it a miss.
    d = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(d) == ([], 0)
    assert bm.prefix_queries == 10 + 11 and bm.prefix_hits == 8
    check_invariants(bm, [a.seq_id, b.seq_id])


@pytest.mark.parametrize("extra, expected_blocks", [(0, 1), (1, 2), (3, 2)])
def test_prefix_hit_leaves_at_least_one_token_to_compute(extra, expected_blocks):
    bm = BlockManager(num_blocks=16, block_size=4)
    run(bm, make_seq(range(12)))
    seq = make_seq(list(range(8 + extra)))  # the same tokens, 8 + extra of them
    hits, num_cached = bm.get_computed_blocks(seq)
    assert len(hits) == expected_blocks and num_cached == 4 * expected_blocks
    assert num_cached < seq.num_tokens


def test_prefix_cache_off_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(10))
    run(bm, a)
    assert bm.get_computed_blocks(make_seq(range(10))) == ([], 0)
    assert all(b.block_hash is None for b in bm.allocator.blocks)


def test_freed_blocks_stay_cached_and_are_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(9))  # 2 full blocks + 1 partial
    run(bm, a)
    full = bm.get_block_table(a)[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    u = block_usage(bm)
    assert (u.num_cached_blocks, u.num_free_blocks, u.num_used_blocks) == (2, 2, 0)
    b = make_seq(list(range(8)) + [99, 98, 97, 96, 95, 94])  # 14 tokens = 4 blocks, 2 cached
    hits, num_cached = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == full and num_cached == 8
    # Reviving the two cached blocks takes them out of the free queue: 2 + 2 fresh = all 4.
    assert bm.can_allocate(b, hits, 6)
    assert not bm.can_allocate(b, hits, 9)  # would need a fifth block
    run(bm, b)
    assert bm.get_block_table(b)[:2] == full and bm.num_free_blocks == 0
    assert bm.allocator.num_evictions == 0
    assert block_usage(bm).num_cached_blocks == 0
    check_invariants(bm, [b.seq_id])


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra_key=None: 12345)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run(bm, a)
    assert bm.allocator.hash_to_block == {12345: bm.get_block_table(a)[0]}
    # Every block of b hashes to 12345 too, but its tokens differ: no hit.
    b = make_seq([4, 3, 2, 1, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(b) == ([], 0)
    run(bm, b)
    assert len(set(bm.get_block_table(a)) | set(bm.get_block_table(b))) == 6  # nothing shared
    # The one block with equal tokens still hits.
    c = make_seq([1, 2, 3, 4, 0, 0])
    hits, num_cached = bm.get_computed_blocks(c)
    assert [h.block_id for h in hits] == bm.get_block_table(a)[:1] and num_cached == 4
    check_invariants(bm, [a.seq_id, b.seq_id])


def test_hash_collision_across_lora_adapters_is_a_miss(monkeypatch):
    """Equal tokens under another extra key (here: another adapter) have other K/V: even a
    colliding hash is no hit."""
    from minipaged.lora import LoRARequest
    from minipaged.lora.scheduling import lora_hash_key
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra_key=None: 12345)
    bm = BlockManager(num_blocks=16, block_size=4, extra_key=lora_hash_key)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b.lora_request = LoRARequest("x", 1, "/x")
    assert bm.get_computed_blocks(b) == ([], 0)
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])  # the same adapter (none): a hit
    assert bm.get_computed_blocks(c)[1] == 4


def test_lru_eviction_order():
    """New blocks come from the front of the free queue: never-used blocks first, then freed
    blocks in the order they were freed (a sequence's tail before its head), so the cached
    prefix freed most recently survives longest."""
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 1, 2, 2, 3, 3, 4])  # blocks: [1 1] [2 2] [3 3] [4]
    run(bm, a)
    ta = bm.get_block_table(a)
    b = make_seq([5, 5, 6, 6, 7])  # [5 5] [6 6] [7]
    run(bm, b)
    tb = bm.get_block_table(b)
    assert sorted(ta + tb) == list(range(7))  # block 7 never used
    bm.free(a)
    bm.free(b)
    expected_order = [7] + ta[::-1] + tb[::-1]
    assert list(bm.allocator.free_queue) == expected_order
    # Take blocks one at a time (1-token sequences never hit the cache) and watch the order.
    got, evicted = [], []
    for k in range(8):
        s = make_seq([100 + k])
        run(bm, s)
        got.append(bm.get_block_table(s)[0])
        evicted.append(bm.allocator.num_evictions)
        if k == 0:  # the never-used block went first: every cached prefix still hits
            assert bm.get_computed_blocks(make_seq([1, 1, 2, 2, 3, 3, 0]))[1] == 6
        if k == 2:  # a's tail [4] (no hash) and [3 3] are gone; [1 1] [2 2] still hit
            assert bm.get_computed_blocks(make_seq([1, 1, 2, 2, 3, 3, 0]))[1] == 4
            assert bm.get_computed_blocks(make_seq([5, 5, 6, 6, 0]))[1] == 4
    assert got == expected_order
    assert evicted == [0, 0, 1, 2, 3, 3, 4, 5]  # only hashed (full) blocks count as evictions
    assert bm.get_computed_blocks(make_seq([1, 1, 2, 2, 0])) == ([], 0)


def test_revived_cached_block_moves_to_the_back_of_the_queue():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 1, 2])
    run(bm, a)
    bm.free(a)  # queue: 2 3 | a's tail, a's head
    b = make_seq([1, 1, 9])
    run(bm, b)  # revives [1 1], takes one fresh block
    bm.free(b)
    queue = list(bm.allocator.free_queue)
    hit = bm.get_computed_blocks(make_seq([1, 1, 0]))[0][0].block_id
    assert queue[-1] == hit, "the prefix used most recently is evicted last"


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(6))  # one full block, one partial block of 2
    run(bm, parent)
    child = make_seq(range(6), "child")
    bm.fork(parent, child)
    tp = list(bm.get_block_table(parent))
    assert bm.get_block_table(child) == tp
    assert [bm.allocator.blocks[b].ref_count for b in tp] == [2, 2]
    assert bm.num_free_blocks == 6
    # The child samples a token and writes it into the shared partial block: copy first.
    child.append_token(50)
    assert bm.can_append(child, 1)
    copies = bm.append_slots(child, 1)
    tc = bm.get_block_table(child)
    assert copies == [(tp[1], tc[1])] and tc[0] == tp[0] and tc[1] != tp[1]
    assert [bm.allocator.blocks[b].ref_count for b in tp] == [2, 1]
    assert bm.allocator.blocks[tc[1]].ref_count == 1
    # The parent now owns its partial block alone: no second copy.
    parent.append_token(60)
    assert bm.append_slots(parent, 1) == []
    assert bm.get_block_table(parent) == tp
    check_invariants(bm, [parent.seq_id, child.seq_id])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_can_append_counts_the_copy_on_write_block():
    bm = BlockManager(num_blocks=3, block_size=4)
    parent = make_seq(range(6))
    run(bm, parent)  # 2 blocks used, 1 free
    child = make_seq(range(6), "child")
    bm.fork(parent, child)
    child.append_token(1)
    assert bm.can_append(child, 2)  # CoW block (1) + nothing new: 6 + 2 = 8 fits 2 blocks
    assert not bm.can_append(child, 3)  # CoW block + a third block = 2 > 1 free


def test_usage_numbers():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(6))
    run(bm, a)
    u = block_usage(bm)
    assert (u.num_used_blocks, u.num_tokens_stored, u.num_slots_allocated) == (2, 6, 8)
    assert u.internal_fragmentation == 2 and u.token_state_share == pytest.approx(0.75)
    assert (u.num_cached_blocks, u.num_free_blocks) == (0, 8)  # a's hashed block is in use, not cached
    b = make_seq(range(6), "b")
    bm.fork(a, b)
    u = block_usage(bm)
    assert (u.num_used_blocks, u.num_tokens_stored, u.internal_fragmentation) == (2, 6, 2)
    b.append_token(7)
    bm.append_slots(b, 1)
    b.num_computed_tokens += 1
    u = block_usage(bm)  # a: [0-3] shared, [4 5 _ _]; b: its copy [4 5 7 _]
    assert (u.num_used_blocks, u.num_tokens_stored, u.num_slots_allocated) == (3, 4 + 2 + 3, 12)
    assert u.internal_fragmentation == 3 and u.token_state_share == pytest.approx(9 / 12)
    bm.free(a)
    u = block_usage(bm)  # a's partial block goes free (no hash); the shared full block stays with b
    assert (u.num_used_blocks, u.num_tokens_stored, u.num_cached_blocks) == (2, 7, 0)
    bm.free(b)
    u = block_usage(bm)
    assert (u.num_used_blocks, u.num_tokens_stored, u.num_cached_blocks, u.num_free_blocks) == (0, 0, 1, 9)
    assert u.token_state_share == 1.0


def test_allocate_twice_and_double_free_raise():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(3))
    run(bm, a)
    with pytest.raises(RuntimeError, match="already has a block table"):
        bm.allocate(a, [], 1)
    block = bm.allocator.blocks[bm.get_block_table(a)[0]]
    bm.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        bm.allocator.decref(block)
