"""KVCacheManager: the basic sharing cases with exact block ids, refcounts and eviction order.

Block size 4 throughout; a fresh pool hands out 0, 1, 2, ... and reuses the last freed block
first. check_invariants() runs after every operation.
"""

from __future__ import annotations

import pytest

from radixkv.kvcache import (
    NO_GROWTH,
    Admission,
    BlockId,
    Growth,
    InvalidTokensError,
    KVCacheManager,
    KVCacheStats,
    SeqId,
    SequenceExistsError,
    UnknownSequenceError,
)

SYSTEM = [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]  # 2 full blocks + 2 tokens


def b(*ids: int) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def s(i: int) -> SeqId:
    return SeqId(i)


def refcounts(kv: KVCacheManager, *ids: int) -> list[int]:
    return [kv.refcount(BlockId(i)) for i in ids]


def tree_shape(kv: KVCacheManager, salt: str | None = None) -> list[tuple]:
    return [
        (node.start, node.token_ids, node.block_ids, node.lock_count)
        for node in kv.tree.nodes(salt)
    ]


@pytest.fixture
def kv() -> KVCacheManager:
    return KVCacheManager(num_blocks=16, block_size=4)


def test_shared_system_prompt_is_computed_once(kv: KVCacheManager) -> None:
    a = SYSTEM + [1, 2]  # 12 tokens: exactly 3 blocks
    assert kv.admit(s(0), a + [3], None) == Admission(0, b(0, 1, 2, 3), [])
    assert kv.cache(s(0), a) == []
    kv.check_invariants()
    assert tree_shape(kv) == [(0, tuple(a), b(0, 1, 2), 1)]
    # B shares the system prompt and A's first two user tokens: 12 tokens, 3 full blocks
    admission = kv.admit(s(1), a + [7, 8, 9], None)
    assert admission == Admission(12, b(0, 1, 2, 4), [])
    assert refcounts(kv, 0, 1, 2, 3, 4) == [3, 3, 3, 1, 1]
    # both sequences hold the cached prefix through their locks: the allocator counts only
    # the tree's reference there
    assert [kv.allocator.refcount(BlockId(i)) for i in range(5)] == [1, 1, 1, 1, 1]
    assert tree_shape(kv)[0][3] == 2
    kv.check_invariants()
    stats = kv.stats()
    assert (stats.hit_tokens, stats.queried_tokens) == (12, 12 + 14)
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_referenced_blocks) == (
        11, 0, 5,
    )
    kv.free(s(0))
    kv.free(s(1))
    assert refcounts(kv, 0, 1, 2, 3, 4) == [1, 1, 1, 0, 0]
    assert kv.stats().num_cached_blocks == 3
    kv.check_invariants()


def test_divergence_mid_block_copies_the_block_and_recomputes_only_the_rest(
    kv: KVCacheManager,
) -> None:
    a = SYSTEM + [1, 2, 3, 4, 5]  # 15 tokens
    kv.admit(s(0), a, None)
    kv.free(s(0), a)  # inserts 3 full blocks + a partial tail (3 tokens)
    assert tree_shape(kv) == [(0, tuple(a), b(0, 1, 2, 3), 0)]
    # diverges after token 13 (inside block 3): 13 cached tokens, block 3 copied
    prompt = SYSTEM + [1, 2, 3, 9, 9]
    assert kv.peek_prefix(prompt, None) == 13
    admission = kv.admit(s(1), prompt, None)
    assert admission == Admission(13, b(0, 1, 2, 4), [(BlockId(3), BlockId(4))])
    # the cached node stays locked, copy source included, while the sequence may read it
    assert tree_shape(kv) == [(0, tuple(a), b(0, 1, 2, 3), 1)]
    assert refcounts(kv, 0, 1, 2, 3, 4) == [2, 2, 2, 1, 1]
    kv.check_invariants()
    assert kv.cache(s(1), prompt) == []  # no full block of its own yet
    kv.free(s(1), prompt)
    assert tree_shape(kv) == [
        (0, tuple(SYSTEM + [1, 2]), b(0, 1, 2), 0),
        (12, (3, 4, 5), b(3), 0),
        (12, (3, 9, 9), b(4), 0),
    ]
    kv.check_invariants()


