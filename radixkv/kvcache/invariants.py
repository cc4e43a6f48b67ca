"""The executable invariants of the sharing core, checked across allocator, tree and tables."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from radixkv.kvcache.ids import BlockId, SeqId
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.sequence_blocks import SequenceBlocks
from radixkv.kvcache.token_key import TOKEN_BYTES

if TYPE_CHECKING:
    from radixkv.kvcache.manager import KVCacheManager
    from radixkv.kvcache.radix_tree import RadixTree


def check_manager_invariants(
    manager: KVCacheManager, seqs: dict[SeqId, SequenceBlocks]
) -> None:
    """See `KVCacheManager.check_invariants`. O(tree size + total table length)."""
    allocator, tree, bs = manager.allocator, manager.tree, manager.block_size
    tree.check_invariants()
    if not manager.enable_prefix_caching:
        assert tree.num_blocks == 0, "prefix caching is off but the tree holds blocks"

    holders = [0] * manager.num_blocks
    tree_blocks: dict[BlockId, RadixNode] = {}
    for salt in tree.salts():
        for node in tree.nodes(salt):
            for block_id in node.block_ids:
                tree_blocks[block_id] = node
                holders[block_id] += 1

    direct_locks: Counter[int] = Counter()
    referenced: set[BlockId] = set()
    for seq_id, seq in seqs.items():
        where = f"sequence {seq_id}"
        table = seq.block_ids
        assert seq.num_tokens >= 1, f"{where}: no tokens"
        assert len(table) == -(-seq.num_tokens // bs), (
            f"{where}: {len(table)} blocks for {seq.num_tokens} tokens"
        )
        assert seq.num_tokens <= seq.writable_len <= len(table) * bs, f"{where}: writable_len"
        assert len(set(table)) == len(table), f"{where}: a block twice in its table"
        for block_id in table[seq.num_cached_blocks :]:  # the rest is held through its lock
            holders[block_id] += 1
        referenced.update(table)
        if seq.family is not None:
            assert seq_id in seq.family and len(seq.family) > 1, f"{where}: family"
            assert all(member in seqs for member in seq.family), f"{where}: dead relative"
        lock_node = seq.lock_node
        if lock_node is None:
            assert not any(b in tree_blocks for b in table), f"{where}: uses unlocked tree blocks"
            continue
        direct_locks[id(lock_node)] += 1
        path = lock_node.path()
        assert path and tree.root(seq.salt) is path[0].parent, (
            f"{where}: lock node is not in the tree of salt {seq.salt!r}"
        )
        path_blocks = [block_id for step in path for block_id in step.block_ids]
        for index, block_id in enumerate(table):
            if block_id in tree_blocks:
                assert index < len(path_blocks) and path_blocks[index] == block_id, (
                    f"{where}: tree block {block_id} at index {index} is not on its lock path"
                )
        assert table[: seq.num_cached_blocks] == path_blocks[: seq.num_cached_blocks], (
            f"{where}: its first {seq.num_cached_blocks} blocks are not on its lock path"
        )

    allocator.check_invariants(holders)

    for salt in tree.salts():
        for node in tree.nodes(salt):
            child_locks = sum(child.lock_count for child in node.children.values())
            assert node.lock_count == child_locks + direct_locks[id(node)], (
                f"{node!r}: lock count {node.lock_count}, but {direct_locks[id(node)]} sequences"
                f" lock it and its children hold {child_locks}"
            )
            if node.lock_count == 0:
                for block_id in node.block_ids:
                    assert allocator.refcount(block_id) == 1, (
                        f"{node!r} is unlocked but its block {block_id} is in use"
                    )

    num_free = allocator.num_free_blocks
    num_cached = sum(1 for block_id in tree_blocks if block_id not in referenced)
    assert num_free + num_cached + len(referenced) == manager.num_blocks, (
        f"free {num_free} + cached {num_cached} + referenced {len(referenced)}"
        f" != {manager.num_blocks}"
    )


def check_tree_invariants(tree: RadixTree) -> None:
    """See `RadixTree.check_invariants`. O(tree size)."""
    bs, bb = tree.block_size, tree.block_size * TOKEN_BYTES
    seen: set[BlockId] = set()
    num_blocks = num_evictable = 0
    leaves = set()
    for salt in tree.salts():
        root = tree.root(salt)
        assert root is not None and root.parent is None and not root.tokens and not root.block_ids
        assert root.lock_count == 0, f"root of salt {salt!r} is locked"
        for node in tree.nodes(salt):
            where = f"salt {salt!r} node {node!r}"
            parent = node.parent
            assert parent is not None and parent.children.get(node.key) is node, where
            assert node.tokens and node.key == node.tokens[:bb], f"{where}: bad key"
            assert len(node.tokens) % TOKEN_BYTES == 0, f"{where}: torn token"
            assert node.start == parent.end, f"{where}: starts at {node.start}"
            assert node.start % bs == 0, f"{where}: not at a block boundary"
            num_node_blocks = -(-len(node.tokens) // bb)
            assert len(node.block_ids) == num_node_blocks, f"{where}: tokens vs blocks"
            assert len(node.tokens) % bb == 0 or not node.children, (
                f"{where}: a partial block that is not a leaf's tail"
            )
            for block_id in node.block_ids:
                assert block_id not in seen, f"{where}: block {block_id} held twice"
                assert tree.refcount(block_id) >= 1, f"{where}: block freed"
                seen.add(block_id)
            child_locks = sum(child.lock_count for child in node.children.values())
            assert node.lock_count >= child_locks, f"{where}: fewer locks than children"
            assert node.child_keys == sorted(node.children), f"{where}: child_keys"
            num_partial = sum(1 for key in node.children if len(key) < bb)
            assert node.num_partial_children == num_partial, f"{where}: partial count"
            num_blocks += len(node.block_ids)
            if node.lock_count == 0:
                num_evictable += len(node.block_ids)
                if not node.children:
                    leaves.add(id(node))
            assert node.stamp <= tree.clock, f"{where}: stamp from the future"
    assert num_blocks == tree.num_blocks, f"tree holds {num_blocks}, counted {tree.num_blocks}"
    assert num_evictable == tree.num_evictable_blocks, (
        f"unlocked nodes hold {num_evictable} blocks, counted {tree.num_evictable_blocks}"
    )
    in_lru = {id(node) for node in tree.lru_order()}
    assert in_lru == leaves, "the LRU order is not exactly the unlocked leaves"
    for stamp, node in tree.lru_items():
        assert stamp == node.stamp, f"{node!r} is in the LRU order under stamp {stamp}"
