"""What matching a query against the radix tree found."""

from __future__ import annotations

from typing import NamedTuple

from radixkv.kvcache.ids import BlockId
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.token_key import TOKEN_BYTES, TokenKey, common_prefix_tokens, num_equal_blocks


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


NO_MATCH = PrefixMatch([], None, 0, 0, None, 0)


def longest_prefix(root: RadixNode, key: TokenKey, n: int, block_bytes: int) -> PrefixMatch:
    """The longest prefix of `key[:n]` (bytes, n > 0) held below `root`. Mutates nothing.

    Follows children whose tokens the key starts with; where it stops inside a node, or at a
    node none of whose children's first block equals the key's next block, the block sharing
    the most leading tokens with the key is the partial (copy-on-write) block.
    """
    bb = block_bytes
    node = root
    block_ids: list[BlockId] = []
    deepest: RadixNode | None = None
    pos = 0  # bytes
    while pos < n:
        if not node.children:
            break
        end = pos + bb
        if end <= n:
            query = key[pos:end]
            child = node.children.get(query)
        else:
            query = key[pos:n]
            child = None
        if child is None:
            child, num_common = node.child_sharing_longest_prefix(query)
            if num_common:
                return PrefixMatch(
                    block_ids, child.block_ids[0], num_common,
                    pos // TOKEN_BYTES + num_common, child, 1,
                )
            break
        child_tokens = child.tokens
        child_len = len(child_tokens)
        if pos + child_len <= n and key.startswith(child_tokens, pos):
            num_full = child_len // bb
            if num_full * bb == child_len:
                block_ids.extend(child.block_ids)
                node = deepest = child
                pos += child_len
                continue
            # a partial leaf matches to its end: its last block can only be copied
            block_ids.extend(child.block_ids[:num_full])
            return PrefixMatch(
                block_ids, child.block_ids[num_full], (child_len - num_full * bb)
                // TOKEN_BYTES, (pos + child_len) // TOKEN_BYTES, child, num_full + 1,
            )
        # the match ends inside `child`
        num_equal = num_equal_blocks(key, pos, n, child_tokens, bb)
        block_ids.extend(child.block_ids[:num_equal])
        offset = num_equal * bb
        pos += offset
        num_common = common_prefix_tokens(
            key[pos : min(n, pos + bb)], child_tokens[offset : offset + bb]
        )
        if num_common:
            return PrefixMatch(
                block_ids, child.block_ids[num_equal], num_common,
                pos // TOKEN_BYTES + num_common, child, num_equal + 1,
            )
        return PrefixMatch(block_ids, None, 0, pos // TOKEN_BYTES, child, num_equal)
    num_node_blocks = len(deepest.block_ids) if deepest is not None else 0
    return PrefixMatch(block_ids, None, 0, pos // TOKEN_BYTES, deepest, num_node_blocks)
