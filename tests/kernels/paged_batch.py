"""Random paged batches for kernel tests: shuffled block ids, garbage everywhere else.

Every block of the cache is random, and the padding entries of each block-table row point
at other sequences' blocks, so a kernel that reads past a context or a table row gets
wrong numbers rather than zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, a column slice of a wider table
    seq_lens: torch.Tensor  # (num_seqs,) int32
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    query: torch.Tensor  # (num_tokens, num_heads, head_dim), rows strided as in a fused QKV


def make_paged_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Sequence i has `seq_lens[i]` tokens in the cache, the last `q_lens[i]` of them new."""
    gen = torch.Generator(device=device).manual_seed(seed)
    on_device = dict(generator=gen, device=device)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one spare column of padding for everyone
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, **on_device)
    table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks + 2), **on_device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = block_ids[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, **on_device)
    v_cache = torch.randn(shape, dtype=dtype, **on_device)
    num_tokens = sum(q_lens)
    num_heads = num_kv_heads * group
    # (num_tokens, num_heads + 2 * num_kv_heads, head_dim) like a fused QKV projection
    fused = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), dtype=dtype,
                        **on_device)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    int32 = dict(dtype=torch.int32, device=device)
    return PagedBatch(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=table.to(torch.int32)[:, :max_blocks],
        seq_lens=torch.tensor(list(seq_lens), **int32),
        query_start_loc=torch.tensor(starts, **int32),
        query=fused[:, :num_heads],
    )
