"""LRUOrder: oldest stamp first, O(log n) insert/delete."""

from __future__ import annotations

import pytest

from radixkv.kvcache import LRUOrder


def test_oldest_first_whatever_the_insertion_order() -> None:
    order: LRUOrder[str] = LRUOrder()
    order[7] = "g"
    order[3] = "c"
    order[5] = "e"
    assert list(order.values()) == ["c", "e", "g"]
    assert list(order) == [3, 5, 7]
    assert order.oldest() == "c"
    del order[3]
    assert order.oldest() == "e"
    assert 5 in order and 3 not in order
    assert len(order) == 2


def test_oldest_of_empty_raises() -> None:
    with pytest.raises(IndexError):
        LRUOrder[str]().oldest()
