"""What admitting a prompt hands the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.kvcache.ids import BlockCopy, BlockId


@dataclass(frozen=True, slots=True)
class Admission:
    """A new sequence's blocks.

    `block_ids` is its whole block table, with slots for every prompt token. The first
    `num_cached_tokens` tokens are already in them once the worker has applied `block_copies`
    ((src, dst) pairs, at most one: the block the prefix match ended inside); the worker
    computes the rest.
    """

    num_cached_tokens: int
    block_ids: list[BlockId]
    block_copies: list[BlockCopy]
