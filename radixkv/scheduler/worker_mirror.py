"""What the worker knows of each sequence, so a step sends only diffs.

A sequence reaches the worker once (`NewSeq`, with its whole block table); afterwards the
worker hears only block-table updates, block copies and the ids to forget.

A step's copies are all made before its tokens are computed, reading every source first.
Copies decided during scheduling stay even if their sequence is preempted in the same step
(its blocks may be cached by then, and must hold what the copy brings). So a block can be
copied into twice (freed and handed out again): the later copy wins. And a block copied into
can be copied from: the later copy then reads the earlier one's source.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.ipc.protocol import BlockUpdate, NewSeq
from radixkv.kvcache import BlockId, SeqId
from radixkv.scheduler.request import Sequence

BlockCopy = tuple[int, int]


class WorkerMirror:
    def __init__(self) -> None:
        self._tables: dict[SeqId, list[BlockId]] = {}
        self._to_forget: list[int] = []
        self._copies: list[BlockCopy] = []  # in the order they were decided

    def knows(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def add_copies(self, copies: Iterable[BlockCopy]) -> None:
        """Copies the worker must make before this step's computation."""
        self._copies.extend(copies)

    def new_seq(self, seq: Sequence, table: list[BlockId], history: list[int]) -> NewSeq:
        """The message that introduces `seq` (whose history is `history`) to the worker."""
        assert seq.seq_id not in self._tables, f"seq {seq.seq_id} sent twice"
        self._tables[seq.seq_id] = list(table)
        return NewSeq(
            seq_id=seq.seq_id, block_ids=[int(b) for b in table], token_ids=history,
            num_prompt_tokens=seq.num_prompt_tokens, spec=seq.spec,
        )

    def updates(self, seq: Sequence, table: list[BlockId]) -> list[BlockUpdate]:
        """The block-table diff since the worker last heard of `seq` (appends, replaced
        blocks after copy-on-write or deduplication). A running table never shrinks."""
        sent = self._tables[seq.seq_id]
        if table == sent:
            return []
        assert len(table) >= len(sent), "a running sequence's block table never shrinks"
        start = next(
            (i for i, (a, b) in enumerate(zip(table, sent, strict=False)) if a != b), len(sent)
        )
        self._tables[seq.seq_id] = list(table)
        return [BlockUpdate(seq_id=seq.seq_id, start=start,
                            block_ids=[int(b) for b in table[start:]])]

    def forget(self, seq: Sequence) -> None:
        """`seq` released its blocks: if the worker knows it, it forgets it next step."""
        if self._tables.pop(seq.seq_id, None) is not None:
            self._to_forget.append(seq.seq_id)

    def take_copies(self) -> list[BlockCopy]:
        """The step's copies as one parallel batch: each destination once (its last copy),
        each source as it was when the step began."""
        origin: dict[int, int] = {}  # block -> the block whose content it receives
        for src, dst in self._copies:
            origin[dst] = origin.get(src, src)
        self._copies = []
        return [(src, dst) for dst, src in origin.items() if src != dst]

    def take_forgotten(self) -> list[int]:
        forgotten, self._to_forget = self._to_forget, []
        return forgotten
