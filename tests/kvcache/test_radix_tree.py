"""RadixTree: matching, insertion, splitting, salts, locks and LRU eviction, pinned exactly."""

from __future__ import annotations

import random

import pytest

from radixkv.kvcache import (
    BlockAllocator,
    BlockId,
    InvalidTokensError,
    RadixNode,
    RadixTree,
    Salt,
)
from radixkv.kvcache.token_key import encode_tokens


def b(*ids: int) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def make(num_blocks: int = 16, block_size: int = 4) -> tuple[BlockAllocator, RadixTree]:
    allocator = BlockAllocator(num_blocks)
    return allocator, RadixTree(allocator, block_size)


def cache(
    allocator: BlockAllocator, tree: RadixTree, tokens: list[int], salt: Salt = None
) -> list[BlockId]:
    """What a finishing sequence does: fresh blocks, insert, drop its own references."""
    num_blocks = -(-len(tokens) // tree.block_size)
    block_ids = allocator.allocate(num_blocks)
    assert block_ids is not None
    tree.insert(tokens, block_ids, salt)
    allocator.decref_all(block_ids)
    return block_ids


def shape(tree: RadixTree, salt: Salt = None) -> list[tuple[int, tuple[int, ...], list[BlockId]]]:
    return [(node.start, node.token_ids, node.block_ids) for node in tree.nodes(salt)]


def test_match_returns_full_blocks_and_the_partially_matched_block() -> None:
    allocator, tree = make()
    cache(allocator, tree, list(range(1, 11)))  # 10 tokens: blocks 0, 1, 2 (2 tokens)
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 99], None)
    assert match.block_ids == b(0)
    assert (match.partial_block_id, match.num_partial_tokens, match.num_tokens) == (1, 3, 7)
    assert match.num_node_blocks == 2
    assert match.node is not None and match.node.block_ids == b(0, 1, 2)
    tree.check_invariants()


def test_match_of_a_partial_leaf_to_its_end_copies_its_last_block() -> None:
    allocator, tree = make()
    cache(allocator, tree, list(range(1, 11)))
    match = tree.match_prefix(list(range(1, 20)), None)
    assert match.block_ids == b(0, 1)
    assert (match.partial_block_id, match.num_partial_tokens, match.num_tokens) == (2, 2, 10)


def test_match_respects_max_tokens_and_unknown_salts() -> None:
    allocator, tree = make()
    cache(allocator, tree, list(range(1, 9)))
    assert tree.match_prefix(list(range(1, 9)), None, max_tokens=7).num_tokens == 7
    assert tree.match_prefix(list(range(1, 9)), None, max_tokens=4).block_ids == b(0)
    assert tree.match_prefix(list(range(1, 9)), None, max_tokens=4).partial_block_id is None
    assert tree.match_prefix(list(range(1, 9)), "tenant").num_tokens == 0
    assert tree.match_prefix([], None).node is None


def test_insert_dedupes_and_splits_at_the_block_boundary_before_divergence() -> None:
    allocator, tree = make()
    first = allocator.allocate(3)
    assert first == b(0, 1, 2)
    tree.insert(list(range(1, 13)), first, None)
    second = allocator.allocate(3)
    assert second == b(3, 4, 5)
    # same first 8 tokens, diverging inside the second block
    result = tree.insert([1, 2, 3, 4, 5, 6, 70, 80, 9, 10, 11, 12], second, None)
    assert result.duplicates == [(0, BlockId(0))]
    assert (result.num_blocks, result.num_new_blocks) == (3, 2)
    assert result.node is not None and result.node.block_ids == b(4, 5)
    assert shape(tree) == [
        (0, (1, 2, 3, 4), b(0)),
        (4, (5, 6, 7, 8, 9, 10, 11, 12), b(1, 2)),
        (4, (5, 6, 70, 80, 9, 10, 11, 12), b(4, 5)),
    ]
    # the tree holds one reference on each block it took, none on the duplicate 3
    assert [allocator.refcount(BlockId(i)) for i in range(6)] == [2, 2, 2, 1, 2, 2]
    tree.check_invariants()


