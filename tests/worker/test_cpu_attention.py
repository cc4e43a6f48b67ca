"""The CPU attention (shared-prefix decode, fused prefill) against the reference ops, and
the decode plans pinned."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv.kernels import reference
from radixkv.worker import cpu_attention
from radixkv.worker.attention import AttentionMetadata, paged_attention, select_backend
from radixkv.worker.cpu_attention import CPUBackend, SharedPrefixDecoder, plan_decode


def _tables(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def test_plan_shares_common_leading_blocks_and_batches_short_tails() -> None:
    block_size = 4
    tables = _tables([[7, 8, 9, 10, 31], [7, 8, 9, 10, 44, 45], [50, 51, 52]])
    lens = torch.tensor([18, 23, 9], dtype=torch.int32)
    plan = plan_decode(tables, lens, block_size)
    # Rows 0 and 1 share blocks 7..10 (16 slots from slot 28); the rest are short tails.
    assert [(s.rows.tolist(), s.start, s.length) for s in plan.segments] == [([0, 1], 28, 16)]
    assert plan.tails is not None
    assert plan.tails.rows.tolist() == [0, 1, 2]
    assert plan.tails.slots.tolist()[0][:2] == [124, 125]  # block 31, offsets 0..1
    assert plan.tails.valid.sum(1).tolist() == [2, 7, 9]
    assert plan.entry_rows.tolist() == [0, 1, 0, 1, 2]


def test_plan_views_long_contiguous_private_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "MIN_VIEW_TOKENS", 8)
    tables = _tables([[3, 4, 5, 9, 10], [3, 4, 6]])
    lens = torch.tensor([19, 10], dtype=torch.int32)
    plan = plan_decode(tables, lens, 4)
    # Shared: blocks 3, 4 (8 slots). Row 0 then has runs [5] and [9, 10] (11 tokens): views.
    # Row 1 has 2 tokens left in block 6: a tail.
    assert [(s.rows.tolist(), s.start, s.length) for s in plan.segments] == [
        ([0, 1], 12, 8), ([0], 20, 4), ([0], 36, 7)
    ]
    assert plan.tails is not None and plan.tails.rows.tolist() == [1]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("view_tokens", [4, 256])
def test_decode_matches_the_reference(
    seed: int, view_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random pools where groups of rows share prefixes (forks, shared prompts), tables are
    shuffled and fragmented, contexts end mid-block or on a boundary, GQA 1 and 3."""
    monkeypatch.setattr(cpu_attention, "MIN_VIEW_TOKENS", view_tokens)
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_kv_heads, group, head_dim = rng.choice([(2, 1, 16), (3, 3, 32), (1, 4, 8)])
    num_blocks = 300
    free = list(range(num_blocks))
    rng.shuffle(free)
    if rng.random() < 0.5:
        free.sort()  # contiguous runs
    tables, lens = [], []
    for _ in range(rng.randrange(1, 5)):  # groups sharing a prefix
        shared = [free.pop() for _ in range(rng.randrange(0, 6))]
        for _ in range(rng.randrange(1, 4)):
            own = [free.pop() for _ in range(rng.randrange(1, 5))]
            table = shared + own
            length = rng.randrange((len(table) - 1) * block_size + 1,
                                   len(table) * block_size + 1)
            tables.append(table)
            lens.append(length)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(tables), num_kv_heads * group, head_dim)
    block_tables = _tables(tables)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.paged_decode(query, k_cache, v_cache, block_tables, seq_lens, 0.3)
    got = SharedPrefixDecoder()(query, k_cache, v_cache, block_tables, seq_lens, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_decode_without_the_fused_kernel_matches_too(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both attention paths (torch's fused CPU flash kernel, and the matmul/exp fallback
    used where that kernel is missing) on shared segments and masked tails."""
    if not fused:
        monkeypatch.setattr(cpu_attention, "_FLASH_FOR_CPU", None)
    torch.manual_seed(1)
    k_cache = torch.randn(60, 4, 3, 16)
    v_cache = torch.randn(60, 4, 3, 16)
    tables = _tables([[1, 2, 3, 40], [1, 2, 3, 41, 42], [9, 8], [50]])
    lens = torch.tensor([15, 19, 5, 1], dtype=torch.int32)
    query = torch.randn(4, 9, 16)
    expected = reference.paged_decode(query, k_cache, v_cache, tables, lens, 0.25)
    got = SharedPrefixDecoder()(query, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fused", [True, False])
def test_prefill_matches_the_reference(
    seed: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of varied lengths over empty and cached prefixes (ending mid-block), shuffled
    block tables, GQA 1 and 3."""
    if not fused:
        monkeypatch.setattr(cpu_attention, "_FLASH_FOR_CPU", None)
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_kv_heads, group, head_dim = rng.choice([(2, 1, 16), (3, 3, 32)])
    num_blocks = 200
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, lens, q_lens = [], [], []
    for _ in range(rng.randrange(1, 4)):
        q_len = rng.randrange(1, 40)
        context = rng.choice([0, rng.randrange(1, 50)])
        seq_len = context + q_len
        tables.append([free.pop() for _ in range(-(-seq_len // block_size))])
        lens.append(seq_len)
        q_lens.append(q_len)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, k_cache, v_cache, _tables(tables), starts,
            torch.tensor(lens, dtype=torch.int32), 0.3)
    expected = reference.paged_prefill(*args)
    got = cpu_attention.paged_prefill(*args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_plan_is_built_once_per_step_and_dropped_with_it() -> None:
    decoder = SharedPrefixDecoder()
    k = torch.randn(8, 4, 1, 8)
    v = torch.randn(8, 4, 1, 8)
    q = torch.randn(2, 1, 8)
    tables = _tables([[1, 2], [1, 3]])
    lens = torch.tensor([6, 7], dtype=torch.int32)
    decoder(q, k, v, tables, lens, 1.0)
    decoder(q, k, v, tables, lens, 1.0)
    assert len(decoder._plans) == 1
    del tables
    assert decoder._plans == {}


def test_mixed_batch_through_the_backend_matches_the_reference() -> None:
    torch.manual_seed(0)
    k_cache = torch.randn(40, 4, 2, 8)
    v_cache = torch.randn(40, 4, 2, 8)
    tables = _tables([[5, 6, 7], [5, 6, 9], [20, 21, 22, 23]])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([30, 37, 88, 89, 90], dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor([11, 10, 11], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 5], dtype=torch.int32),
        num_decode_seqs=2,
    )
    query = torch.randn(5, 4, 8)
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    outs = []
    for backend in (reference_backend(), CPUBackend()):
        k, v = k_cache.clone(), v_cache.clone()
        outs.append(paged_attention(backend, query, key, value, k, v, meta, 0.5))
    torch.testing.assert_close(outs[1], outs[0])


def reference_backend() -> object:
    from radixkv.worker.attention import ReferenceBackend

    return ReferenceBackend()


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXKV_ATTENTION", raising=False)
    assert select_backend(torch.device("cpu")).name == "cpu"  # type: ignore[attr-defined]
    monkeypatch.setenv("RADIXKV_ATTENTION", "reference")
    assert select_backend(torch.device("cpu")).name == "reference"  # type: ignore[attr-defined]
    monkeypatch.setenv("RADIXKV_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="RADIXKV_ATTENTION"):
        select_backend(torch.device("cpu"))
