"""paged_decode against the torch reference, in fp32 (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from tests.kernels.paged_batch import make_paged_batch

# Very different lengths in one batch; most end mid-block; one is a single token.
SEQ_LENS = [1, 37, 130, 16, 75]


def run_decode(
    batch_seq_lens: list[int], *, block_size: int, head_dim: int, group: int,
    device: torch.device, **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    from radixkv.kernels.paged_decode import paged_decode

    batch = make_paged_batch(
        batch_seq_lens, [1] * len(batch_seq_lens), block_size=block_size, num_kv_heads=2,
        group=group, head_dim=head_dim, device=device,
    )
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    scale = head_dim**-0.5
    out = paged_decode(*args, scale, **kwargs)  # type: ignore[arg-type]
    return out, reference.paged_decode(*args, scale)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(
    block_size: int, head_dim: int, group: int, device: torch.device
) -> None:
    out, expected = run_decode(
        SEQ_LENS, block_size=block_size, head_dim=head_dim, group=group, device=device
    )
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_matches_reference(num_splits: int, device: torch.device) -> None:
    # 8 splits of a 1-token context leave 7 of them empty; they must weigh nothing.
    out, expected = run_decode(
        SEQ_LENS, block_size=16, head_dim=64, group=3, device=device, num_splits=num_splits
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
def test_tiles_smaller_than_a_block_and_many_tiles(block_size: int, device: torch.device) -> None:
    from radixkv.kernels.paged_decode import DecodeTiling

    out, expected = run_decode(
        [200, 3, 33], block_size=block_size, head_dim=64, group=1, device=device,
        num_splits=2, tiling=DecodeTiling(tile_n=16),
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_empty_batch(device: torch.device) -> None:
    from radixkv.kernels.paged_decode import paged_decode

    cache = torch.zeros((4, 16, 2, 64), device=device)
    out = paged_decode(
        torch.zeros((0, 2, 64), device=device), cache, cache,
        torch.zeros((0, 3), dtype=torch.int32, device=device),
        torch.zeros((0,), dtype=torch.int32, device=device), 0.125,
    )
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_context_len", "num_sms", "expected"),
    [
        (256, 8, 4096, 132, 1),  # plenty of programs
        (64, 8, 4096, 132, 2),  # 512 programs, just short of 4 per SM
        (1, 8, 4096, 132, 16),  # long context, one sequence: capped by 256 tokens per split
        (1, 8, 65536, 132, 64),  # capped by MAX_SPLITS
        (4, 8, 700, 132, 2),  # short contexts: 2 splits of >= 256 tokens
        (2, 2, 200, 132, 1),  # too short to split at all
        (0, 8, 4096, 132, 1),
    ],
)
def test_choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int, expected: int
) -> None:
    from radixkv.kernels.paged_decode import choose_num_splits

    assert choose_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms) == expected
