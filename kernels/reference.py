"""Pure-torch paged-attention ops: the ground truth for the Triton kernels and the CPU path.

Layout shared by every op (and by the Triton kernels):

    k_cache, v_cache   (num_blocks, block_size, num_kv_heads, head_dim)   one layer
    kv_cache           (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    slot               block_id * block_size + offset_in_block
    block_tables       (num_seqs, max_blocks_per_seq) int32; entries past a sequence's
                       last block are padding and never read
    seq_lens           (num_seqs,) int32: tokens of context each sequence attends to,
                       the new tokens of this step included

A sequence whose step computes `q_len` new tokens has them at positions
`seq_lens[i] - q_len .. seq_lens[i] - 1`; token at position p attends to positions 0..p.

    block table [7, 2, 5]      block_size 4, seq_len 10, q_len 3
    position    0 1 2 3 | 4 5 6 7 | 8 9
    block       7       | 2       | 5
    query                     ^ ^ ^  (positions 7, 8, 9)

This module never imports radixkv.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` rows (num_tokens, num_kv_heads, head_dim) into their slots."""
    block_size = k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first `seq_len` token rows of one sequence: (seq_len, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # (num_blocks, block_size, H_kv, D)
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, (num_seqs, num_heads, head_dim), over its whole context.

    Batched: every sequence's blocks are gathered up to the longest context and the tail
    is masked, so a batch of decodes is a handful of tensor ops whatever its size.
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :max_blocks].long()
    # (num_seqs, max_blocks * block_size, H_kv, D) -> (num_seqs, H_kv, L, D)
    keys = k_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = positions[None, :] < seq_lens[:, None].to(query.device)  # (num_seqs, L)
    group = num_heads // num_kv_heads
    q = query.view(num_seqs, num_kv_heads, group, head_dim).to(keys.dtype)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[:, None, None, :], scale=scale
    )  # (num_seqs, H_kv, group, D)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A chunk of new query tokens per sequence, flat (num_tokens, num_heads, head_dim).

    Sequence i owns query rows `query_start_loc[i]:query_start_loc[i + 1]`; they attend
    causally to the cached prefix and to themselves (their K/V already stored).
    """
    out = torch.empty_like(query)
    for i, q_start, q_end, seq_len in prefill_spans(query_start_loc, seq_lens):
        keys = gather_context(k_cache, block_tables[i], seq_len).transpose(0, 1)
        values = gather_context(v_cache, block_tables[i], seq_len).transpose(0, 1)
        q = query[q_start:q_end].transpose(0, 1).to(keys.dtype)  # (H, q_len, D)
        if seq_len == q_end - q_start:  # nothing cached before the chunk
            attn = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = prefix_causal_mask(q_end - q_start, seq_len, query.device)
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )  # (H, q_len, D); query head h reads KV head h // (H / H_kv)
        out[q_start:q_end] = attn.transpose(0, 1).to(query.dtype)
    return out


def prefill_spans(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor
) -> Iterator[tuple[int, int, int, int]]:
    """(sequence, first query row, end query row, context length after the chunk) of each
    sequence with a non-empty chunk."""
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        if starts[i + 1] > starts[i]:
            yield i, starts[i], starts[i + 1], seq_len


def prefix_causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """(q_len, seq_len) bool: the chunk's last `q_len` positions of a `seq_len` context each
    see the cached prefix and the chunk up to themselves."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (seq_len - q_len)
    k_pos = torch.arange(seq_len, device=device)[None, :]
    return k_pos <= q_pos


def copy_blocks(kv_cache: torch.Tensor, block_pairs: torch.Tensor) -> None:
    """Copy block `src` to block `dst` for every (src, dst) row, in every layer, K and V.

    All sources are read before any destination is written.
    """
    if block_pairs.numel() == 0:
        return
    src = block_pairs[:, 0].long()
    dst = block_pairs[:, 1].long()
    kv_cache[:, :, dst] = kv_cache[:, :, src]
