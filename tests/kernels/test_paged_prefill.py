"""paged_prefill against the torch reference, in fp32 (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from tests.kernels.paged_batch import make_paged_batch

# (cached prefix, new tokens): empty prefixes, prefixes and chunks ending mid-block, a long
# chunk next to a one-token one, a prefix of exactly one block.
CHUNKS = [(0, 5), (40, 7), (3, 90), (0, 1), (16, 20)]


def run_prefill(
    chunks: list[tuple[int, int]], *, block_size: int, head_dim: int, group: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    from radixkv.kernels.paged_prefill import paged_prefill

    batch = make_paged_batch(
        [prefix + new for prefix, new in chunks], [new for _, new in chunks],
        block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim, device=device,
    )
    args = (
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
        batch.seq_lens, head_dim**-0.5,
    )
    return paged_prefill(*args), reference.paged_prefill(*args)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(
    block_size: int, head_dim: int, group: int, device: torch.device
) -> None:
    out, expected = run_prefill(
        CHUNKS, block_size=block_size, head_dim=head_dim, group=group, device=device
    )
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_long_prefix_takes_the_unmasked_loop(device: torch.device) -> None:
    # A prefix of several whole tiles before the chunk, with a chunk longer than a tile.
    out, expected = run_prefill(
        [(300, 70), (129, 2)], block_size=16, head_dim=64, group=1, device=device
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_sequence_without_new_tokens_is_skipped(device: torch.device) -> None:
    out, expected = run_prefill(
        [(10, 4), (20, 0), (0, 9)], block_size=16, head_dim=64, group=3, device=device
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_chunk_order_in_the_flat_batch_is_respected(device: torch.device) -> None:
    # Several sequences per query tile boundary: program -> sequence lookup must be exact.
    chunks = [(0, 1)] * 7 + [(5, 30)] + [(0, 2)] * 5
    out, expected = run_prefill(chunks, block_size=16, head_dim=64, group=3, device=device)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
