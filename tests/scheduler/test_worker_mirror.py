"""WorkerMirror: what a step tells the worker about tables and copies."""

from __future__ import annotations

from radixkv.ipc.protocol import BlockUpdate, SamplingSpec
from radixkv.kvcache import BlockId, SeqId
from radixkv.scheduler.request import Sequence
from radixkv.scheduler.worker_mirror import WorkerMirror


def seq(seq_id: int) -> Sequence:
    return Sequence(SeqId(seq_id), 0, [1, 2, 3], 3, SamplingSpec())


def blocks(*ids: int) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def test_copies_become_one_parallel_batch() -> None:
    mirror = WorkerMirror()
    mirror.add_copies([(3, 5)])        # a copy-on-write into 5
    mirror.add_copies([(5, 9)])        # then 5 copied on: 9 receives what 5 receives
    mirror.add_copies([(1, 7), (2, 7)])  # 7 freed and handed out again: the later copy wins
    mirror.add_copies([(4, 4)])        # a no-op
    assert mirror.take_copies() == [(3, 5), (3, 9), (2, 7)]
    assert mirror.take_copies() == []


def test_a_sequence_is_sent_once_then_diffs() -> None:
    mirror = WorkerMirror()
    a = seq(1)
    assert not mirror.knows(a)
    message = mirror.new_seq(a, blocks(4, 5), [1, 2])
    assert message.block_ids == [4, 5] and message.token_ids == [1, 2]
    assert mirror.knows(a)
    assert mirror.updates(a, blocks(4, 5)) == []
    assert mirror.updates(a, blocks(4, 5, 8)) == [BlockUpdate(1, 2, [8])]
    assert mirror.updates(a, blocks(4, 6, 8)) == [BlockUpdate(1, 1, [6, 8])]  # dedupe swap
    mirror.forget(a)
    mirror.forget(seq(2))  # never sent: nothing to forget
    assert mirror.take_forgotten() == [1]
    assert mirror.take_forgotten() == []
    assert not mirror.knows(a)
