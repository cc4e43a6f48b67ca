"""What inserting a sequence's tokens into the radix tree did with its blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from radixkv.kvcache.ids import BlockId
from radixkv.kvcache.radix_node import RadixNode


class InsertResult(NamedTuple):
    """What `insert` did with a caller's blocks.

    `node` is the deepest node holding the caller's tokens (lock it), None when none are held.
    The tree now holds the caller's first `num_blocks` blocks on the path to `node`: its own
    ids, except `duplicates` (logical index, tree block id) where the tree already held the
    same tokens in another block; the last `num_new_blocks` of them are the caller's blocks
    that the tree took (one incref each), all in `node`.
    """

    node: RadixNode | None
    num_blocks: int
    num_new_blocks: int
    duplicates: list[tuple[int, BlockId]]


def note_duplicates(
    tree_block_ids: list[BlockId],
    block_ids: Sequence[BlockId],
    first: int,
    base_block: int,
    duplicates: list[tuple[int, BlockId]],
) -> None:
    """Append to `duplicates` each (logical index, tree block) where the tree holds the
    caller's blocks `first`.. (counted from `base_block`) in other blocks than its own."""
    ours = list(block_ids[first : first + len(tree_block_ids)])
    if ours == tree_block_ids:
        return
    for offset, tree_block_id in enumerate(tree_block_ids):
        if ours[offset] != tree_block_id:
            duplicates.append((base_block + first + offset, tree_block_id))
