"""The manager's record of one live sequence."""

from __future__ import annotations

from radixkv.kvcache.ids import BlockId, Salt, SeqId
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.token_key import TokenKey


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
