"""The façade the scheduler uses: sequences in, block tables out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from radixkv.kvcache.admission import Admission
from radixkv.kvcache.block_allocator import BlockAllocator
from radixkv.kvcache.errors import InvalidTokensError, SequenceExistsError, UnknownSequenceError
from radixkv.kvcache.family import grow_forked, insertable_len, relock_relatives
from radixkv.kvcache.growth import NO_GROWTH, Growth
from radixkv.kvcache.ids import BlockCopy, BlockId, Salt, SeqId
from radixkv.kvcache.invariants import check_manager_invariants
from radixkv.kvcache.radix_tree import InsertResult, RadixTree
from radixkv.kvcache.sequence_blocks import SequenceBlocks
from radixkv.kvcache.stats import KVCacheStats
from radixkv.kvcache.token_key import TOKEN_BYTES, encode_tokens

MAX_EVICTION_BATCH = 16
"""When an allocation must evict, it evicts at least min(16, num_blocks // 256) blocks: the
least recently used ones, which the next allocations would evict anyway. A decoding sequence
needs one block every block_size tokens, and evicting them one at a time costs a tree walk
each; at most 1/256 of the pool is evicted early, and small pools evict exactly."""


class KVCacheManager:
    """Block tables of live sequences over one pool, sharing computed prefixes.

    A block's refcount (`refcount()`) is the number of live sequences whose table holds it,
    plus one while the radix tree caches it; it returns to the free list at zero.

    Each live sequence holds one lock in the tree, on a node whose path holds every tree block
    the sequence uses; so the blocks of unlocked nodes are held by the tree alone, and
    `num_available_blocks()` (free + evictable) is exact. A sequence holds its cached prefix
    (the first `num_cached_blocks` blocks of its table, all on its lock path) through that
    lock alone: locked nodes are never evicted, so the tree's own reference keeps those
    blocks allocated, and sharing a prefix of n blocks costs no n increfs and decrefs. The
    allocator counts the other references: the tree's, and each sequence's for the rest of
    its table. Allocation evicts unlocked cached prefixes, least recently used first, when the
    free list runs short (in batches: see MAX_EVICTION_BATCH).
    With `enable_prefix_caching=False` nothing is ever matched or inserted.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.tree = RadixTree(self.allocator, block_size)
        self._seqs: dict[SeqId, SequenceBlocks] = {}
        self._eviction_batch = max(1, min(MAX_EVICTION_BATCH, num_blocks // 256))
        self._hit_tokens = 0
        self._queried_tokens = 0

    # ----------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (cached blocks not counted)."""
        return self.allocator.num_free_blocks

    def num_available_blocks(self) -> int:
        """Blocks an allocation could get now: free ones plus evictable cached ones."""
        return self.allocator.num_free_blocks + self.tree.num_evictable_blocks

    def block_ids(self, seq_id: SeqId) -> list[BlockId]:
        """A copy of the sequence's block table. Raises UnknownSequenceError."""
        return list(self._get(seq_id).block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens with reserved slots. Raises UnknownSequenceError."""
        return self._get(seq_id).num_tokens

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def refcount(self, block_id: BlockId) -> int:
        """Live sequences whose table holds the block, plus one if the tree caches it.

        The allocator's count plus the sequences holding it through their lock; O(live table
        length), for tests and debugging.
        """
        through_locks = sum(
            1
            for seq in self._seqs.values()
            if block_id in seq.block_ids[: seq.num_cached_blocks]
        )
        return self.allocator.refcount(block_id) + through_locks

    def peek_prefix(self, token_ids: Sequence[int], salt: Salt) -> int:
        """Tokens `admit` would reuse now for this prompt. Mutates nothing, not even LRU order."""
        if not self.enable_prefix_caching or len(token_ids) <= 1:
            return 0
        return self.tree.match_key(encode_tokens(token_ids), salt, len(token_ids) - 1).num_tokens

    # ------------------------------------------------------------------- sequences

    def admit(self, seq_id: SeqId, token_ids: Sequence[int], salt: Salt) -> Admission | None:
        """Start a sequence with a block table for all of `token_ids`.

        Matches `token_ids[:-1]` (the last token is always computed), shares the matched full
        blocks (held through a lock on the matched path), allocates the rest, the first fresh
        block being the copy-on-write destination when the match ends inside a cached block.
        Evicts unlocked cached prefixes as needed. All or nothing: returns None and changes
        nothing (not even LRU order) when the blocks cannot be found.
        Raises SequenceExistsError if `seq_id` is live, InvalidTokensError if the prompt is
        empty.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(f"sequence {seq_id} is already live")
        key = encode_tokens(token_ids)
        num_tokens = len(key) // TOKEN_BYTES
        if num_tokens == 0:
            raise InvalidTokensError("a prompt needs at least one token")
        tree = self.tree
        allocator = self.allocator
        num_table_blocks = -(-num_tokens // self.block_size)
        if self.enable_prefix_caching:
            match = tree.match_key(key, salt, num_tokens - 1)
            shared, node, num_node_blocks = match.block_ids, match.node, match.num_node_blocks
        else:
            match, shared, node, num_node_blocks = None, [], None, 0
        num_new = num_table_blocks - len(shared)
        num_free = allocator.num_free_blocks
        if num_new > num_free:
            protected = tree.num_blocks_protected_by_lock(node, num_node_blocks)
            if num_new > num_free + tree.num_evictable_blocks - protected:
                return None
            if node is not None:
                node = tree.lock_prefix(node, num_node_blocks)
            tree.evict(max(num_new - num_free, self._eviction_batch))
        elif node is not None:
            node = tree.lock_prefix(node, num_node_blocks)
        new = allocator.allocate(num_new)
        assert new is not None, "eviction did not free the blocks it promised"
        block_ids = shared + new
        copies: list[BlockCopy] = []
        num_cached_tokens = 0
        if match is not None:
            num_cached_tokens = match.num_tokens
            if match.partial_block_id is not None:
                copies.append((match.partial_block_id, new[0]))
        self._seqs[seq_id] = SequenceBlocks(
            block_ids,
            num_tokens,
            num_table_blocks * self.block_size,
            node,
            salt,
            len(shared),
            key,
        )
        self._hit_tokens += num_cached_tokens
        self._queried_tokens += num_tokens - 1
        return Admission(num_cached_tokens, list(block_ids), copies)

    def grow(self, seq_id: SeqId, num_tokens: int) -> Growth | None:
        """Reserve slots for `num_tokens` more tokens after the sequence's current length.

        Appends fresh blocks as needed and first replaces, by a private copy, every shared
        block the sequence will write into (only after a fork). Evicts as needed. Returns
        NO_GROWTH when the table already had room; None and no change at all when the blocks
        cannot be found. Raises UnknownSequenceError, InvalidTokensError if num_tokens < 0.
        """
        try:
            seq = self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id} is not live") from None
        new_len = seq.num_tokens + num_tokens
        if new_len <= seq.writable_len and num_tokens > 0:
            seq.num_tokens = new_len
            return NO_GROWTH
        return self._grow_slow(seq, num_tokens)

    def grow_each(self, seq_ids: Iterable[SeqId], num_tokens: int = 1) -> list[Growth | None]:
        """`grow` every sequence of `seq_ids` in turn by `num_tokens` (a decode step: one
        token each) in one call; answer i is what `grow(seq_ids[i], num_tokens)` returns after
        the earlier ones. Each grow is all or nothing on its own: a None leaves that sequence
        unchanged, the others grown. Raises UnknownSequenceError (growing none) if one of them
        is not live, InvalidTokensError if num_tokens < 0.
        """
        try:
            seqs = list(map(self._seqs.__getitem__, seq_ids))
        except KeyError as e:
            raise UnknownSequenceError(f"sequence {e.args[0]} is not live") from None
        if num_tokens <= 0:
            return [self._grow_slow(seq, num_tokens) for seq in seqs]
        growths: list[Growth | None] = []
        append = growths.append
        for seq in seqs:  # grow's fast path, inlined
            new_len = seq.num_tokens + num_tokens
            if new_len <= seq.writable_len:
                seq.num_tokens = new_len
                append(NO_GROWTH)
            else:
                append(self._grow_slow(seq, num_tokens))
        return growths

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Start `child_id` as a copy of `parent_id`: same table (every block shared), same
        length, its own lock on the parent's lock node (which holds the cached prefix; the
        other blocks are increfed). The first write of either into a shared block copies it
        (see `grow`). Raises UnknownSequenceError, SequenceExistsError.
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(f"sequence {child_id} is already live")
        self.allocator.incref_all(parent.block_ids[parent.num_cached_blocks :])
        if parent.lock_node is not None:
            self.tree.lock(parent.lock_node)
        family = parent.family
        if family is None:
            family = parent.family = {parent_id}
        family.add(child_id)
        parent.writable_len = parent.num_tokens
        self._seqs[child_id] = SequenceBlocks(
            list(parent.block_ids),
            parent.num_tokens,
            parent.num_tokens,
            parent.lock_node,
            parent.salt,
            parent.num_cached_blocks,
            parent.key,
            family,
        )

    def cache(self, seq_id: SeqId, token_ids: Sequence[int]) -> list[tuple[int, BlockId]]:
        """Insert the full blocks of the sequence's computed tokens into the tree.

        `token_ids` are the tokens whose KV is computed (a prefix of the sequence's tokens);
        a partial tail block is not inserted (it is still being written). Where the tree
        already held those tokens in other blocks, the sequence switches to the tree's blocks
        and releases its own (decref). Its lock moves down to the deepest node holding its
        tokens, and it holds every inserted block through that lock from then on (the tree
        takes over its references). Returns the (logical index, new block id) table
        replacements.
        No-op returning [] with prefix caching off. Raises UnknownSequenceError,
        InvalidTokensError if token_ids is longer than the sequence.
        """
        seq = self._get(seq_id)
        if len(token_ids) > seq.num_tokens:
            raise InvalidTokensError(
                f"sequence {seq_id} has {seq.num_tokens} tokens, cannot cache {len(token_ids)}"
            )
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        num_full = len(token_ids) // bs
        if num_full <= seq.num_cached_blocks:
            return []
        seq.know(token_ids, num_full * bs)
        if seq.family is not None:
            num_full = insertable_len(self.tree, self._seqs, seq, seq.key, num_full * bs, bs) // bs
            if num_full <= seq.num_cached_blocks:
                return []
        table = seq.block_ids
        result = self._insert(seq, num_full * bs, table[:num_full])
        # its first result.num_blocks blocks are now on its lock path: from here on it holds
        # them through the lock; it drops its own references to them (a duplicate's own copy
        # is freed), except to those the tree took over
        first, end = seq.num_cached_blocks, result.num_blocks
        replaced = result.duplicates
        tree_blocks = dict(replaced)
        allocator = self.allocator
        for index in range(first, end - result.num_new_blocks):
            own = table[index]
            table[index] = tree_blocks.get(index, own)
            allocator.decref(own)
        seq.num_cached_blocks = end
        if result.num_new_blocks and seq.family is not None:
            relock_relatives(self.tree, self._seqs, seq_id, seq, result, self.block_size)
        return replaced

    def free(self, seq_id: SeqId, token_ids: Sequence[int] | None = None) -> None:
        """End a sequence. With `token_ids` (its computed tokens), first insert them,
        the partial tail block included (as a partial leaf). Then release its lock and its
        references, tail first, so the tail is evicted before the prefix.
        Raises UnknownSequenceError, InvalidTokensError if token_ids is longer than the
        sequence.
        """
        seq = self._get(seq_id)
        if token_ids is not None and len(token_ids) > seq.num_tokens:
            raise InvalidTokensError(
                f"sequence {seq_id} has {seq.num_tokens} tokens, cannot cache {len(token_ids)}"
            )
        num_tokens = len(token_ids) if token_ids is not None else 0
        if token_ids and seq.family is not None and self.enable_prefix_caching:
            # a forked sequence may insert fewer (never none: see insertable_len); its tokens
            # are packed once, into its key, for the insertion below too
            seq.know(token_ids, num_tokens)
            num_tokens = insertable_len(
                self.tree, self._seqs, seq, seq.key, num_tokens, self.block_size
            )
        del self._seqs[seq_id]
        tree = self.tree
        start = seq.resume_point(self.block_size, num_tokens)
        if seq.lock_node is not None:
            tree.unlock(seq.lock_node, seq.uses_lock_node(self.block_size))
        table = seq.block_ids
        own = table[seq.num_cached_blocks :]  # the rest it holds through its lock
        if token_ids and self.enable_prefix_caching:
            base = start.end if start is not None else 0
            num_blocks = -(-num_tokens // self.block_size)
            result = tree.insert_key(
                seq.packed(token_ids, base, num_tokens),
                table[base // self.block_size : num_blocks],
                seq.salt,
                start,
                transfer=True,
            )
            if result.num_new_blocks:
                if seq.family is not None:
                    relock_relatives(self.tree, self._seqs, seq_id, seq, result, self.block_size)
                # the tree took over our references to those blocks: release the others
                taken_from = result.num_blocks - result.num_new_blocks
                own = table[seq.num_cached_blocks : taken_from] + table[result.num_blocks :]
        family = seq.family
        if family is not None:
            family.discard(seq_id)
            if len(family) == 1:
                self._seqs[next(iter(family))].family = None
        self.allocator.decref_all(reversed(own))

    # ------------------------------------------------------------------- the cache itself

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` unlocked cached blocks, LRU first; returns how many."""
        return self.tree.evict(num_blocks)

    def reset_prefix_cache(self) -> int:
        """Evict every unlocked cached prefix; returns how many blocks were freed."""
        return self.tree.evict(self.tree.num_evictable_blocks)

    def stats(self) -> KVCacheStats:
        """Counts now and cumulative counters; O(total table length)."""
        bs = self.block_size
        live: dict[BlockId, int] = {}
        for seq in self._seqs.values():
            num_tokens = seq.num_tokens
            for index, block_id in enumerate(seq.block_ids):
                in_block = min(bs, num_tokens - index * bs)
                if live.get(block_id, 0) < in_block:
                    live[block_id] = in_block
        num_referenced = len(live)
        num_free = self.allocator.num_free_blocks
        allocated = num_referenced * bs
        live_tokens = sum(live.values())
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=num_free,
            num_cached_blocks=self.num_blocks - num_free - num_referenced,
            num_referenced_blocks=num_referenced,
            hit_tokens=self._hit_tokens,
            queried_tokens=self._queried_tokens,
            allocated_slots=allocated,
            live_tokens=live_tokens,
            kv_waste_tokens=allocated - live_tokens,
            evicted_blocks=self.tree.num_evicted_blocks,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError, naming the broken rule, unless every invariant holds:
        free + cached + referenced == total; refcounts = holders, none negative; the free
        list = the blocks at zero; lock counts = live sequences' locks; every tree block a
        sequence uses lies on its lock path at its own position; tree shape (tokens vs
        blocks, keys, partial blocks only at leaf tails, LRU = unlocked leaves)."""
        check_manager_invariants(self, self._seqs)

    # --------------------------------------------------------------------------- helpers

    def _get(self, seq_id: SeqId) -> SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id} is not live") from None

    def _insert(
        self, seq: SequenceBlocks, num_tokens: int, block_ids: list[BlockId]
    ) -> InsertResult:
        """Insert the sequence's first `num_tokens` (packed in its key: see
        `SequenceBlocks.know`), moving its lock to the deepest node holding its tokens.

        The old lock is released first so that the insertion may replace a partial leaf the
        sequence was copying from (nothing is evicted meanwhile). The insertion takes the
        lock on the node it ends at, unless the old lock was deeper on that path (a forked
        relative's insertion moved it there): then that one is kept.
        """
        tree = self.tree
        old = seq.lock_node
        start = seq.resume_point(self.block_size, num_tokens)
        if old is not None:
            tree.unlock(old, seq.uses_lock_node(self.block_size))
        base = start.end if start is not None else 0
        result = tree.insert_key(
            seq.key[base * TOKEN_BYTES : num_tokens * TOKEN_BYTES],
            block_ids[base // self.block_size :],
            seq.salt,
            start,
            transfer=True,
            lock=True,
        )
        node = result.node
        if (
            old is not None
            and old is not node
            and old.parent is not None
            and (node is None or old.is_below(node))
        ):
            tree.lock(old)
            if node is not None:
                tree.unlock(node)  # its path is in use: stamping it so is right
            node = old
        seq.lock_node = node
        return result

    def _grow_slow(self, seq: SequenceBlocks, num_tokens: int) -> Growth | None:
        if num_tokens <= 0:
            if num_tokens < 0:
                raise InvalidTokensError(f"cannot grow by {num_tokens} tokens")
            return NO_GROWTH
        bs = self.block_size
        table = seq.block_ids
        new_len = seq.num_tokens + num_tokens
        num_new = -(-new_len // bs) - len(table)
        if seq.writable_len == len(table) * bs:  # nothing shared: new blocks only
            if num_new == 1:  # decoding: one block every block_size tokens
                block_id = self.allocator.allocate_one()
                if block_id is None:
                    if not self._evict_for(1):
                        return None
                    block_id = self.allocator.allocate_one()
                    assert block_id is not None
                table.append(block_id)
                new_ids: tuple[BlockId, ...] = (block_id,)
            else:
                new = self.allocator.allocate(num_new)
                if new is None:
                    if not self._evict_for(num_new):
                        return None
                    new = self.allocator.allocate(num_new)
                    assert new is not None
                table.extend(new)
                new_ids = tuple(new)
            seq.num_tokens = new_len
            seq.writable_len = len(table) * bs
            # tuple.__new__ skips the NamedTuple constructor's Python frame (a hot path)
            return tuple.__new__(Growth, (new_ids, (), ()))
        return grow_forked(seq, new_len, max(0, num_new), bs, self.allocator, self._evict_for)

    def _evict_for(self, num_blocks: int) -> bool:
        """Make `num_blocks` blocks free by evicting (a batch at least), or change nothing and
        return False when even evicting everything evictable would not."""
        num_free = self.allocator.num_free_blocks
        if num_blocks > num_free + self.tree.num_evictable_blocks:
            return False
        self.tree.evict(max(num_blocks - num_free, self._eviction_batch))
        return True
