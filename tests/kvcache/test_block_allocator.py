"""BlockAllocator: exact ids, refcounts and free-list order."""

from __future__ import annotations

import pytest

from radixkv.kvcache import BlockAllocator, BlockId, BlockRefcountError


def b(*ids: int) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def test_fresh_pool_hands_out_ids_in_order() -> None:
    allocator = BlockAllocator(5)
    assert allocator.allocate(2) == b(0, 1)
    assert allocator.allocate(1) == b(2)
    assert allocator.num_free_blocks == 2
    assert allocator.free_block_ids() == b(3, 4)
    assert [allocator.refcount(BlockId(i)) for i in range(5)] == [1, 1, 1, 0, 0]
    allocator.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    allocator = BlockAllocator(4)
    assert allocator.allocate(3) == b(0, 1, 2)
    assert allocator.allocate(2) is None
    assert allocator.free_block_ids() == b(3)
    assert allocator.allocate(0) == []
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    allocator.check_invariants()


def test_decref_to_zero_returns_block_to_the_top_of_the_free_list() -> None:
    allocator = BlockAllocator(4)
    assert allocator.allocate(3) == b(0, 1, 2)
    allocator.incref(BlockId(1))
    assert allocator.refcount(BlockId(1)) == 2
    assert allocator.decref(BlockId(1)) is False
    assert allocator.refcount(BlockId(1)) == 1
    assert allocator.decref_all(b(2, 0, 1)) == 3
    # freed 2, 0, 1 in that order: reused last-freed first
    assert allocator.free_block_ids() == b(1, 0, 2, 3)
    assert allocator.allocate(2) == b(1, 0)
    allocator.check_invariants()


def test_double_free_and_use_after_free_raise() -> None:
    allocator = BlockAllocator(2)
    (block,) = allocator.allocate(1) or []
    assert allocator.decref(block) is True
    with pytest.raises(BlockRefcountError, match="double free"):
        allocator.decref(block)
    with pytest.raises(BlockRefcountError):
        allocator.decref_all([block])
    with pytest.raises(BlockRefcountError):
        allocator.incref(block)
    with pytest.raises(BlockRefcountError):
        allocator.incref_all([block])
    with pytest.raises(BlockRefcountError):
        allocator.copy_on_write(block)
    assert allocator.refcount(block) == 0
    allocator.check_invariants()


def test_copy_on_write_of_exclusive_block_is_the_block_itself() -> None:
    allocator = BlockAllocator(3)
    allocator.allocate(1)
    assert allocator.copy_on_write(BlockId(0)) == (BlockId(0), None)
    assert allocator.num_free_blocks == 2


def test_copy_on_write_of_shared_block_moves_the_reference_to_a_fresh_copy() -> None:
    allocator = BlockAllocator(3)
    allocator.allocate(1)
    allocator.incref(BlockId(0))  # two holders
    assert allocator.copy_on_write(BlockId(0)) == (BlockId(1), (BlockId(0), BlockId(1)))
    assert allocator.refcount(BlockId(0)) == 1
    assert allocator.refcount(BlockId(1)) == 1
    allocator.check_invariants()


def test_copy_on_write_without_a_free_block_changes_nothing() -> None:
    allocator = BlockAllocator(1)
    allocator.allocate(1)
    allocator.incref(BlockId(0))
    assert allocator.copy_on_write(BlockId(0)) is None
    assert allocator.refcount(BlockId(0)) == 2


def test_check_invariants_catches_refcount_mismatch() -> None:
    allocator = BlockAllocator(2)
    allocator.allocate(1)
    allocator.check_invariants([1, 0])
    with pytest.raises(AssertionError, match="block 0: refcount 1, but its holders count 2"):
        allocator.check_invariants([2, 0])


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_release_all_frees_blocks_held_once_in_order() -> None:
    allocator = BlockAllocator(4)
    assert allocator.allocate(3) == b(0, 1, 2)
    allocator.release_all(b(2, 0))
    assert allocator.free_block_ids() == b(0, 2, 3)
    allocator.incref(BlockId(1))
    with pytest.raises(BlockRefcountError, match="refcount 2"):
        allocator.release_all(b(1))
    with pytest.raises(BlockRefcountError, match="refcount 0"):
        allocator.release_all(b(3))


def test_allocate_one() -> None:
    allocator = BlockAllocator(2)
    assert allocator.allocate_one() == 0
    assert allocator.allocate_one() == 1
    assert allocator.allocate_one() is None
    assert allocator.refcount(BlockId(1)) == 1
    allocator.check_invariants()
