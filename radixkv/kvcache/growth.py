"""What growing a sequence hands the scheduler."""

from __future__ import annotations

from typing import NamedTuple

from radixkv.kvcache.ids import BlockCopy, BlockId


class Growth(NamedTuple):
    """Changes to a sequence's block table that make room for more tokens.

    `new_block_ids` are appended to the table. `replaced` are (logical index, new block id)
    entries swapped for a private copy because the sequence shares them (after a fork) and
    is about to write into them; `block_copies` are the (src, dst) pairs the worker must copy
    first (a block the sequence has written nothing into is replaced without a copy).
    Immutable (tuples), so that the common answer `NO_GROWTH` can be one shared object; a
    NamedTuple rather than a frozen dataclass because it is built on a hot path.
    """

    new_block_ids: tuple[BlockId, ...] = ()
    replaced: tuple[tuple[int, BlockId], ...] = ()
    block_copies: tuple[BlockCopy, ...] = ()


NO_GROWTH = Growth()
"""The table already had room and nothing was shared: nothing for the worker to do."""