def test_insert_of_tokens_already_cached_in_the_same_blocks_changes_nothing() -> None:
    allocator, tree = make()
    blocks = allocator.allocate(2)
    assert blocks is not None
    tree.insert(list(range(8)), blocks, None)
    result = tree.insert(list(range(8)), blocks, None)
    assert result.duplicates == [] and result.num_new_blocks == 0 and result.num_blocks == 2
    assert allocator.refcount(BlockId(0)) == 2
    assert tree.num_blocks == 2


def test_insert_needs_one_block_per_block_size_tokens() -> None:
    allocator, tree = make()
    with pytest.raises(InvalidTokensError):
        tree.insert(list(range(5)), b(0), None)


def test_salts_are_namespaces() -> None:
    allocator, tree = make()
    cache(allocator, tree, [1, 2, 3, 4, 5], salt="alice")
    assert tree.match_prefix([1, 2, 3, 4, 5, 6], "bob").num_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4, 5, 6], None).num_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4, 5, 6], "alice").num_tokens == 5
    blocks = allocator.allocate(2)
    assert blocks == b(2, 3)
    result = tree.insert([1, 2, 3, 4, 5], blocks, "bob")
    assert result.duplicates == []  # alice's blocks are not bob's
    assert shape(tree, "bob") == [(0, (1, 2, 3, 4, 5), b(2, 3))]
    assert shape(tree, "alice") == [(0, (1, 2, 3, 4, 5), b(0, 1))]
    tree.check_invariants()


def test_partial_tail_upgrade_replaces_the_leaf_and_frees_its_block() -> None:
    allocator, tree = make()
    cache(allocator, tree, [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (partial: 5 6)
    allocator.incref(BlockId(0))  # the caller shares the tree's first block
    (tail,) = allocator.allocate(1) or []
    assert tail == 2
    result = tree.insert([1, 2, 3, 4, 5, 6, 7], [BlockId(0), tail], None)
    allocator.decref_all([BlockId(0), tail])  # the caller is done with them
    assert result.duplicates == [] and result.num_new_blocks == 1
    assert shape(tree) == [(0, (1, 2, 3, 4), b(0)), (4, (5, 6, 7), b(2))]
    assert allocator.refcount(BlockId(1)) == 0  # the superseded partial block is free
    assert allocator.free_block_ids()[0] == 1
    # a full block agreeing on 5 6 7 supersedes it in turn
    allocator.incref(BlockId(0))
    (full,) = allocator.allocate(1) or []
    assert full == 1
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [BlockId(0), full], None)
    assert shape(tree) == [(0, (1, 2, 3, 4), b(0)), (4, (5, 6, 7, 8), b(1))]
    assert allocator.refcount(BlockId(2)) == 0
    tree.check_invariants()


def test_partial_tail_already_held_by_a_fuller_block_is_not_taken() -> None:
    allocator, tree = make()
    cache(allocator, tree, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0, 1
    allocator.incref(BlockId(0))
    (tail,) = allocator.allocate(1) or []
    result = tree.insert([1, 2, 3, 4, 5, 6], [BlockId(0), tail], None)
    assert (result.num_blocks, result.num_new_blocks, result.duplicates) == (1, 0, [])
    assert allocator.refcount(tail) == 1
    assert shape(tree) == [(0, (1, 2, 3, 4, 5, 6, 7, 8), b(0, 1))]


def test_a_locked_partial_leaf_is_kept_next_to_its_fuller_sibling() -> None:
    allocator, tree = make()
    cache(allocator, tree, [1, 2, 3, 4, 5, 6])
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 9], None)
    assert match.node is not None and match.partial_block_id == 1
    locked = tree.lock_prefix(match.node, match.num_node_blocks)
    allocator.incref(BlockId(0))
    (tail,) = allocator.allocate(1) or []
    tree.insert([1, 2, 3, 4, 5, 6, 7], [BlockId(0), tail], None)
    assert shape(tree) == [(0, (1, 2, 3, 4), b(0)), (4, (5, 6), b(1)), (4, (5, 6, 7), b(2))]
    # matching prefers the fuller sibling
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 0], None).partial_block_id == 2
    tree.unlock(locked)
    tree.check_invariants()


