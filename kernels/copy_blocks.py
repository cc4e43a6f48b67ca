"""Copy whole blocks in every layer, K and V: the copy of copy-on-write.

    kv_cache      (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    block_pairs   (num_pairs, 2)   rows of (src block id, dst block id)

One program per (pair, layer, K or V) streams the block's block_size * num_kv_heads *
head_dim elements, which are contiguous, in chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .store_kv import check_float, check_index, check_runnable

_CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(  # type: ignore[no-untyped-def]
    cache_ptr, pairs_ptr,
    stride_layer, stride_kv, stride_block,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer_kv = tl.program_id(1)
    src = tl.load(pairs_ptr + pair * 2).to(tl.int64)
    dst = tl.load(pairs_ptr + pair * 2 + 1).to(tl.int64)
    base = (layer_kv // 2).to(tl.int64) * stride_layer + (layer_kv % 2).to(tl.int64) * stride_kv
    src_ptr = cache_ptr + base + src * stride_block
    dst_ptr = cache_ptr + base + dst * stride_block
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_blocks(kv_cache: torch.Tensor, block_pairs: torch.Tensor) -> None:
    """Copy block `src` to block `dst` for every (src, dst) row, in every layer, K and V.

    `block_pairs` may live on the CPU or on the cache's device. Copies run in parallel, so
    no block may be both a source and a destination and no destination may repeat (a
    copy-on-write always targets fresh blocks); the ids are checked, which reads them on the
    host. Raises TypeError for wrong dtypes and ValueError for wrong shapes, strides,
    devices or block ids.
    """
    check_float("kv_cache", kv_cache)
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), "
            f"got shape {tuple(kv_cache.shape)}"
        )
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    inner = (num_kv_heads * head_dim, head_dim, 1)
    if tuple(kv_cache.stride()[3:]) != inner:
        raise ValueError(
            "kv_cache must be contiguous within a block (block_size, num_kv_heads, head_dim), "
            f"got strides {kv_cache.stride()}"
        )
    check_index("block_pairs", block_pairs, rank=2)
    if block_pairs.shape[1] != 2:
        raise ValueError(f"block_pairs must be (num_pairs, 2), got {tuple(block_pairs.shape)}")
    if block_pairs.device not in (kv_cache.device, torch.device("cpu")):
        raise ValueError(
            f"block_pairs is on {block_pairs.device} but kv_cache on {kv_cache.device}"
        )
    if block_pairs.shape[0] == 0:
        return
    check_runnable(_copy_blocks_kernel, kv_cache.device)
    _check_pairs(block_pairs.tolist(), num_blocks)
    pairs = block_pairs.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    _copy_blocks_kernel[(pairs.shape[0], num_layers * 2)](
        kv_cache, pairs,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_NUMEL=block_size * num_kv_heads * head_dim, CHUNK=_CHUNK,
    )


def _check_pairs(pairs: list[list[int]], num_blocks: int) -> None:
    sources = {src for src, _ in pairs}
    destinations: set[int] = set()
    for src, dst in pairs:
        for block_id in (src, dst):
            if not 0 <= block_id < num_blocks:
                raise ValueError(f"block id {block_id} is outside the cache's {num_blocks} blocks")
        if dst in destinations:
            raise ValueError(f"block {dst} is the destination of two copies")
        if dst in sources:
            raise ValueError(f"block {dst} is both a source and a destination of one copy step")
        destinations.add(dst)
