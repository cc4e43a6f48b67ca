"""The message one scheduled step sends the worker."""

from __future__ import annotations

from radixkv.ipc.protocol import Chunk, StepInput
from radixkv.kvcache import KVCacheManager
from radixkv.scheduler.prompt_logprobs import prompt_logprob_targets
from radixkv.scheduler.request import Request, Sequence
from radixkv.scheduler.worker_mirror import WorkerMirror

Inflight = tuple[Request, Sequence, int, list[Sequence]]
"""A scheduled chunk: its request, its sequence, how many tokens, and the sequences forked
from it once the chunk's last token is sampled (parallel samples sharing the prompt)."""


def build_step_input(
    step_id: int, inflight: list[Inflight], kv: KVCacheManager, mirror: WorkerMirror
) -> StepInput:
    """One chunk per scheduled sequence, plus what the worker does not know yet of their
    block tables (new sequences whole, known ones as diffs) and this step's copies."""
    chunks, new_seqs, updates = [], [], []
    for request, seq, num_tokens, fanout in inflight:
        start = seq.num_computed
        table = kv.block_ids(seq.seq_id)
        if mirror.knows(seq):
            updates.extend(mirror.updates(seq, table))
        else:
            new_seqs.append(mirror.new_seq(seq, table, seq.token_ids[:start]))
        for child in fanout:
            end = start + num_tokens
            new_seqs.append(
                mirror.new_seq(child, kv.block_ids(child.seq_id), child.token_ids[:end])
            )
        chunks.append(
            Chunk(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids[start : start + num_tokens],
                start_pos=start,
                sample=start + num_tokens == len(seq.token_ids),
                fanout_seq_ids=[c.seq_id for c in fanout],
                store_from=seq.store_from if seq.store_from > start else None,
                **prompt_logprob_targets(request, seq, start, num_tokens),
            )
        )
    return StepInput(
        step_id=step_id,
        chunks=chunks,
        new_seqs=new_seqs,
        block_updates=updates,
        block_copies=mirror.take_copies(),
        finished_seq_ids=mirror.take_forgotten(),
    )
