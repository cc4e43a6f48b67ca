"""The manager's record of one live sequence."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from radixkv.kvcache.errors import InvalidTokensError
from radixkv.kvcache.ids import BlockId, Salt, SeqId
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.token_key import TOKEN_BYTES, TokenKey, encode_tokens


class SequenceBlocks:
    """A live sequence's block table and what it holds in the tree.

    `num_tokens` tokens have slots; the table has exactly ceil(num_tokens / block_size)
    blocks. Growing up to `writable_len` tokens needs neither a new block nor a copy (after a
    fork it is `num_tokens`: the next write may hit a shared block). The sequence holds one
    lock, on `lock_node`, whose path holds every tree block the sequence references; its first
    `num_cached_blocks` blocks are known to be on that path. `key` packs the sequence's
    leading tokens as far as the manager has seen them (the prompt at least): later calls
    pass token ids that extend them, and only the new ones are packed. `family` is the set of
    live sequences that may share blocks with it through forks (None when it never forked).
    """

    __slots__ = (
        "block_ids",
        "num_tokens",
        "writable_len",
        "lock_node",
        "salt",
        "num_cached_blocks",
        "key",
        "family",
    )

    def __init__(
        self,
        block_ids: list[BlockId],
        num_tokens: int,
        writable_len: int,
        lock_node: RadixNode | None,
        salt: Salt,
        num_cached_blocks: int,
        key: TokenKey,
        family: set[SeqId] | None = None,
    ) -> None:
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.writable_len = writable_len
        self.lock_node = lock_node
        self.salt = salt
        self.num_cached_blocks = num_cached_blocks
        self.key = key
        self.family = family

    def check_extends(self, token_ids: Sequence[int]) -> None:
        """A cheap guard that `token_ids` starts with the tokens this sequence has packed (only
        the last of them is compared). Raises InvalidTokensError."""
        num_known = len(self.key) // TOKEN_BYTES
        if num_known:
            last_known = int.from_bytes(self.key[-TOKEN_BYTES:], sys.byteorder)
            if token_ids[num_known - 1] != last_known:
                raise InvalidTokensError(
                    f"token_ids[{num_known - 1}] is {token_ids[num_known - 1]}, but this"
                    f" sequence has token {last_known} there: pass the sequence's own tokens"
                )

    def know(self, token_ids: Sequence[int], num_tokens: int) -> None:
        """Make `key` hold at least the first `num_tokens` of `token_ids`, which extend the
        tokens it holds: only tokens beyond it are packed."""
        num_known = len(self.key) // TOKEN_BYTES
        if num_tokens > num_known:
            self.check_extends(token_ids)
            self.key += encode_tokens(token_ids[num_known:num_tokens])

    def packed(self, token_ids: Sequence[int], start: int, end: int) -> TokenKey:
        """Tokens start..end of `token_ids` (which extend `key`) packed, reusing `key` (not
        extended)."""
        key = self.key
        num_known = len(key) // TOKEN_BYTES
        if end <= num_known:
            return key[start * TOKEN_BYTES : end * TOKEN_BYTES]
        self.check_extends(token_ids)
        if start >= num_known:
            return encode_tokens(token_ids[start:end])
        return key[start * TOKEN_BYTES :] + encode_tokens(token_ids[num_known:end])

    def uses_lock_node(self, block_size: int) -> bool:
        """False when its lock node holds none of its blocks: it was locked only as the
        copy-on-write source of its first uncached block, so releasing it is no reason to
        keep it cached longer."""
        node = self.lock_node
        if node is None:
            return True
        index = node.start // block_size
        return index < len(self.block_ids) and self.block_ids[index] == node.block_ids[0]

    def resume_point(self, block_size: int, num_tokens: int) -> RadixNode | None:
        """Where inserting its first `num_tokens` tokens may start instead of the root: the
        node on its lock path ending right after its cached blocks, if that node's last block
        is its own (then the node's path spells its tokens)."""
        num_cached = self.num_cached_blocks
        node = self.lock_node
        boundary = num_cached * block_size
        if num_cached == 0 or node is None or boundary > num_tokens:
            return None
        if node.start == boundary:  # locked for a copy-on-write source at the boundary
            node = node.parent
        if (
            node is None
            or node.parent is None
            or node.start + len(node.tokens) // TOKEN_BYTES != boundary
            or node.block_ids[-1] != self.block_ids[num_cached - 1]
        ):
            return None
        return node
