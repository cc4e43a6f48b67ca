"""Decode attention: one query token per sequence over its whole paged context.

Decode reads every cached K/V byte once and does little arithmetic on it, so the kernel is
built for memory bandwidth:

- One program per (sequence, KV head, split). The GROUP query heads that share a KV head
  are processed together as the rows of one matrix, so each KV block is read once per group,
  not once per query head. Rows are padded to 16 for tl.dot; padding rows compute garbage
  that is never stored.
- The context is walked in tiles of whole blocks, each token's row found through the block
  table:

      tokens      0 ..... 15 | 16 .... 31 | 32 .... 47 | 48 .. 52     seq_len 53
      block id        7      |     2      |     9      |    4         block_size 16
      tile_n 32   |<------ tile 0 ------->|<------- tile 1 ------>|    tail masked

- Split-KV (flash decoding): when the batch has too few (sequence, KV head) pairs to fill the
  device, each context is cut into `num_splits` ranges of whole tiles. Each range writes a
  partial output normalised by its own softmax sum, plus that sum's log (base 2); a second
  kernel merges the ranges of every head. Empty ranges write a log-sum of -inf and weigh 0.

Softmax runs online in base 2 (exp2) with fp32 accumulators whatever the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .store_kv import (
    check_index,
    check_kv_cache,
    check_rows,
    check_runnable,
    check_same_device,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# A split shorter than this spends more on its partial write and merge than it saves.
MIN_TOKENS_PER_SPLIT = 256


@dataclass(frozen=True)
class DecodeTiling:
    """How the decode kernel is launched: context tokens per loop step, warps, pipeline depth."""

    tile_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.tile_n < 16 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= 16, got {self.tile_n}")


def default_tiling(device: torch.device, block_size: int) -> DecodeTiling:
    """Tiles of at least 64 tokens on a GPU; larger on the interpreter, whose cost is per op."""
    floor = 64 if device.type == "cuda" else 128
    return DecodeTiling(tile_n=max(floor, triton.next_power_of_2(block_size)))


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int
) -> int:
    """Splits per context so that about four programs per SM are in flight.

    A power of two (each value compiles once), at most MAX_SPLITS, and no split shorter than
    MIN_TOKENS_PER_SPLIT tokens.
    """
    programs = num_seqs * num_kv_heads
    target = 4 * num_sms
    if programs == 0 or programs >= target:
        return 1
    wanted = triton.cdiv(target, programs)
    wanted = min(wanted, max_context_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    if wanted <= 1:
        return 1
    return 1 << (wanted.bit_length() - 1)


def dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 caches (tf32 would lose bits); half dtypes ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """The checks decode and prefill share; returns the number of query heads per KV head."""
    check_kv_cache(k_cache, v_cache)
    check_rows("query", query)
    check_index("block_tables", block_tables, rank=2)
    check_index("seq_lens", seq_lens, rank=1)
    check_same_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=seq_lens,
    )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads"
        )
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but seq_lens "
            f"{seq_lens.shape[0]} sequences"
        )
    return num_heads // num_kv_heads


@triton.jit
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale_log2,
    stride_q_s, stride_q_h,
    stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h,
    stride_table,
    stride_o_s, stride_o_h, stride_o_split,
    stride_lse_s, stride_lse_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tokens_per_split = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + TILE_N - 1) // TILE_N * TILE_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + rows  # (GROUP_PAD,)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    ).to(k_ptr.dtype.element_ty)  # (GROUP_PAD, HEAD_DIM_PAD)

    table = table_ptr + seq.to(tl.int64) * stride_table
    k_head = k_ptr + kv_head * stride_k_h
    v_head = v_ptr + kv_head * stride_v_h
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < end
        block_ids = tl.load(table + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        in_block = tokens % BLOCK_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
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
        # (GROUP_PAD, TILE_N)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = l_i > 0.0
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    out_rows = out_ptr + seq.to(tl.int64) * stride_o_s + split * stride_o_split
    tl.store(
        out_rows + heads[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :],
    )
    if NUM_SPLITS > 1:
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(
            lse_ptr + seq * stride_lse_s + heads * stride_lse_h + split, lse, mask=row_mask
        )


@triton.jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    partial_ptr, lse_ptr, out_ptr,
    stride_p_s, stride_p_h, stride_p_split,
    stride_lse_s, stride_lse_h,
    stride_o_s, stride_o_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < NUM_SPLITS
    lse = tl.load(
        lse_ptr + seq * stride_lse_s + head * stride_lse_h + splits,
        mask=split_mask, other=float("-inf"),
    )
    lse_max = tl.max(lse, 0)
    weights = tl.where(lse > float("-inf"), tl.exp2(lse - lse_max), 0.0)  # (SPLITS_PAD,)
    partial = tl.load(
        partial_ptr + seq * stride_p_s + head * stride_p_h + splits[:, None] * stride_p_split
        + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0,
    )  # (SPLITS_PAD, HEAD_DIM_PAD)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_s + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM,
    )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tiling: DecodeTiling | None = None,
) -> torch.Tensor:
    """One query token per sequence, (num_seqs, num_heads, head_dim), over its whole context.

    `num_splits` cuts every context into that many ranges merged by a second kernel; None
    picks it from the batch size and the widest context the block table can hold (no
    device sync). Every `seq_lens` entry must be >= 1 and covered by its block table row.
    Raises TypeError for wrong dtypes and ValueError for wrong shapes, strides or devices.
    """
    group = check_attention_inputs(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode takes one query row per sequence: {num_seqs} rows, "
            f"{seq_lens.shape[0]} sequences"
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    check_runnable(_paged_decode_kernel, query.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if tiling is None:
        tiling = default_tiling(query.device, block_size)
    if num_splits is None:
        num_splits = _auto_splits(query.device, num_seqs, num_kv_heads, block_tables, block_size)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")

    if num_splits == 1:
        partial, lse = out, out  # lse is never touched with one split
        stride_p = (out.stride(0), out.stride(1), 0)
        stride_lse = (0, 0)
    else:
        partial = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                          device=query.device)
        stride_p = (partial.stride(0), partial.stride(1), partial.stride(2))
        stride_lse = (lse.stride(0), lse.stride(1))

    head_dim_pad = triton.next_power_of_2(head_dim)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, partial, lse,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *stride_p, *stride_lse,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=tiling.tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial, lse, out,
            *stride_p, *stride_lse,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out


def _auto_splits(
    device: torch.device, num_seqs: int, num_kv_heads: int, block_tables: torch.Tensor,
    block_size: int,
) -> int:
    if device.type != "cuda":
        return 1  # the interpreter pays per program; tests ask for splits explicitly
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    max_context_len = block_tables.shape[1] * block_size
    return choose_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms)
