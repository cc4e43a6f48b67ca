"""The executable invariants of the sharing core, checked across allocator, tree and tables."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from radixkv.kvcache.ids import BlockId, SeqId
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.sequence_blocks import SequenceBlocks

if TYPE_CHECKING:
    from radixkv.kvcache.manager import KVCacheManager


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
