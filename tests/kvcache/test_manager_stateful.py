"""A hypothesis state machine over the manager with a shadow model of every block's contents.

The shadow plays the worker: it applies block copies, writes each sequence's tokens into the
slots of its block table as soon as they have slots, and resets fresh blocks to garbage. After
every step: the manager's invariants hold, every live sequence reads back exactly its tokens
through its table (so no write ever hit a block someone else reads), every tree node's tokens
are what its blocks hold under its salt (so no hit can return other tokens), and no free block
is referenced.
"""

from __future__ import annotations

import random
from array import array

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.kvcache import BlockId, Growth, KVCacheManager, Salt, SeqId

BLOCK_SIZE = 4
NUM_BLOCKS = 32
SALTS: list[Salt] = [None, "a", "b"]
_rng = random.Random(0)
BASES = [[_rng.randrange(3) for _ in range(26)] for _ in range(3)]
tokens_st = st.lists(st.integers(0, 2), max_size=6)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[SeqId, list[int]] = {}
        self.salts: dict[SeqId, Salt] = {}
        self.tables: dict[SeqId, list[BlockId]] = {}
        self.content: dict[BlockId, list[int | None]] = {}
        self.block_salt: dict[BlockId, Salt] = {}
        self.next_id = 0

    # ------------------------------------------------------------------ the shadow worker

    def fresh(self, block_id: BlockId, salt: Salt) -> None:
        self.content[block_id] = [None] * BLOCK_SIZE
        self.block_salt[block_id] = salt

    def copy(self, src: BlockId, dst: BlockId) -> None:
        self.content[dst] = list(self.content[src])
        self.block_salt[dst] = self.block_salt[src]

    def write(self, seq_id: SeqId, start: int) -> None:
        table, tokens = self.tables[seq_id], self.tokens[seq_id]
        for pos in range(start, len(tokens)):
            self.content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = tokens[pos]

    def snapshot(self) -> object:
        kv = self.kv
        return (
            kv.allocator.free_block_ids(),
            [kv.allocator.refcount(BlockId(i)) for i in range(NUM_BLOCKS)],
            [
                (salt, n.token_ids, n.block_ids, n.lock_count, n.stamp)
                for salt in kv.tree.salts()
                for n in kv.tree.nodes(salt)
            ],
            [n.stamp for n in kv.tree.lru_order()],
            kv.stats(),
            {seq_id: (kv.block_ids(seq_id), kv.num_tokens(seq_id)) for seq_id in self.tables},
        )

    def pick(self, data: st.DataObject) -> SeqId:
        return data.draw(st.sampled_from(sorted(self.tables)))

    # ------------------------------------------------------------------------------ rules

    @rule(
        salt=st.sampled_from(SALTS),
        base=st.integers(0, len(BASES) - 1),
        cut=st.integers(0, 26),
        tail=tokens_st,
        packed=st.booleans(),
    )
    def admit(self, salt: Salt, base: int, cut: int, tail: list[int], packed: bool) -> None:
        self.admit_prompt(salt, BASES[base][:cut] + tail, packed)

    @rule(salt=st.sampled_from(SALTS), base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 26))
    def admit_twice(self, salt: Salt, base: int, cut: int) -> None:
        """Two requests with one prompt, both computing it before either caches it."""
        self.admit_prompt(salt, BASES[base][:cut] + [0])
        self.admit_prompt(salt, BASES[base][:cut] + [0])

    def admit_prompt(self, salt: Salt, prompt: list[int], packed: bool = False) -> None:
        """Admit `prompt` (passed as array("I") when `packed`) and play the worker."""
        if not prompt:
            return
        seq_id = SeqId(self.next_id)
        self.next_id += 1
        peek = self.kv.peek_prefix(prompt, salt)
        before = self.snapshot()
        admission = self.kv.admit(seq_id, array("I", prompt) if packed else prompt, salt)
        if admission is None:
            assert self.snapshot() == before, "a failed admit changed something"
            event("admit: no blocks")
            return
        cached = admission.num_cached_tokens
        assert cached == peek and cached < len(prompt)
        table = list(admission.block_ids)
        assert len(table) == -(-len(prompt) // BLOCK_SIZE)
        num_shared = cached // BLOCK_SIZE
        for block_id in table[:num_shared]:
            assert self.block_salt[block_id] == salt, "a hit across salts"
        for block_id in table[num_shared:]:
            self.fresh(block_id, salt)
        assert len(admission.block_copies) == (1 if cached % BLOCK_SIZE else 0)
        event("admit: partial-block hit" if cached % BLOCK_SIZE else "admit: block-aligned hit")
        for src, dst in admission.block_copies:
            assert dst == table[num_shared]
            assert self.block_salt[src] == salt, "a partial hit across salts"
            self.copy(src, dst)
        for pos in range(cached):  # no false hit: the cached tokens are the prompt's
            assert self.content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == prompt[pos]
        self.tables[seq_id], self.tokens[seq_id], self.salts[seq_id] = table, prompt, salt
        self.write(seq_id, cached)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), num_tokens=st.integers(0, 6), new=tokens_st)
    def grow(self, data: st.DataObject, num_tokens: int, new: list[int]) -> None:
        seq_id = self.pick(data)
        before = self.snapshot()
        growth = self.kv.grow(seq_id, num_tokens)
        if growth is None:
            assert self.snapshot() == before, "a failed grow changed something"
            event("grow: no blocks")
            return
        self.apply_growth(seq_id, growth, (new * num_tokens + [0] * num_tokens)[:num_tokens])

    def apply_growth(self, seq_id: SeqId, growth: Growth, new: list[int]) -> None:
        """Play the worker for a grow that appended `new` tokens."""
        if growth.replaced:
            event("grow: copy-on-write")
        table = self.tables[seq_id]
        copied = {dst for _, dst in growth.block_copies}
        for src, dst in growth.block_copies:
            self.copy(src, dst)
        for index, block_id in growth.replaced:
            if block_id not in copied:
                self.fresh(block_id, self.salts[seq_id])
            table[index] = block_id
        for block_id in growth.new_block_ids:
            self.fresh(block_id, self.salts[seq_id])
            table.append(block_id)
        start = len(self.tokens[seq_id])
        self.tokens[seq_id] += new
        self.write(seq_id, start)

    @precondition(lambda self: self.tables)
    @rule(new=st.integers(0, 2))
    def decode_step(self, new: int) -> None:
        """Every live sequence grows by one token in one `grow_each` call."""
        seq_ids = sorted(self.tables)
        for seq_id, growth in zip(seq_ids, self.kv.grow_each(seq_ids, 1), strict=True):
            if growth is None:
                event("decode_step: no block for one")
                continue
            self.apply_growth(seq_id, growth, [new])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data)
        child = SeqId(self.next_id)
        self.next_id += 1
        self.kv.fork(parent, child)
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), fraction=st.floats(0, 1), packed=st.booleans())
    def cache(self, data: st.DataObject, fraction: float, packed: bool) -> None:
        seq_id = self.pick(data)
        computed = self.tokens[seq_id][: round(fraction * len(self.tokens[seq_id]))]
        replaced = self.kv.cache(seq_id, array("I", computed) if packed else computed)
        if replaced:
            event("cache: switched to the tree's blocks")
        for index, block_id in replaced:
            self.tables[seq_id][index] = block_id

    @precondition(lambda self: self.tables)
    @rule(
        data=st.data(), with_tokens=st.booleans(), fraction=st.floats(0, 1), packed=st.booleans()
    )
    def free(self, data: st.DataObject, with_tokens: bool, fraction: float, packed: bool) -> None:
        seq_id = self.pick(data)
        tokens = self.tokens.pop(seq_id)
        self.tables.pop(seq_id)
        self.salts.pop(seq_id)
        computed = tokens[: round(fraction * len(tokens))]
        if not with_tokens:
            self.kv.free(seq_id)
        else:
            self.kv.free(seq_id, array("I", computed) if packed else computed)

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        available = self.kv.num_available_blocks()
        free = self.kv.num_free_blocks
        num_freed = self.kv.evict(num_blocks)
        assert num_freed == min(num_blocks, available - free)
        assert self.kv.num_free_blocks == free + num_freed

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        assert self.kv.num_available_blocks() == self.kv.num_free_blocks

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def manager_invariants_hold(self) -> None:
        self.kv.check_invariants()

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        for seq_id, tokens in self.tokens.items():
            table = self.tables[seq_id]
            assert self.kv.block_ids(seq_id) == table
            assert self.kv.num_tokens(seq_id) == len(tokens)
            for block_id in table:
                assert self.block_salt[block_id] == self.salts[seq_id]
            for pos, token in enumerate(tokens):
                assert self.content[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == token

    @invariant()
    def every_cached_token_is_in_its_block(self) -> None:
        tree = self.kv.tree
        for salt in tree.salts():
            for node in tree.nodes(salt):
                for offset, token in enumerate(node.token_ids):
                    block_id = node.block_ids[offset // BLOCK_SIZE]
                    assert self.content[block_id][(node.start + offset) % BLOCK_SIZE] == token
                    assert self.block_salt[block_id] == salt

    @invariant()
    def no_free_block_is_referenced(self) -> None:
        free = set(self.kv.allocator.free_block_ids())
        for table in self.tables.values():
            assert not free.intersection(table)
        for salt in self.kv.tree.salts():
            for node in self.kv.tree.nodes(salt):
                assert not free.intersection(node.block_ids)


KVCacheMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