def test_fork_shares_every_block_and_copies_on_first_divergent_write(kv: KVCacheManager) -> None:
    prompt = SYSTEM + [1]  # 11 tokens: blocks 0 1 2 (3 tokens in block 2)
    kv.admit(s(0), prompt, None)
    kv.fork(s(0), s(1))
    assert kv.block_ids(s(1)) == b(0, 1, 2)
    assert refcounts(kv, 0, 1, 2) == [2, 2, 2]
    kv.check_invariants()
    # the parent writes token 11 into shared block 2: it gets a copy
    assert kv.grow(s(0), 1) == Growth((), ((2, BlockId(3)),), ((BlockId(2), BlockId(3)),))
    assert kv.block_ids(s(0)) == b(0, 1, 3)
    assert refcounts(kv, 2, 3) == [1, 1]
    # the child now owns block 2 alone: no copy
    assert kv.grow(s(1), 1) is NO_GROWTH
    assert kv.block_ids(s(1)) == b(0, 1, 2)
    # both fill their block and move on to fresh ones
    assert kv.grow(s(0), 1) == Growth((BlockId(4),))
    assert kv.grow(s(1), 1) == Growth((BlockId(5),))
    assert (kv.num_tokens(s(0)), kv.num_tokens(s(1))) == (13, 13)
    kv.check_invariants()
    kv.free(s(0))
    kv.free(s(1))
    assert kv.num_free_blocks == 16
    kv.check_invariants()


def test_fork_of_a_full_table_shares_without_copies(kv: KVCacheManager) -> None:
    kv.admit(s(0), SYSTEM + [1, 2], None)  # 12 tokens, 3 full blocks
    kv.fork(s(0), s(1))
    assert kv.grow(s(0), 1) == Growth((BlockId(3),))
    assert kv.grow(s(1), 2) == Growth((BlockId(4),))
    assert refcounts(kv, 0, 1, 2, 3, 4) == [2, 2, 2, 1, 1]
    kv.check_invariants()


def test_salts_are_isolated(kv: KVCacheManager) -> None:
    kv.admit(s(0), SYSTEM + [1, 2, 3], "alice")
    kv.free(s(0), SYSTEM + [1, 2, 3])
    assert kv.peek_prefix(SYSTEM + [1, 2, 3], "alice") == 12
    assert kv.peek_prefix(SYSTEM + [1, 2, 3], "bob") == 0
    assert kv.peek_prefix(SYSTEM + [1, 2, 3], None) == 0
    admission = kv.admit(s(1), SYSTEM + [1, 2, 3], "bob")
    assert admission == Admission(0, b(4, 5, 6, 7), [])
    kv.free(s(1), SYSTEM + [1, 2, 3])
    assert tree_shape(kv, "alice")[0][2] == b(0, 1, 2, 3)
    assert tree_shape(kv, "bob")[0][2] == b(4, 5, 6, 7)
    kv.check_invariants()


def test_eviction_under_pressure_spares_locked_paths_and_takes_lru_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    # three cached prefixes of two blocks each, cached in order p0, p1, p2
    prompts = [[10 * i + j for j in range(8)] for i in range(3)]
    for i, prompt in enumerate(prompts):
        kv.admit(s(i), prompt, None)
        kv.free(s(i), prompt)
    lru_first_tokens = [node.token_ids[0] for node in kv.tree.lru_order()]
    assert lru_first_tokens == [0, 10, 20]
    # a live sequence locks p0 (its whole prompt matches but the last token)
    assert kv.admit(s(10), prompts[0] + [99], None) is not None
    kv.check_invariants()
    assert kv.num_available_blocks() == 8 - 3  # p0's 2 blocks and the new block are in use
    # 4 new blocks, 1 free: evicts p1 (LRU), then p2's tail block, never the locked p0
    admission = kv.admit(s(11), [7] * 16, None)
    assert admission is not None and admission.num_cached_tokens == 0
    assert [node.token_ids for node in kv.tree.lru_order()] == [(20, 21, 22, 23)]
    assert kv.stats().evicted_blocks == 3
    assert kv.peek_prefix(prompts[0] + [99], None) == 8
    assert kv.peek_prefix(prompts[1] + [99], None) == 0
    assert kv.peek_prefix(prompts[2] + [99], None) == 4
    assert kv.admit(s(12), [8] * 5, None) is None  # 2 blocks: only p2's last one is left
    kv.check_invariants()


