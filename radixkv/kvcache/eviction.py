"""The least-recently-used order of evictable radix-tree leaves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from sortedcontainers import SortedDict

T = TypeVar("T")


class LRUOrder(Generic[T]):
    """Items keyed by a unique integer stamp (the time of their last use), oldest first.

    The radix tree stamps a node from one monotonic clock whenever it is created or released,
    and keeps here exactly its unlocked leaves. add / remove / oldest are O(log n).
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: SortedDict = SortedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, stamp: int) -> bool:
        return stamp in self._items

    def __iter__(self) -> Iterator[T]:
        """Oldest first."""
        return iter(self._items.values())

    def add(self, stamp: int, item: T) -> None:
        assert stamp not in self._items, f"stamp {stamp} is already in the LRU order"
        self._items[stamp] = item

    def remove(self, stamp: int) -> None:
        del self._items[stamp]

    def oldest(self) -> T:
        """The least recently used item. Raises IndexError when empty."""
        item: T = self._items.peekitem(0)[1]
        return item

    def stamps(self) -> list[int]:
        """Every stamp, oldest first (for invariant checks and tests)."""
        return list(self._items.keys())
