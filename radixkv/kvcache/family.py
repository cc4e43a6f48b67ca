"""Forked sequences that share blocks: growing one, and what caching one's blocks means for
the others (its relatives)."""

from __future__ import annotations

from collections.abc import Callable

from radixkv.kvcache.block_allocator import BlockAllocator
from radixkv.kvcache.growth import NO_GROWTH, Growth
from radixkv.kvcache.ids import BlockCopy, BlockId, SeqId
from radixkv.kvcache.insert_result import InsertResult
from radixkv.kvcache.radix_tree import RadixTree
from radixkv.kvcache.sequence_blocks import SequenceBlocks
from radixkv.kvcache.token_key import TokenKey


def grow_forked(
    seq: SequenceBlocks,
    new_len: int,
    num_new: int,
    block_size: int,
    allocator: BlockAllocator,
    evict_for: Callable[[int], bool],
) -> Growth | None:
    """Grow a sequence that may share blocks from its write frontier on (after a fork) to
    `new_len` tokens with `num_new` more blocks: each shared block it will write into is
    first replaced by a private copy. `evict_for(n)` makes n blocks free or returns False;
    None and no change when it cannot."""
    bs = block_size
    table = seq.block_ids
    length = seq.num_tokens
    refcount = allocator.refcount
    to_copy = [i for i in range(length // bs, len(table)) if refcount(table[i]) > 1]
    if len(to_copy) + num_new > allocator.num_free_blocks and not evict_for(
        len(to_copy) + num_new
    ):
        return None
    replaced: list[tuple[int, BlockId]] = []
    copies: list[BlockCopy] = []
    for index in to_copy:
        written = allocator.copy_on_write(table[index])
        assert written is not None
        fresh, copy = written
        assert copy is not None
        table[index] = fresh
        replaced.append((index, fresh))
        if index * bs < length:  # a block it has written nothing into needs no copy
            copies.append(copy)
    new = allocator.allocate(num_new)
    assert new is not None
    table.extend(new)
    seq.num_tokens = new_len
    seq.writable_len = len(table) * bs
    if not new and not replaced:
        return NO_GROWTH
    return Growth(tuple(new), tuple(replaced), tuple(copies))


def insertable_len(
    tree: RadixTree,
    seqs: dict[SeqId, SequenceBlocks],
    seq: SequenceBlocks,
    key: TokenKey,
    num_tokens: int,
    block_size: int,
) -> int:
    """How many of a forked sequence's first `num_tokens` tokens (packed from the first in
    `key`) it may insert: all of them, or only the full blocks the tree already holds.

    Where the tree holds some of those full blocks' tokens in other blocks (computed twice),
    inserting switches the sequence to the tree's copies, but a relative keeps its own. If a
    relative's own copy is itself a tree block (on another branch, e.g. a partial leaf) and
    it shares the blocks that follow, hanging those below the tree's path would leave it
    holding tree blocks on two branches, which its one lock cannot both cover (evicting the
    other branch would free a block it still reads).
    """
    bs = block_size
    tree_blocks = tree.match_key(key, seq.salt, num_tokens).block_ids
    num_held = len(tree_blocks)
    table = seq.block_ids
    if num_held * bs >= num_tokens or table[:num_held] == tree_blocks:
        return num_tokens
    taken = table[num_held : -(-num_tokens // bs)]
    assert seq.family is not None
    for relative_id in seq.family:
        relative = seqs[relative_id]
        if relative is seq or relative.lock_node is None:
            continue
        theirs = relative.block_ids
        if not any(a == b for a, b in zip(theirs[num_held:], taken, strict=False)):
            continue
        # the tree blocks it holds lie on its lock path, at their index in its table
        on_path = [block for node in relative.lock_node.path() for block in node.block_ids]
        for index, block in enumerate(theirs[: min(num_held, len(on_path))]):
            if block == on_path[index] and block != tree_blocks[index]:
                return num_held * bs
    return num_tokens


def relock_relatives(
    tree: RadixTree,
    seqs: dict[SeqId, SequenceBlocks],
    seq_id: SeqId,
    seq: SequenceBlocks,
    result: InsertResult,
    block_size: int,
) -> None:
    """The tree just took blocks of `seq` (`result`) that its forked relatives may share:
    move each such relative's lock down to the node holding them, so its tree blocks stay
    locked. (`seq_id` may already be gone from `seqs`.)"""
    node = result.node
    assert node is not None and seq.family is not None
    first = result.num_blocks - result.num_new_blocks
    taken = seq.block_ids[first : result.num_blocks]
    for relative_id in sorted(seq.family):
        if relative_id == seq_id:
            continue
        relative = seqs[relative_id]
        theirs = relative.block_ids[first : result.num_blocks]
        if not any(a == b for a, b in zip(theirs, taken, strict=False)):
            continue
        old = relative.lock_node
        if old is not None and old.is_below(node):
            continue
        tree.lock(node)
        if old is not None:
            tree.unlock(old, relative.uses_lock_node(block_size))
        relative.lock_node = node