def test_large_pools_evict_in_batches_lru_first() -> None:
    kv = KVCacheManager(num_blocks=1024, block_size=4)  # evicts at least 4 blocks at a time
    for i in range(256):
        prompt = [i, i, i, i, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]  # 4 blocks each
        kv.admit(s(i), prompt, None)
        kv.free(s(i), prompt)
    assert kv.num_free_blocks == 0
    kv.admit(s(1000), [9], None)  # needs 1 block: evicts the 4 of the oldest prefix
    assert kv.stats().evicted_blocks == 4
    assert kv.num_free_blocks == 3
    assert kv.peek_prefix([0, 0, 0, 0, 0, 0, 0, 0, 1], None) == 0
    assert kv.peek_prefix([1, 1, 1, 1, 0, 0, 0, 0, 1], None) == 8
    kv.check_invariants()


def test_admit_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.admit(s(0), [1] * 8, None)  # 2 blocks, locked
    kv.admit(s(1), [2] * 5, None)
    kv.free(s(1), [2] * 5)  # 2 cached blocks, evictable
    before = (
        kv.allocator.free_block_ids(),
        [(n.token_ids, n.block_ids, n.stamp, n.lock_count) for n in kv.tree.nodes(None)],
        [n.token_ids for n in kv.tree.lru_order()],
        kv.stats(),
    )
    assert kv.admit(s(2), [3] * 13, None) is None  # needs 4 blocks, only 2 obtainable
    after = (
        kv.allocator.free_block_ids(),
        [(n.token_ids, n.block_ids, n.stamp, n.lock_count) for n in kv.tree.nodes(None)],
        [n.token_ids for n in kv.tree.lru_order()],
        kv.stats(),
    )
    assert after == before
    assert s(2) not in kv
    kv.check_invariants()


def test_grow_is_all_or_nothing_and_evicts_as_needed() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.admit(s(0), [1, 2, 3, 4, 5], None)  # blocks 0 1
    kv.admit(s(1), [9], None)  # block 2
    kv.free(s(1), [9])  # cached partial leaf, evictable
    assert kv.grow(s(0), 3) is NO_GROWTH
    assert kv.grow(s(0), 1) == Growth((BlockId(2),))  # evicts the cached block
    assert kv.stats().evicted_blocks == 1
    assert kv.grow(s(0), 4) is None
    assert kv.num_tokens(s(0)) == 9
    assert kv.block_ids(s(0)) == b(0, 1, 2)
    assert kv.grow(s(0), 0) is NO_GROWTH
    kv.check_invariants()


def test_grow_each_is_grow_in_turn_each_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.admit(s(0), [1, 2, 3], None)  # block 0, one free slot
    kv.admit(s(1), [5, 6, 7, 8], None)  # block 1, full
    kv.fork(s(1), s(2))  # shares block 1
    kv.admit(s(3), [9], None)  # block 2
    assert kv.grow_each([s(0), s(1), s(2), s(3)], 1) == [
        NO_GROWTH,
        Growth((BlockId(3),)),
        Growth((BlockId(4),)),
        NO_GROWTH,
    ]
    assert [kv.num_tokens(s(i)) for i in range(4)] == [4, 5, 5, 2]
    # the pool is full: s(0) needs a block and gets none, s(3) still has room
    assert kv.grow_each([s(0), s(3)], 1) == [None, NO_GROWTH]
    assert [kv.num_tokens(s(0)), kv.num_tokens(s(3))] == [4, 3]
    assert kv.block_ids(s(0)) == b(0)
    with pytest.raises(UnknownSequenceError):
        kv.grow_each([s(3), s(9)], 1)
    assert kv.num_tokens(s(3)) == 3  # none grown
    with pytest.raises(InvalidTokensError):
        kv.grow_each([s(3)], -1)
    assert kv.grow_each([s(3)], 0) == [NO_GROWTH]
    kv.check_invariants()


