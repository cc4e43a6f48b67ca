"""Full-size comparisons in fp16 and bf16 on a GPU (marked gpu; skipped without CUDA).

Shapes of a Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128) and a GQA-3
head_dim-64 model; contexts up to 4k tokens. The reference runs in fp32 on the same
half-precision data, so the tolerances measure only the kernel's rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixkv.kernels import reference
from tests.kernels.paged_batch import make_paged_batch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
# (num_kv_heads, group, head_dim, block_size)
SHAPES = [(8, 4, 128, 16), (4, 3, 64, 32)]
TOLERANCE = {torch.float16: dict(atol=3e-3, rtol=1e-2), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def as_float(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_full_size(
    dtype: torch.dtype, shape: tuple[int, int, int, int], num_splits: int | None,
    cuda: torch.device,
) -> None:
    from radixkv.kernels.paged_decode import paged_decode

    num_kv_heads, group, head_dim, block_size = shape
    rng = random.Random(0)
    seq_lens = [rng.randint(1, 4096) for _ in range(62)] + [1, 4096]
    batch = make_paged_batch(
        seq_lens, [1] * len(seq_lens), block_size=block_size, num_kv_heads=num_kv_heads,
        group=group, head_dim=head_dim, device=cuda, dtype=dtype,
    )
    scale = head_dim**-0.5
    out = paged_decode(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale,
        num_splits=num_splits,
    )
    q, k, v = as_float(batch.query, batch.k_cache, batch.v_cache)
    expected = reference.paged_decode(q, k, v, batch.block_tables, batch.seq_lens, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_full_size(
    dtype: torch.dtype, shape: tuple[int, int, int, int], cuda: torch.device
) -> None:
    from radixkv.kernels.paged_prefill import paged_prefill

    num_kv_heads, group, head_dim, block_size = shape
    chunks = [(0, 1024), (2000, 512), (37, 300), (4000, 1), (0, 7), (1500, 2048)]
    batch = make_paged_batch(
        [prefix + new for prefix, new in chunks], [new for _, new in chunks],
        block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        device=cuda, dtype=dtype,
    )
    scale = head_dim**-0.5
    out = paged_prefill(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
        batch.seq_lens, scale,
    )
    q, k, v = as_float(batch.query, batch.k_cache, batch.v_cache)
    expected = reference.paged_prefill(
        q, k, v, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale
    )
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_full_size(dtype: torch.dtype, cuda: torch.device) -> None:
    from radixkv.kernels.store_kv import store_kv

    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 1024, 16, 8, 128, 8192
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), device=cuda)
    k_cache = k_cache.to(dtype)
    v_cache = torch.randn_like(k_cache)
    fused = torch.randn((num_tokens, 48, head_dim), device=cuda, dtype=dtype)
    key, value = fused[:, 32:40], fused[:, 40:48]
    slots = torch.randperm(num_blocks * block_size, device=cuda)[:num_tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    reference.store_kv(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_copy_blocks_full_size(cuda: torch.device) -> None:
    from radixkv.kernels.copy_blocks import copy_blocks

    kv_cache = torch.randn((32, 2, 512, 16, 8, 128), device=cuda, dtype=torch.bfloat16)
    ids = torch.randperm(512)
    pairs = torch.stack([ids[:200], ids[200:400]], dim=1)
    expected = kv_cache.clone()
    copy_blocks(kv_cache, pairs)
    reference.copy_blocks(expected, pairs)
    assert torch.equal(kv_cache, expected)
