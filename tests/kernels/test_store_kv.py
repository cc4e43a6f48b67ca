"""store_kv and copy_blocks against the torch reference (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference


@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (32, 128)])
def test_store_kv_writes_the_same_slots(
    block_size: int, head_dim: int, device: torch.device
) -> None:
    from radixkv.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, num_tokens = 6, 3, 21
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device)
    v_cache = torch.randn(cache_shape, generator=gen).to(device)
    # Rows strided as in a fused QKV projection; slots scattered over shuffled blocks.
    fused = torch.randn((num_tokens, 4 * num_kv_heads, head_dim), generator=gen).to(device)
    key, value = fused[:, :num_kv_heads], fused[:, 2 * num_kv_heads : 3 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    store_kv(key, value, k_cache, v_cache, slots.to(torch.int32))
    reference.store_kv(key, value, expected_k, expected_v, slots)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


def test_store_kv_of_no_tokens_is_a_no_op(device: torch.device) -> None:
    from radixkv.kernels.store_kv import store_kv

    cache = torch.ones((2, 16, 2, 64), device=device)
    rows = torch.zeros((0, 2, 64), device=device)
    store_kv(rows, rows, cache, cache, torch.zeros((0,), dtype=torch.int64, device=device))
    assert bool((cache == 1).all())


def test_copy_blocks_copies_every_layer_k_and_v(device: torch.device) -> None:
    from radixkv.kernels.copy_blocks import copy_blocks

    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn((3, 2, 9, 16, 2, 64), generator=gen).to(device)
    expected = kv_cache.clone()
    # One source copied twice (a fork into two children), pairs given on the CPU.
    pairs = torch.tensor([[4, 0], [7, 2], [4, 8]], dtype=torch.int32)
    copy_blocks(kv_cache, pairs)
    reference.copy_blocks(expected, pairs)
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)
    assert not torch.equal(kv_cache[:, :, 0], kv_cache[:, :, 1])  # untouched blocks differ


def test_copy_blocks_on_a_strided_pool_and_device_pairs(device: torch.device) -> None:
    from radixkv.kernels.copy_blocks import copy_blocks

    gen = torch.Generator().manual_seed(2)
    # Two layers out of a four-layer pool: layer stride is not 2 * num_blocks * block numel.
    pool = torch.randn((4, 2, 5, 32, 1, 128), generator=gen).to(device)
    kv_cache = pool[1:3]
    expected = pool.clone()
    copy_blocks(kv_cache, torch.tensor([[1, 3]], device=device))
    reference.copy_blocks(expected[1:3], torch.tensor([[1, 3]]))
    torch.testing.assert_close(pool, expected, atol=0, rtol=0)


def test_copy_blocks_without_pairs_is_a_no_op(device: torch.device) -> None:
    from radixkv.kernels.copy_blocks import copy_blocks

    kv_cache = torch.ones((1, 2, 2, 16, 1, 64), device=device)
    copy_blocks(kv_cache, torch.zeros((0, 2), dtype=torch.int64))
    assert bool((kv_cache == 1).all())


def test_backend_copies_a_batch_where_a_block_is_source_and_destination() -> None:
    """Block 3 is copied from (into 5) and into (from 1) in one step: the backend reads every
    source before writing, like the reference."""
    from radixkv.worker.triton_backend import TritonBackend

    kv = torch.randn(2, 2, 8, 4, 2, 16)
    expected = kv.clone()
    pairs = torch.tensor([[3, 5], [1, 3]])
    reference.copy_blocks(expected, pairs)
    TritonBackend.copy_blocks(kv, pairs)
    torch.testing.assert_close(kv, expected)
    assert torch.equal(kv[:, :, 5], expected[:, :, 5]) and not torch.equal(kv[:, :, 5], kv[:, :, 3])
