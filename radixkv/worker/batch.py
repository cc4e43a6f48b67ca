"""Turn one step's scheduled chunks into the model's flat tensors and attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.worker.attention import AttentionMetadata


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence computed this step.

    `start_pos` is how many of its tokens already have K/V in the pool; the chunk's tokens
    take positions start_pos .. start_pos + len(token_ids) - 1. `block_table` must cover them.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    store_from: int = 0  # positions before this keep the K/V already in the pool


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    meta: AttentionMetadata
    last_token_rows: torch.Tensor  # (num_chunks,) int64: each chunk's last row, input order


def build_model_inputs(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device,
    scratch_block: int | None = None,
) -> ModelInputs:
    """Lay chunks out decodes first (as `AttentionMetadata` wants), remembering input order.

    The K/V of positions before a chunk's `store_from` go to `scratch_block`."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
    num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    last_rows = [0] * len(chunks)
    max_blocks = max(len(c.block_table) for c in chunks)
    tables: list[list[int]] = []
    for i in order:
        chunk = chunks[i]
        num_new = len(chunk.token_ids)
        if num_new == 0:
            raise ValueError("a chunk must compute at least one token")
        end_pos = chunk.start_pos + num_new
        if (end_pos + block_size - 1) // block_size > len(chunk.block_table):
            raise ValueError(
                f"block table of {len(chunk.block_table)} blocks cannot hold {end_pos} tokens"
            )
        input_ids.extend(chunk.token_ids)
        for pos in range(chunk.start_pos, end_pos):
            positions.append(pos)
            if pos < chunk.store_from:
                assert scratch_block is not None, "discarded K/V needs a scratch block"
                slots.append(scratch_block * block_size + pos % block_size)
            else:
                slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end_pos)
        query_start_loc.append(query_start_loc[-1] + num_new)
        last_rows[i] = query_start_loc[-1] - 1
        tables.append(list(chunk.block_table) + [0] * (max_blocks - len(chunk.block_table)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        num_decode_seqs=num_decodes,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        last_token_rows=torch.tensor(last_rows, dtype=torch.int64, device=device),
    )