def test_caching_as_a_sequence_decodes_extends_its_own_leaf(kv: KVCacheManager) -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    kv.admit(s(0), tokens, None)  # blocks 0 1
    kv.cache(s(0), tokens)  # after prefill: block 0
    assert tree_shape(kv) == [(0, (1, 2, 3, 4), b(0), 1)]
    (leaf,) = kv.tree.nodes(None)
    assert kv.tree.lru_order() == []  # locked by s(0), never entered the LRU order
    for token in (7, 8, 9, 10, 11, 12, 13):  # decode; cache each block it fills
        kv.grow(s(0), 1)
        tokens.append(token)
        kv.cache(s(0), tokens)
    assert tree_shape(kv) == [(0, tuple(range(1, 13)), b(0, 1, 2), 1)]  # one node
    assert next(iter(kv.tree.nodes(None))) is leaf
    assert kv.tree.lru_order() == []
    kv.free(s(0), tokens)
    assert tree_shape(kv) == [(0, tuple(range(1, 14)), b(0, 1, 2, 3), 0)]
    assert kv.tree.lru_order() == [leaf]
    kv.check_invariants()


def test_partial_tail_upgrade_through_a_continuing_conversation(kv: KVCacheManager) -> None:
    turn1 = SYSTEM + [1, 2, 3, 4, 5]  # 15 tokens: 3 full blocks + 3-token tail
    kv.admit(s(0), turn1, None)
    kv.free(s(0), turn1)
    assert tree_shape(kv) == [(0, tuple(turn1), b(0, 1, 2, 3), 0)]
    turn2 = turn1 + [6, 7, 8]  # continues the conversation
    admission = kv.admit(s(1), turn2, None)
    assert admission is not None
    assert admission.num_cached_tokens == 15
    assert admission.block_ids == b(0, 1, 2, 4, 5)
    assert admission.block_copies == [(BlockId(3), BlockId(4))]
    kv.check_invariants()
    # after its prefill, turn 2 caches its full blocks: block 4 (fuller) replaces block 3
    assert kv.cache(s(1), turn2) == []
    assert tree_shape(kv) == [
        (0, tuple(SYSTEM + [1, 2]), b(0, 1, 2), 1),
        (12, (3, 4, 5, 6), b(4), 1),
    ]
    assert refcounts(kv, 3) == [0]
    kv.check_invariants()


def test_cache_switches_to_the_tree_copy_of_blocks_computed_twice(kv: KVCacheManager) -> None:
    prompt = SYSTEM + [1, 2, 3]
    kv.admit(s(0), prompt, None)  # blocks 0 1 2 3
    kv.admit(s(1), prompt, None)  # nothing cached yet: blocks 4 5 6 7
    assert kv.cache(s(0), prompt) == []
    replaced = kv.cache(s(1), prompt)
    assert replaced == [(0, BlockId(0)), (1, BlockId(1)), (2, BlockId(2))]
    assert kv.block_ids(s(1)) == b(0, 1, 2, 7)
    assert refcounts(kv, 0, 1, 2, 4, 5, 6) == [3, 3, 3, 0, 0, 0]
    kv.check_invariants()


def test_free_releases_tail_first_and_caches_the_partial_tail(kv: KVCacheManager) -> None:
    kv.admit(s(0), [1, 2, 3, 4, 5, 6, 7, 8, 9], None)  # blocks 0 1 2
    kv.free(s(0))
    assert kv.allocator.free_block_ids()[:3] == b(0, 1, 2)  # pushed 2, 1, 0: popped 0, 1, 2
    kv.admit(s(1), [1, 2, 3, 4, 5, 6, 7, 8, 9], None)
    kv.free(s(1), [1, 2, 3, 4, 5, 6, 7])
    assert tree_shape(kv) == [(0, (1, 2, 3, 4, 5, 6, 7), b(0, 1), 0)]
    assert kv.allocator.free_block_ids()[0] == 2
    kv.check_invariants()


