"""One node of the radix tree: a run of tokens and the blocks that hold their KV."""

from __future__ import annotations

from bisect import bisect_left, insort

from radixkv.kvcache.ids import BlockId
from radixkv.kvcache.token_key import TOKEN_BYTES, TokenKey, common_prefix_tokens, decode_tokens


class RadixNode:
    """A node's tokens start at token offset `start` of every sequence whose path crosses it.

        tokens     t0 .. t15 | t16 .. t31 | t32 .. t38        (block_size 16)
        block_ids  b7        | b2         | b9 (partial: 7 of 16 tokens)

    `tokens` and `key` are packed (see token_key). `len(block_ids) == ceil(num_tokens /
    block_size)`; only a leaf may end with a partial block, because children hang at block
    boundaries. `children` maps each child's first block (`key`, partial only for a one-block
    partial leaf) to the child; `child_keys` holds the same keys in a sorted list, so the child
    sharing the longest prefix with a block of a query is a neighbour of the query's bisection
    point (keys starting with a given prefix form one contiguous run of the sorted order).
    Bisection is O(log n); insertion and removal move O(n) pointers in C (a node has at most
    as many children as the pool has blocks; 10,000 children move 80 KB, a few microseconds).

    `lock_count` counts the locks held on this node and on its descendants: a node is locked
    while a live sequence uses it, locked nodes are never evicted. `stamp` is the tree clock
    at the node's creation or last release; unlocked leaves are evicted in stamp order.
    Roots (one per salt) have no parent, no tokens and no blocks; a removed node has no parent
    either.
    """

    __slots__ = (
        "parent",
        "key",
        "start",
        "tokens",
        "block_ids",
        "children",
        "child_keys",
        "num_partial_children",
        "copy_source",
        "lock_count",
        "stamp",
    )

    def __init__(
        self,
        parent: RadixNode | None,
        key: TokenKey,
        start: int,
        tokens: TokenKey,
        block_ids: list[BlockId],
        stamp: int,
    ) -> None:
        self.parent = parent
        self.key = key
        self.start = start
        self.tokens = tokens
        self.block_ids = block_ids
        self.children: dict[TokenKey, RadixNode] = {}
        self.child_keys: list[TokenKey] = []  # sorted
        self.num_partial_children = 0
        self.copy_source: RadixNode | None = None  # preferred among equally matching children
        self.lock_count = 0
        self.stamp = stamp

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def end(self) -> int:
        """Token offset just past this node's tokens."""
        return self.start + len(self.tokens) // TOKEN_BYTES

    @property
    def token_ids(self) -> tuple[int, ...]:
        return decode_tokens(self.tokens)

    def child_sharing_longest_prefix(self, query: TokenKey) -> tuple[RadixNode, int]:
        """The child whose first block shares the most leading tokens with `query`, and how
        many; on a tie `copy_source` if it is one of them. The node must have children.

        Only the two keys around the query's bisection point can share the longest prefix.
        """
        keys = self.child_keys
        index = bisect_left(keys, query)
        neighbours = keys[max(0, index - 1) : index + 1]
        preferred = self.copy_source
        if preferred is not None and preferred.parent is self:
            best = common_prefix_tokens(query, preferred.key)
            longer = query[: (best + 1) * TOKEN_BYTES]
            if len(longer) == len(query) or not (
                neighbours[0].startswith(longer) or neighbours[-1].startswith(longer)
            ):
                return preferred, best  # no child shares more
        best_key, best = neighbours[0], common_prefix_tokens(query, neighbours[0])
        if len(neighbours) == 2:
            common = common_prefix_tokens(query, neighbours[1])
            if common > best:
                best_key, best = neighbours[1], common
        return self.children[best_key], best

    def holds_prefix(self, query: TokenKey) -> bool:
        """True if some child's first block starts with `query` (a partial block's tokens)."""
        keys = self.child_keys
        index = bisect_left(keys, query)
        return index < len(keys) and keys[index].startswith(query)

    def add_child(self, child: RadixNode, block_bytes: int) -> None:
        self.children[child.key] = child
        insort(self.child_keys, child.key)
        if len(child.key) < block_bytes:
            self.num_partial_children += 1

    def remove_child(self, child: RadixNode, block_bytes: int) -> None:
        del self.children[child.key]
        keys = self.child_keys
        index = bisect_left(keys, child.key)
        assert keys[index] == child.key, "child key missing from child_keys"
        del keys[index]
        if len(child.key) < block_bytes:
            self.num_partial_children -= 1

    def fill_partial_child(
        self, child_key: TokenKey, block_id: BlockId, block_bytes: int
    ) -> RadixNode | None:
        """The partial leaf child that holds `block_id` with fewer tokens than `child_key`, if
        any, now holding all of `child_key` (the block has them: its holder wrote them, and
        any other holder copies it before writing)."""
        for size in range(TOKEN_BYTES, len(child_key), TOKEN_BYTES):
            leaf = self.children.get(child_key[:size])
            if leaf is not None and leaf.block_ids[0] == block_id:
                self.remove_child(leaf, block_bytes)
                leaf.key = leaf.tokens = child_key
                self.add_child(leaf, block_bytes)
                return leaf
        return None

    def split(self, num_blocks: int, block_size: int, stamp: int) -> RadixNode:
        """Cut this node after its first `num_blocks` blocks; returns the new upper node
        (stamped `stamp`, with this node's lock count). This object keeps the lower part, so
        locks held on it still cover its path."""
        block_bytes = block_size * TOKEN_BYTES
        at = num_blocks * block_bytes
        parent = self.parent
        assert parent is not None and 0 < at < len(self.tokens)
        upper = RadixNode(
            parent, self.key, self.start, self.tokens[:at], self.block_ids[:num_blocks], stamp
        )
        upper.lock_count = self.lock_count
        parent.children[self.key] = upper
        self.parent = upper
        self.start += num_blocks * block_size
        self.tokens = self.tokens[at:]
        self.block_ids = self.block_ids[num_blocks:]
        self.key = self.tokens[:block_bytes]
        upper.add_child(self, block_bytes)
        return upper

    def is_below(self, ancestor: RadixNode) -> bool:
        """True if `ancestor` is this node or on its path to the root."""
        node: RadixNode | None = self
        while node is not None:
            if node is ancestor:
                return True
            node = node.parent
        return False

    def path(self) -> list[RadixNode]:
        """Nodes from the root's child down to this one (empty for a root or removed node)."""
        nodes = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def __repr__(self) -> str:
        return (
            f"RadixNode(start={self.start}, num_tokens={self.num_tokens}, "
            f"block_ids={self.block_ids}, lock_count={self.lock_count}, stamp={self.stamp})"
        )