def test_the_child_sharing_the_longest_prefix_is_found_among_many() -> None:
    allocator, tree = make(num_blocks=4000, block_size=8)
    rng = random.Random(7)
    prefix = list(range(100, 108))
    firsts = []
    for _ in range(300):
        first = [rng.randrange(4) for _ in range(8)]
        if first in firsts:
            continue
        firsts.append(first)
        cache(allocator, tree, prefix + first + [rng.randrange(50) for _ in range(9)])
    root = tree.root(None)
    assert root is not None
    (system,) = root.children.values()
    assert len(system.children) == len(firsts)
    for _ in range(200):
        query = [rng.randrange(4) for _ in range(8)]
        best = max(_common(query, first) for first in firsts)
        match = tree.match_prefix(prefix + query + [0], None)
        assert match.num_tokens == 8 + best
        if best == 8:
            assert match.partial_block_id is None or match.num_tokens > 16
        elif best:
            assert match.node is not None
            assert _common(query, list(match.node.token_ids[:8])) == best
    tree.check_invariants()


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def lru_tokens(tree: RadixTree) -> list[tuple[int, ...]]:
    return [node.token_ids for node in tree.lru_order()]


def _node(tree: RadixTree, tokens: tuple[int, ...], salt: Salt = None) -> RadixNode:
    (node,) = [node for node in tree.nodes(salt) if node.token_ids == tokens]
    return node


def test_evict_frees_unlocked_leaves_lru_first_and_cascades() -> None:
    allocator, tree = make(num_blocks=8, block_size=2)
    cache(allocator, tree, [1, 2, 3, 4])  # b0 b1
    cache(allocator, tree, [1, 2, 5, 6])  # b1 is... the tree holds 0,1; this takes a new one
    cache(allocator, tree, [7, 8])
    assert shape(tree) == [
        (0, (1, 2), b(0)),
        (2, (3, 4), b(1)),
        (2, (5, 6), b(3)),
        (0, (7, 8), b(2)),
    ]
    assert lru_tokens(tree) == [(3, 4), (5, 6), (7, 8)]
    tree.lock(_node(tree, (5, 6)))  # locks [5 6] and [1 2]
    assert tree.num_evictable_blocks == 2
    assert tree.evict(3) == 2  # [3 4] then [7 8]; the locked path stays
    assert allocator.free_block_ids()[:2] == b(2, 1)
    assert shape(tree) == [(0, (1, 2), b(0)), (2, (5, 6), b(3))]
    assert tree.evict(1) == 0
    tree.unlock(_node(tree, (5, 6)))
    assert lru_tokens(tree) == [(5, 6)]
    assert tree.evict(1) == 1  # [5 6]; its parent is now an unlocked leaf
    assert lru_tokens(tree) == [(1, 2)]
    assert tree.evict(5) == 1
    assert tree.num_blocks == 0 and tree.num_evicted_blocks == 4
    allocator.check_invariants([0] * 8)
    tree.check_invariants()


def test_evict_takes_a_leaf_tail_first_and_keeps_its_head() -> None:
    allocator, tree = make(num_blocks=8, block_size=2)
    cache(allocator, tree, [1, 2, 3, 4, 5, 6, 7])  # b0 b1 b2 b3(partial)
    assert tree.evict(2) == 2
    assert shape(tree) == [(0, (1, 2, 3, 4), b(0, 1))]
    assert allocator.free_block_ids()[:2] == b(2, 3)  # the tail block was freed first
    tree.check_invariants()