def test_a_relative_locks_the_blocks_its_forked_sibling_caches(kv: KVCacheManager) -> None:
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6]  # 16 tokens
    kv.admit(s(0), prompt, None)
    kv.fork(s(0), s(1))
    kv.cache(s(0), prompt)  # the tree takes blocks the child shares
    kv.check_invariants()
    kv.free(s(0))
    kv.check_invariants()
    assert kv.reset_prefix_cache() == 0  # the child still uses (and locks) them
    assert kv.block_ids(s(1)) == b(0, 1, 2, 3)
    kv.free(s(1))
    assert kv.reset_prefix_cache() == 4
    assert kv.num_free_blocks == 16
    kv.check_invariants()


def test_a_relative_holding_a_partial_leaf_keeps_it_locked_when_a_sibling_dedupes() -> None:
    """Found by the stateful test: a forked sequence whose block the tree also holds in a
    fuller copy must not hang the blocks it shares with a relative below that copy while the
    relative reads its own, cached (partial leaf) copy: one lock cannot cover both."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [1, 1, 1, 1, 2, 2, 2, 2, 3]
    kv.admit(s(0), prompt, None)  # blocks 0 1 2
    kv.fork(s(0), s(1))
    kv.fork(s(0), s(2))
    kv.free(s(0), prompt[:6])  # caches [1 1 1 1 | 2 2]: block 1 partially
    assert tree_shape(kv) == [(0, (1, 1, 1, 1, 2, 2), b(0, 1), 2)]
    other = [1, 1, 1, 1, 2, 2, 2, 2, 7]
    admission = kv.admit(s(3), other, None)  # copies block 1 into 3
    assert admission is not None and admission.block_ids == b(0, 3, 4)
    kv.cache(s(3), other)  # splits off the partial leaf [2 2], next to the fuller [2 2 2 2]
    kv.free(s(3))
    assert tree_shape(kv) == [
        (0, (1, 1, 1, 1), b(0), 2),
        (4, (2, 2), b(1), 2),
        (4, (2, 2, 2, 2), b(3), 0),
    ]
    kv.free(s(2), prompt)  # its block 1 duplicates block 3; block 2 stays out of the tree
    assert tree_shape(kv) == [
        (0, (1, 1, 1, 1), b(0), 1),
        (4, (2, 2), b(1), 1),
        (4, (2, 2, 2, 2), b(3), 0),
    ]
    assert refcounts(kv, 0, 1, 2, 3) == [2, 2, 1, 1]  # s(1)'s own 1 and 2, the tree's 0 1 3
    kv.check_invariants()
    assert kv.reset_prefix_cache() == 1  # block 3; s(1)'s locked path stays
    kv.free(s(1), prompt)
    assert tree_shape(kv) == [
        (0, (1, 1, 1, 1), b(0), 0),
        (4, (2, 2, 2, 2, 3), b(1, 2), 0),
    ]
    kv.check_invariants()


def test_caching_keeps_a_lock_a_relative_moved_deeper() -> None:
    """Found by the stateful test: a sequence whose relative cached their shared blocks holds
    its lock below its own cached blocks; caching them must not move it back up."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [1, 1, 0, 1, 2, 1, 0]
    kv.admit(s(0), prompt, None)  # blocks 0 1
    kv.admit(s(1), prompt, None)  # blocks 2 3: computed twice, nothing cached yet
    kv.fork(s(0), s(2))
    kv.fork(s(1), s(3))
    kv.free(s(1), prompt[:4])  # caches [1 1 0 1] in block 2, which s(3) locks
    kv.free(s(0), prompt)  # block 0 duplicates block 2; the tree takes block 1 ...
    assert tree_shape(kv) == [(0, (1, 1, 0, 1), b(2), 2), (4, (2, 1, 0), b(1), 1)]
    assert kv.block_ids(s(2)) == b(0, 1)  # ... which s(2) shares: its lock moved below
    kv.cache(s(2), prompt)  # switches to the tree's block 2
    assert kv.block_ids(s(2)) == b(2, 1)
    assert tree_shape(kv) == [(0, (1, 1, 0, 1), b(2), 2), (4, (2, 1, 0), b(1), 1)]
    kv.check_invariants()
    kv.free(s(3))
    assert kv.reset_prefix_cache() == 0  # s(2) still reads both
    kv.free(s(2), prompt)
    assert kv.reset_prefix_cache() == 2
    kv.check_invariants()


