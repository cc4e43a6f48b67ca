"""A fixed pool of refcounted KV blocks and its free list."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from radixkv.kvcache.errors import BlockRefcountError
from radixkv.kvcache.ids import BlockCopy, BlockId


class BlockAllocator:
    """Block ids 0..num_blocks-1, each with a refcount; a block is free exactly when it is 0.

    A block's refcount is the number of its holders: every live sequence whose block table
    contains it, plus one while the radix tree caches it. The free list is a stack: a fresh
    pool hands out 0, 1, 2, ...; a block whose refcount drops to zero is pushed on top and is
    the next one handed out (blocks freed a, b, c are reallocated c, b, a).
    """

    __slots__ = ("num_blocks", "_free", "_refcounts")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[BlockId] = [BlockId(b) for b in reversed(range(num_blocks))]
        self._refcounts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[BlockId]:
        """The free list in the order `allocate` would hand it out (a copy)."""
        return self._free[::-1]

    def refcount(self, block_id: BlockId) -> int:
        return self._refcounts[block_id]

    def allocate(self, num_blocks: int) -> list[BlockId] | None:
        """Take `num_blocks` blocks from the top of the free list, each with refcount 1.

        All or nothing: returns None and changes nothing when fewer blocks are free.
        """
        free = self._free
        if num_blocks > len(free):
            return None
        if num_blocks <= 0:
            if num_blocks < 0:
                raise ValueError(f"cannot allocate {num_blocks} blocks")
            return []
        block_ids = free[-num_blocks:]
        del free[-num_blocks:]
        block_ids.reverse()
        refcounts = self._refcounts
        for block_id in block_ids:
            refcounts[block_id] = 1
        return block_ids

    def allocate_one(self) -> BlockId | None:
        """`allocate(1)` without the list: the block, or None when none is free."""
        free = self._free
        if not free:
            return None
        block_id = free.pop()
        self._refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: BlockId) -> None:
        """Add a holder. Raises BlockRefcountError if the block is free."""
        count = self._refcounts[block_id]
        if count <= 0:
            raise BlockRefcountError(f"incref of free block {block_id}")
        self._refcounts[block_id] = count + 1

    def incref_all(self, block_ids: Iterable[BlockId]) -> None:
        """`incref` each block in order."""
        refcounts = self._refcounts
        for block_id in block_ids:
            count = refcounts[block_id]
            if not count:
                raise BlockRefcountError(f"incref of free block {block_id}")
            refcounts[block_id] = count + 1

    def decref(self, block_id: BlockId) -> bool:
        """Drop a holder; at zero the block goes to the back of the free list.

        Returns True when the block was freed. Raises BlockRefcountError if the block is
        already free (a double free: refcounts never go below zero).
        """
        count = self._refcounts[block_id] - 1
        if count < 0:
            raise BlockRefcountError(f"decref of free block {block_id} (double free)")
        self._refcounts[block_id] = count
        if count == 0:
            self._free.append(block_id)
            return True
        return False

    def decref_all(self, block_ids: Iterable[BlockId]) -> int:
        """`decref` each block in the given order (freed ones are pushed in that order);
        returns how many were freed."""
        refcounts = self._refcounts
        append = self._free.append
        num_freed = 0
        for block_id in block_ids:
            count = refcounts[block_id]
            if count > 1:
                refcounts[block_id] = count - 1
            elif count == 1:
                refcounts[block_id] = 0
                append(block_id)
                num_freed += 1
            else:
                raise BlockRefcountError(f"decref of free block {block_id} (double free)")
        return num_freed

    def release_all(self, block_ids: Sequence[BlockId]) -> None:
        """Free blocks whose only holder is the caller (refcount 1), pushing them in the given
        order; a cheaper `decref_all` for eviction. Raises BlockRefcountError if a block has
        another holder or none."""
        refcounts = self._refcounts
        for block_id in block_ids:
            if refcounts[block_id] != 1:
                raise BlockRefcountError(
                    f"release of block {block_id} with refcount {refcounts[block_id]}"
                )
            refcounts[block_id] = 0
        self._free.extend(block_ids)

    def copy_on_write(self, block_id: BlockId) -> tuple[BlockId, BlockCopy | None] | None:
        """Give one holder of `block_id` a block it may write into.

        Exclusively owned (refcount 1): returns (block_id, None) and changes nothing.
        Shared: allocates a fresh block, moves the caller's reference to it (decref of
        `block_id`) and returns (fresh, (block_id, fresh)): the worker must copy src -> dst
        before the write. Returns None and changes nothing when no block is free.
        Raises BlockRefcountError if `block_id` is free.
        """
        count = self._refcounts[block_id]
        if count <= 0:
            raise BlockRefcountError(f"copy_on_write of free block {block_id}")
        if count == 1:
            return block_id, None
        if not self._free:
            return None
        fresh = self._free.pop()
        self._refcounts[fresh] = 1
        self._refcounts[block_id] = count - 1
        return fresh, (block_id, fresh)

    def check_invariants(self, expected_refcounts: Sequence[int] | None = None) -> None:
        """Free list = exactly the blocks at refcount 0, once each; no negative refcount.

        With `expected_refcounts` (one per block), also that every refcount equals it.
        """
        refcounts = self._refcounts
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(refcounts):
            assert count >= 0, f"block {block_id} has negative refcount {count}"
            assert (count == 0) == (block_id in free), (
                f"block {block_id}: refcount {count} but "
                f"{'on' if block_id in free else 'not on'} the free list"
            )
        if expected_refcounts is not None:
            for block_id, (count, expected) in enumerate(
                zip(refcounts, expected_refcounts, strict=True)
            ):
                assert count == expected, (
                    f"block {block_id}: refcount {count}, but its holders count {expected}"
                )
