"""LRUOrder: oldest stamp first, O(log n) add/remove."""

from __future__ import annotations

import pytest

from radixkv.kvcache import LRUOrder


def test_oldest_first_whatever_the_insertion_order() -> None:
    order: LRUOrder[str] = LRUOrder()
    order.add(7, "g")
    order.add(3, "c")
    order.add(5, "e")
    assert list(order) == ["c", "e", "g"]
    assert order.stamps() == [3, 5, 7]
    assert order.oldest() == "c"
    order.remove(3)
    assert order.oldest() == "e"
    assert 5 in order and 3 not in order
    assert len(order) == 2


def test_stamps_are_unique() -> None:
    order: LRUOrder[str] = LRUOrder()
    order.add(1, "a")
    with pytest.raises(AssertionError):
        order.add(1, "b")


def test_oldest_of_empty_raises() -> None:
    with pytest.raises(IndexError):
        LRUOrder[str]().oldest()
