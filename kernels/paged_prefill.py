"""Prefill attention: a chunk of new query tokens per sequence over its paged context.

Sequence i owns the flat query rows `query_start_loc[i] : query_start_loc[i + 1]`; their
K/V are already stored, so the cached prefix and the chunk itself are read alike, through
the block table. Token t of a chunk of q_len sits at position `seq_len - q_len + t` and
attends to positions 0 ..= that.

Work is cut into query tiles of BLOCK_Q tokens per (sequence, KV head). The GROUP query
heads of a KV head are folded into the tile's rows (row r = token r // GROUP, head
r % GROUP), so every K/V tile is read once per group. To launch without reading the
lengths on the host, sequence i's tiles get program ids from

    first_tile(i) = query_start_loc[i] // BLOCK_Q + i

which leaves room for cdiv(q_len_i, BLOCK_Q) tiles; a program finds its sequence by
binary search and exits if its tile is past the chunk. The grid is
num_tokens // BLOCK_Q + num_seqs.

Each tile walks the keys in two loops: keys every row may see (before the tile's first
position) without a causal mask, then the diagonal tiles with it.

    keys   0 ............................ kv_end
           | unmasked (whole TILE_Ns) | masked |
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import LOG2E, check_attention_inputs, dot_precision
from .store_kv import check_index, check_runnable, check_same_device


@triton.jit
def _attend_tiles(  # type: ignore[no-untyped-def]
    acc, m_i, l_i, q, k_head, v_head, table, q_pos,
    kv_start, kv_stop, kv_end, scale_log2,
    stride_k_b, stride_k_t, stride_v_b, stride_v_t,
    dims, dim_mask,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for tile_start in range(kv_start, kv_stop, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)
        if CAUSAL:
            key_mask = keys < kv_end
            block_ids = tl.load(table + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
            kv_mask = key_mask[:, None] & dim_mask[None, :]
        else:
            block_ids = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
            kv_mask = tl.full([TILE_N], 1, tl.int1)[:, None] & dim_mask[None, :]
        in_block = keys % BLOCK_SIZE
        k = tl.load(
            k_head + block_ids[:, None] * stride_k_b + in_block[:, None] * stride_k_t
            + dims[None, :],
            mask=kv_mask, other=0.0,
        )  # (TILE_N, HEAD_DIM_PAD)
        v = tl.load(
            v_head + block_ids[:, None] * stride_v_b + in_block[:, None] * stride_v_t
            + dims[None, :],
            mask=kv_mask, other=0.0,
        )
        # (BLOCK_M, TILE_N)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            visible = (keys[None, :] <= q_pos[:, None]) & key_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, table_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs,
    stride_q_t, stride_q_h,
    stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h,
    stride_table,
    stride_o_t, stride_o_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The last sequence whose first tile is at or before this program.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first_tile <= pid, mid, lo)
        hi = tl.where(first_tile <= pid, hi, mid)
    seq = lo
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    tile_first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q

    if tile_first < q_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        context_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = dims < HEAD_DIM
        tokens = tile_first + rows // GROUP  # chunk-local token of each row
        heads = kv_head * GROUP + rows % GROUP
        row_mask = (rows < BLOCK_Q * GROUP) & (tokens < q_len)
        io_mask = row_mask[:, None] & dim_mask[None, :]
        q_rows = (q_start + tokens).to(tl.int64) * stride_q_t + heads * stride_q_h
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)
        q = q.to(k_ptr.dtype.element_ty)  # (BLOCK_M, HEAD_DIM_PAD)
        q_pos = context_len + tokens

        table = table_ptr + seq.to(tl.int64) * stride_table
        k_head = k_ptr + kv_head * stride_k_h
        v_head = v_ptr + kv_head * stride_v_h
        last_token = tl.minimum(tile_first + BLOCK_Q, q_len) - 1
        kv_end = context_len + last_token + 1
        unmasked_end = (context_len + tile_first) // TILE_N * TILE_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_head, v_head, table, q_pos,
            0, unmasked_end, kv_end, scale_log2,
            stride_k_b, stride_k_t, stride_v_b, stride_v_t, dims, dim_mask,
            BLOCK_SIZE, TILE_N, False, DOT_PRECISION,
        )
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_head, v_head, table, q_pos,
            unmasked_end, kv_end, kv_end, scale_log2,
            stride_k_b, stride_k_t, stride_v_b, stride_v_t, dims, dim_mask,
            BLOCK_SIZE, TILE_N, True, DOT_PRECISION,
        )
        out = acc / l_i[:, None]
        o_rows = (q_start + tokens).to(tl.int64) * stride_o_t + heads * stride_o_h
        tl.store(
            out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


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

    Sequence i owns query rows `query_start_loc[i]:query_start_loc[i + 1]` (the last entry
    is num_tokens); they attend causally to the cached prefix and to themselves, whose K/V
    must already be stored. Needs `seq_lens[i] >= q_len_i`. Nothing is read on the host.
    Raises TypeError for wrong dtypes and ValueError for wrong shapes, strides or devices.
    """
    group = check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens)
    check_index("query_start_loc", query_start_loc, rank=1)
    check_same_device(query=query, query_start_loc=query_start_loc)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
            f"got {query_start_loc.shape[0]}"
        )
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_runnable(_paged_prefill_kernel, query.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    on_gpu = query.device.type == "cuda"
    block_m = max(128 if on_gpu else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n = max(64, triton.next_power_of_2(block_size)) if on_gpu else 128
    num_warps = 8 if on_gpu and head_dim > 64 else 4
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps, num_stages=2,
    )
    return out