def test_stats_count_blocks_once_and_waste_per_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.admit(s(0), [1, 2, 3, 4, 5], None)  # 2 blocks, 5 tokens
    kv.fork(s(0), s(1))
    kv.grow(s(1), 2)  # copies block 1: 7 tokens
    stats = kv.stats()
    assert stats == KVCacheStats(
        num_blocks=8,
        num_free_blocks=5,
        num_cached_blocks=0,
        num_referenced_blocks=3,
        hit_tokens=0,
        queried_tokens=4,
        allocated_slots=12,
        live_tokens=4 + 1 + 3,
        kv_waste_tokens=4,
        evicted_blocks=0,
    )
    assert stats.hit_rate == 0.0


def test_prefix_caching_off_never_matches_or_inserts() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    kv.admit(s(0), [1, 2, 3, 4, 5], None)
    assert kv.cache(s(0), [1, 2, 3, 4, 5]) == []
    kv.free(s(0), [1, 2, 3, 4, 5])
    assert kv.tree.num_blocks == 0 and kv.num_free_blocks == 8
    assert kv.admit(s(1), [1, 2, 3, 4, 5], None) == Admission(0, b(0, 1), [])
    assert kv.peek_prefix([1, 2, 3, 4, 5], None) == 0
    kv.check_invariants()


def test_misuse_raises_typed_errors(kv: KVCacheManager) -> None:
    kv.admit(s(0), [1, 2, 3], None)
    with pytest.raises(SequenceExistsError):
        kv.admit(s(0), [1], None)
    with pytest.raises(SequenceExistsError):
        kv.fork(s(0), s(0))
    with pytest.raises(InvalidTokensError):
        kv.admit(s(1), [], None)
    with pytest.raises(InvalidTokensError):
        kv.cache(s(0), [1, 2, 3, 4])
    with pytest.raises(InvalidTokensError):
        kv.free(s(0), [1, 2, 3, 4])
    with pytest.raises(InvalidTokensError):
        kv.grow(s(0), -1)
    kv.grow(s(0), 2)
    with pytest.raises(InvalidTokensError, match="pass the sequence's own tokens"):
        kv.cache(s(0), [1, 2, 7, 8, 9])
    for call in (
        lambda: kv.grow(s(9), 1),
        lambda: kv.free(s(9)),
        lambda: kv.fork(s(9), s(10)),
        lambda: kv.cache(s(9), [1]),
        lambda: kv.block_ids(s(9)),
        lambda: kv.num_tokens(s(9)),
    ):
        with pytest.raises(UnknownSequenceError):
            call()
    kv.check_invariants()


def test_peek_prefix_mutates_nothing(kv: KVCacheManager) -> None:
    kv.admit(s(0), SYSTEM + [1, 2, 3], None)
    kv.free(s(0), SYSTEM + [1, 2, 3])
    kv.admit(s(1), [5, 5, 5, 5, 5], None)
    kv.free(s(1), [5, 5, 5, 5, 5])
    order = [node.token_ids for node in kv.tree.lru_order()]
    assert kv.peek_prefix(SYSTEM + [1, 2, 3, 4], None) == 13
    assert [node.token_ids for node in kv.tree.lru_order()] == order
    assert kv.stats().queried_tokens == 12 + 4
