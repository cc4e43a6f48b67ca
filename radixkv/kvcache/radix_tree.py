"""The radix tree over token ids: which computed prefixes live in which blocks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from radixkv.kvcache.block_allocator import BlockAllocator
from radixkv.kvcache.errors import InvalidTokensError
from radixkv.kvcache.eviction import LRUOrder
from radixkv.kvcache.ids import BlockId, Salt
from radixkv.kvcache.insert_result import InsertResult, note_duplicates
from radixkv.kvcache.invariants import check_tree_invariants
from radixkv.kvcache.prefix_match import NO_MATCH, PrefixMatch, longest_prefix
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.token_key import (
    TOKEN_BYTES,
    TokenKey,
    encode_tokens,
    num_equal_blocks,
)


class RadixTree:
    """Token prefix -> blocks, one root per salt, with lock counts and LRU eviction.

    The tree holds one reference (refcount) on every block of every node. Nodes split only at
    block boundaries, so every node's token count is a multiple of block_size except a leaf
    ending in a partially filled block (a finished sequence's tail). Evictable = unlocked
    leaves, oldest stamp first; evicting frees a leaf's blocks tail first and a parent left
    without children becomes evictable in turn.

    The caller (the manager) keeps one rule that makes eviction exact: every tree block a live
    sequence references lies on the path to a node that sequence has locked. Blocks of unlocked
    nodes are therefore held by the tree alone and evicting them frees them.

    Token runs are packed keys (token_key); `match_prefix` and `insert` take token ids and
    pack them, `match_key` and `insert_key` take packed keys.
    """

    __slots__ = (
        "block_size",
        "num_blocks",
        "num_evictable_blocks",
        "num_evicted_blocks",
        "_block_bytes",
        "_allocator",
        "_roots",
        "_lru",
        "_clock",
    )

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.num_blocks = 0  # blocks held by the tree
        self.num_evictable_blocks = 0  # blocks of unlocked nodes
        self.num_evicted_blocks = 0  # cumulative, through evict()
        self._block_bytes = block_size * TOKEN_BYTES
        self._allocator = allocator
        self._roots: dict[Salt, RadixNode] = {}
        self._lru: LRUOrder[RadixNode] = LRUOrder()
        self._clock = 0

    # ------------------------------------------------------------------------------ lookup

    def root(self, salt: Salt) -> RadixNode | None:
        return self._roots.get(salt)

    def match_prefix(
        self, token_ids: Sequence[int], salt: Salt, max_tokens: int | None = None
    ) -> PrefixMatch:
        """Longest prefix of `token_ids[:max_tokens]` cached under `salt`. Mutates nothing.

        Full blocks are returned for sharing; when the match ends inside a cached block,
        that block and how many of its tokens match are returned for copying.
        """
        return self.match_key(encode_tokens(token_ids), salt, max_tokens)

    def match_key(self, key: TokenKey, salt: Salt, max_tokens: int | None = None) -> PrefixMatch:
        """`match_prefix` of a packed key."""
        root = self._roots.get(salt)
        n = len(key) if max_tokens is None else min(len(key), max_tokens * TOKEN_BYTES)
        if root is None or n <= 0:
            return NO_MATCH
        return longest_prefix(root, key, n, self._block_bytes)

    # ------------------------------------------------------------------------------ insert

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[BlockId], salt: Salt
    ) -> InsertResult:
        """Cache `token_ids`, whose KV is in `block_ids` (the last block may be partial).

        Where the tree already holds the same full blocks of tokens, the tree's blocks win and
        are reported as duplicates (the caller should switch to them and release its own).
        The caller's remaining blocks are taken (incref) into one new leaf, splitting the node
        where the tokens diverge at the block boundary before the divergence; where they
        continue an unlocked leaf, they are appended to that leaf instead. A partial tail
        whose tokens the tree already holds (in a block with at least as many) is not taken; a
        tail or block that is fuller than an unlocked partial leaf agreeing on its tokens
        replaces that leaf (its block is decrefed). Never evicts otherwise; locks nothing.
        Raises InvalidTokensError when len(block_ids) != ceil(len(token_ids) / block_size).
        """
        return self.insert_key(encode_tokens(token_ids), block_ids, salt)

    def insert_key(
        self,
        key: TokenKey,
        block_ids: Sequence[BlockId],
        salt: Salt,
        start: RadixNode | None = None,
        transfer: bool = False,
        lock: bool = False,
    ) -> InsertResult:
        """`insert` of a packed key.

        With `start`, resume below that node instead of the root: `key` and `block_ids` then
        hold only what follows it (tokens from offset `start.end` on, and their blocks), and
        the caller vouches that `start`'s path spells the sequence's tokens before them (it is
        not re-checked); `start` must end on a block boundary. Indices in the result count
        from the sequence's first block either way. With `transfer`, the caller hands the
        tree its own references to the blocks the tree takes (no incref): it must not decref
        those blocks afterwards. With `lock`, the node the insertion ends at (`result.node`,
        if any) is locked as `lock()` would, a new leaf being created locked (it never enters
        the LRU order only to leave it again).
        """
        result = self._insert_key(key, block_ids, salt, start, transfer, lock)
        if lock and result.num_new_blocks == 0 and result.node is not None:
            self.lock(result.node)
        return result

    def _insert_key(
        self,
        key: TokenKey,
        block_ids: Sequence[BlockId],
        salt: Salt,
        start: RadixNode | None,
        transfer: bool,
        lock: bool,
    ) -> InsertResult:
        """`insert_key`; with `lock`, locks the node it takes new blocks into (only)."""
        bs, bb = self.block_size, self._block_bytes
        n = len(key)
        num_tokens = n // TOKEN_BYTES
        if len(block_ids) != -(-num_tokens // bs):
            raise InvalidTokensError(
                f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks of {bs}, "
                f"got {len(block_ids)}"
            )
        if start is None:
            node = self._roots.get(salt)
            if node is None:
                node = self._roots[salt] = RadixNode(None, b"", 0, b"", [], 0)
            base = 0
        else:
            node = start
            base = start.start + len(start.tokens) // TOKEN_BYTES
            assert base % bs == 0, "insertion resumes only at a block boundary"
        base_block = base // bs
        pos = 0  # bytes into key
        deepest = node if node.parent is not None else None
        duplicates: list[tuple[int, BlockId]] = []
        while pos < n:
            end = pos + bb
            query = key[pos:end]
            child = node.children.get(query)
            if child is None:
                if end > n and node.holds_prefix(query):
                    break  # a fuller block already holds our partial tail
                if node.num_partial_children:
                    grown = node.fill_partial_child(query, block_ids[pos // bb], bb)
                    if grown is not None:  # we wrote more tokens into a block cached partially
                        deepest = grown
                        if end >= n:
                            return InsertResult(grown, base_block + len(block_ids), 0, duplicates)
                        node = grown
                        pos = end
                        continue
                if not node.children and node.lock_count == 0 and node.parent is not None:
                    num_taken = self._extend_leaf(node, key, pos, block_ids, transfer, lock)
                    return InsertResult(node, base_block + len(block_ids), num_taken, duplicates)
                leaf = self._attach(node, key, pos, block_ids, base, transfer, lock)
                num_taken = len(leaf.block_ids)
                return InsertResult(leaf, base_block + len(block_ids), num_taken, duplicates)
            if end > n:
                break  # an identical partial leaf already holds our partial tail
            child_tokens = child.tokens
            child_len = len(child_tokens)
            first = pos // bb
            if (
                child_len % bb == 0
                and pos + child_len <= n
                and key.startswith(child_tokens, pos)
            ):
                note_duplicates(child.block_ids, block_ids, first, base_block, duplicates)
                node = deepest = child
                pos += child_len
                continue
            num_equal = num_equal_blocks(key, pos, n, child_tokens, bb)
            note_duplicates(
                child.block_ids[:num_equal], block_ids, first, base_block, duplicates
            )
            deepest = child
            offset = num_equal * bb
            pos += offset
            if pos >= n:
                break
            ours = key[pos : pos + bb]
            if len(ours) < bb and child_tokens[offset : offset + len(ours)] == ours:
                break  # the child's next block holds our partial tail
            # diverging (or fuller than the child's partial tail): the new leaf hangs at the
            # block boundary, next to what remains of the child
            node = child.split(num_equal, bs, self._tick())
        return InsertResult(deepest, base_block + pos // bb, 0, duplicates)

    # ------------------------------------------------------------------------ lock, evict

    def lock(self, node: RadixNode) -> None:
        """Lock `node` and its path to the root (lock_count + 1 each): none can be evicted."""
        lru = self._lru
        while node.parent is not None:
            if node.lock_count == 0:
                self.num_evictable_blocks -= len(node.block_ids)
                if not node.children:
                    del lru[node.stamp]
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: RadixNode, touch: bool = True) -> None:
        """Undo one `lock(node)`. Stamps the path as just used, deepest node oldest (with
        `touch=False`, `node` itself keeps its stamp: it was locked without being used, e.g.
        only as a copy-on-write source). Nodes whose lock count reaches zero become
        evictable (leaves enter the LRU order)."""
        lru = self._lru
        clock = self._clock
        while node.parent is not None:
            count = node.lock_count - 1
            assert count >= 0, f"unlock of unlocked node {node!r}"
            node.lock_count = count
            if touch:
                clock += 1
                node.stamp = clock
            touch = True
            if count == 0:
                self.num_evictable_blocks += len(node.block_ids)
                if not node.children:
                    lru[node.stamp] = node
            node = node.parent
        self._clock = clock

    def lock_prefix(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Lock the first `num_blocks` blocks of `node`, and its path: when `node` has more,
        it is first split after them so that its tail stays evictable. Returns the node that
        now holds the lock (`node`, or the new upper part of it); `unlock` that one.

        A one-block node locked this way becomes its parent's `copy_source`: later matches
        that share as many tokens with it as with any sibling copy from it, so that copies
        of a popular block boundary come from one node instead of splitting a new one each.
        """
        if 0 < num_blocks < len(node.block_ids):
            node = node.split(num_blocks, self.block_size, self._tick())
        if len(node.block_ids) == 1 and node.parent is not None:
            node.parent.copy_source = node
        self.lock(node)
        return node

    def num_blocks_protected_by_lock(self, node: RadixNode | None, num_blocks: int) -> int:
        """How many evictable blocks `lock_prefix(node, num_blocks)` would protect."""
        if node is None or node.lock_count:
            return 0
        total = min(num_blocks, len(node.block_ids))
        node = node.parent
        while node is not None and node.parent is not None and node.lock_count == 0:
            total += len(node.block_ids)
            node = node.parent
        return total

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks of unlocked leaves, least recently used first.

        A leaf gives up its blocks tail first; a leaf left empty is removed and a parent left
        without children joins the LRU order. Returns how many blocks were freed.
        """
        lru = self._lru
        num_freed = 0
        while num_freed < num_blocks and lru:
            leaf = lru.peekitem(0)[1]
            wanted = num_blocks - num_freed
            if len(leaf.block_ids) <= wanted:
                num_freed += self._remove_leaf(leaf)
            else:  # keep the leaf's head, free its tail
                block_ids = leaf.block_ids
                keep = len(block_ids) - wanted
                dropped = block_ids[keep:]
                del block_ids[keep:]
                leaf.tokens = leaf.tokens[: keep * self._block_bytes]
                self.num_blocks -= wanted
                self.num_evictable_blocks -= wanted
                dropped.reverse()
                self._allocator.release_all(dropped)  # raises if one is still referenced
                num_freed += wanted
        self.num_evicted_blocks += num_freed
        return num_freed

    # --------------------------------------------------------------------- introspection

    def salts(self) -> list[Salt]:
        return list(self._roots)

    def nodes(self, salt: Salt) -> Iterator[RadixNode]:
        """Every non-root node under `salt`, parents before children, children by key."""
        root = self._roots.get(salt)
        if root is None:
            return
        stack = [root]
        while stack:
            node = stack.pop()
            if node is not root:
                yield node
            stack.extend(node.children[key] for key in reversed(node.child_keys))

    def lru_order(self) -> list[RadixNode]:
        """The evictable leaves, least recently used first."""
        return list(self._lru.values())

    def check_invariants(self) -> None:
        """Shape, keys, counts and the LRU set; raises AssertionError naming the first break."""
        check_tree_invariants(self)

    def lru_items(self) -> list[tuple[int, RadixNode]]:
        """(stamp, leaf) of the evictable leaves, least recently used first."""
        return list(self._lru.items())

    @property
    def clock(self) -> int:
        """The last stamp handed out."""
        return self._clock

    def refcount(self, block_id: BlockId) -> int:
        """The allocator's count for a block (for invariant checks)."""
        return self._allocator.refcount(block_id)

    # --------------------------------------------------------------------------- helpers

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _attach(
        self,
        parent: RadixNode,
        key: TokenKey,
        pos: int,
        block_ids: Sequence[BlockId],
        base: int,
        transfer: bool,
        lock: bool,
    ) -> RadixNode:
        """Hang the rest of `key` (from byte `pos`, a block boundary; token `base` is its
        first) and of `block_ids` under `parent` as a new leaf, taking the blocks; locked
        (with its path) if `lock`."""
        bb = self._block_bytes
        child_key = key[pos : pos + bb]
        if parent.num_partial_children:
            self._drop_superseded_partials(parent, child_key)
        taken = list(block_ids[pos // bb :])
        if not transfer:
            self._allocator.incref_all(taken)
        leaf = RadixNode(
            parent, child_key, base + pos // TOKEN_BYTES, key[pos:], taken, self._tick()
        )
        if parent.parent is not None and not parent.children and parent.lock_count == 0:
            del self._lru[parent.stamp]
        parent.add_child(leaf, self._block_bytes)
        self.num_blocks += len(taken)
        if lock:
            leaf.lock_count = 1
            self.lock(parent)  # a root's lock() is a no-op
        else:
            self._lru[leaf.stamp] = leaf
            self.num_evictable_blocks += len(taken)
        return leaf

    def _extend_leaf(
        self,
        leaf: RadixNode,
        key: TokenKey,
        pos: int,
        block_ids: Sequence[BlockId],
        transfer: bool,
        lock: bool,
    ) -> int:
        """Append the rest of `key` (from byte `pos`, where `leaf` ends on a block boundary)
        and of `block_ids` to the unlocked leaf itself instead of hanging a one-child chain
        under it: the same prefixes with one node fewer to match, stamp and evict. The leaf
        is stamped as just used unless it already is the most recent (or it is locked, with
        `lock`: unlocking stamps it). Returns how many blocks it took."""
        bb = self._block_bytes
        taken = block_ids[pos // bb :]
        if not transfer:
            self._allocator.incref_all(taken)
        leaf.tokens += key[pos:]
        leaf.block_ids.extend(taken)
        num_taken = len(taken)
        self.num_blocks += num_taken
        self.num_evictable_blocks += num_taken
        if lock:
            self.lock(leaf)
            return num_taken
        lru = self._lru
        if lru.peekitem(-1)[1] is not leaf:
            del lru[leaf.stamp]
            leaf.stamp = self._tick()
            lru[leaf.stamp] = leaf
        return num_taken

    def _drop_superseded_partials(self, parent: RadixNode, child_key: TokenKey) -> None:
        """Remove unlocked partial leaves whose tokens `child_key` extends: it holds them too."""
        for size in range(TOKEN_BYTES, len(child_key), TOKEN_BYTES):
            leaf = parent.children.get(child_key[:size])
            if leaf is not None and leaf.lock_count == 0:
                self._remove_leaf(leaf)

    def _remove_leaf(self, leaf: RadixNode) -> int:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_count == 0
        parent.remove_child(leaf, self._block_bytes)
        del self._lru[leaf.stamp]
        block_ids = leaf.block_ids
        self.num_blocks -= len(block_ids)
        self.num_evictable_blocks -= len(block_ids)
        block_ids.reverse()
        self._allocator.release_all(block_ids)  # raises if one is still referenced
        num_freed = len(block_ids)
        leaf.block_ids = []
        leaf.parent = None  # removed: on no path any more
        if parent.parent is not None and not parent.children and parent.lock_count == 0:
            self._lru[parent.stamp] = parent
        return num_freed
