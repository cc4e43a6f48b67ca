"""What matching a query against the radix tree found."""

from __future__ import annotations

from typing import NamedTuple

from radixkv.kvcache.ids import BlockId
from radixkv.kvcache.radix_node import RadixNode


class PrefixMatch(NamedTuple):
    """The longest cached prefix of a query, token-granular.

        query       | q0 .. q15 | q16 .. q31 | q32 q33 q34 x ...
        tree        | b7        | b2         | b9: q32 q33 q34 y ...
        match       block_ids=[b7, b2], partial_block_id=b9, num_partial_tokens=3

    The caller shares `block_ids` as they are and copies `partial_block_id` into a fresh block
    (copy-on-write), then computes from token `num_tokens` on. `node` is the deepest node whose
    blocks the match uses (the partial block's node included) and `num_node_blocks` how many
    of its leading blocks it uses: `lock_prefix(node, num_node_blocks)` while they are in use.
    """

    block_ids: list[BlockId]
    partial_block_id: BlockId | None
    num_partial_tokens: int
    num_tokens: int
    node: RadixNode | None
    num_node_blocks: int