def test_lock_prefix_splits_so_the_unused_tail_stays_evictable() -> None:
    allocator, tree = make(num_blocks=8, block_size=2)
    cache(allocator, tree, [1, 2, 3, 4, 5, 6])  # b0 b1 b2
    match = tree.match_prefix([1, 2, 3, 9], None)
    assert match.block_ids == b(0) and match.partial_block_id == 1
    assert tree.num_blocks_protected_by_lock(match.node, match.num_node_blocks) == 2
    assert match.node is not None
    locked = tree.lock_prefix(match.node, match.num_node_blocks)
    assert locked.token_ids == (1, 2, 3, 4) and locked.lock_count == 1
    assert shape(tree) == [(0, (1, 2, 3, 4), b(0, 1)), (4, (5, 6), b(2))]
    assert tree.evict(8) == 1
    tree.unlock(locked)
    tree.check_invariants()


def test_unlock_stamps_the_path_deepest_first_and_match_changes_nothing() -> None:
    allocator, tree = make(num_blocks=8, block_size=2)
    cache(allocator, tree, [1, 2, 3, 4])
    cache(allocator, tree, [5, 6])
    before = [(node.token_ids, node.stamp) for node in tree.nodes(None)]
    tree.match_prefix([1, 2, 3, 4, 9], None)
    assert [(node.token_ids, node.stamp) for node in tree.nodes(None)] == before
    assert lru_tokens(tree) == [(1, 2, 3, 4), (5, 6)]
    node = _node(tree, (1, 2, 3, 4))
    tree.lock(node)
    tree.unlock(node)  # just used: now the most recent
    assert lru_tokens(tree) == [(5, 6), (1, 2, 3, 4)]
    other = _node(tree, (5, 6))
    tree.lock(other)
    tree.unlock(other, touch=False)  # locked without use: keeps its place
    assert lru_tokens(tree) == [(5, 6), (1, 2, 3, 4)]


def test_insert_key_resumes_below_a_node_with_only_what_follows_it() -> None:
    allocator, tree = make(num_blocks=8, block_size=2)
    cache(allocator, tree, [1, 2, 3, 4])
    node = _node(tree, (1, 2, 3, 4))
    tree.lock(node)  # a live sequence uses it: the new tokens hang below it
    (tail,) = allocator.allocate(1) or []
    result = tree.insert_key(encode_tokens([5, 6]), [tail], None, start=node)
    assert (result.num_blocks, result.num_new_blocks) == (3, 1)  # counted from block 0
    assert result.node is not None and result.node.parent is node
    assert (result.node.start, result.node.token_ids, result.node.block_ids) == (4, (5, 6), [2])
    assert lru_tokens(tree) == [(5, 6)]
    tree.check_invariants()


def test_insert_extends_an_unlocked_leaf_in_place_and_stamps_it_as_just_used() -> None:
    allocator, tree = make(num_blocks=8, block_size=2)
    cache(allocator, tree, [1, 2, 3, 4])  # b0 b1
    cache(allocator, tree, [7, 8])  # b2, more recent
    leaf = _node(tree, (1, 2, 3, 4))
    assert lru_tokens(tree) == [(1, 2, 3, 4), (7, 8)]
    extended = cache(allocator, tree, [1, 2, 3, 4, 5, 6, 9])  # b6 partial
    assert extended == b(3, 4, 5, 6)
    assert shape(tree) == [(0, (1, 2, 3, 4, 5, 6, 9), b(0, 1, 5, 6)), (0, (7, 8), b(2))]
    assert _node(tree, (1, 2, 3, 4, 5, 6, 9)) is leaf  # no new node
    assert lru_tokens(tree) == [(7, 8), (1, 2, 3, 4, 5, 6, 9)]
    assert sorted(allocator.free_block_ids()[:3]) == b(3, 4, 7)  # b3 b4 were duplicates
    assert tree.num_blocks == tree.num_evictable_blocks == 5
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 9, 10], None)
    assert (match.block_ids, match.partial_block_id, match.num_tokens) == (b(0, 1, 5), 6, 7)
    assert tree.evict(2) == 2  # [7 8] first, then the extended leaf's tail
    assert shape(tree) == [(0, (1, 2, 3, 4, 5, 6), b(0, 1, 5))]
    tree.check_invariants()
    allocator.check_invariants([1 if i in (0, 1, 5) else 0 for i in range(8)])
