"""The least-recently-used order of evictable radix-tree leaves."""

from __future__ import annotations

from typing import Generic, TypeVar

from sortedcontainers import SortedDict

T = TypeVar("T")


class LRUOrder(SortedDict, Generic[T]):
    """Items keyed by a unique integer stamp (the time of their last use), oldest first.

    The radix tree stamps a node from one monotonic clock whenever it is created or released,
    and keeps here exactly its unlocked leaves. A SortedDict (O(log n) insert, delete and
    oldest): `order[stamp] = item`, `del order[stamp]`, `order.oldest()`; iterating yields
    the stamps oldest first, `values()` the items.
    """

    def oldest(self) -> T:
        """The least recently used item. Raises IndexError when empty."""
        item: T = self.peekitem(0)[1]
        return item
