"""Every launcher rejects bad input with a typed error that names the problem.

No kernel runs here: each case fails in the checks before launch (meta tensors stand in for
a second device).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 2, 64, 16, 8


def decode_args(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        query=torch.zeros((NUM_SEQS, NUM_HEADS, HEAD_DIM)),
        k_cache=torch.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)),
        v_cache=torch.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)),
        block_tables=torch.zeros((NUM_SEQS, 3), dtype=torch.int32),
        seq_lens=torch.ones((NUM_SEQS,), dtype=torch.int32),
        scale=0.125,
    )
    args.update(changes)
    return args


def prefill_args(**changes: Any) -> dict[str, Any]:
    args = decode_args(query=torch.zeros((5, NUM_HEADS, HEAD_DIM)))
    args["query_start_loc"] = torch.tensor([0, 2, 5], dtype=torch.int32)
    args.update(changes)
    return args


def store_args(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        key=torch.zeros((3, NUM_KV_HEADS, HEAD_DIM)),
        value=torch.zeros((3, NUM_KV_HEADS, HEAD_DIM)),
        k_cache=torch.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)),
        v_cache=torch.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)),
        slot_mapping=torch.arange(3),
    )
    args.update(changes)
    return args


def transposed(shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` whose last dim is not contiguous."""
    return torch.zeros(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)


CACHE = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
ATTENTION_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("rank", dict(query=torch.zeros((NUM_SEQS, HEAD_DIM))), ValueError, "query must be"),
    ("heads", dict(query=torch.zeros((NUM_SEQS, 3, HEAD_DIM))), ValueError, "not a multiple"),
    ("head_dim", dict(query=torch.zeros((NUM_SEQS, NUM_HEADS, 32))), ValueError, "head_dim"),
    ("query_strides", dict(query=transposed((NUM_SEQS, NUM_HEADS, HEAD_DIM))), ValueError,
     "contiguous in head_dim"),
    ("cache_strides", dict(k_cache=transposed(CACHE)), ValueError, "contiguous in head_dim"),
    ("query_dtype", dict(query=torch.zeros((NUM_SEQS, NUM_HEADS, HEAD_DIM), dtype=torch.int32)),
     TypeError, "query must be float16"),
    ("cache_dtypes", dict(v_cache=torch.zeros(CACHE, dtype=torch.float16)), TypeError,
     "v_cache is"),
    ("cache_shapes", dict(v_cache=torch.zeros((NUM_BLOCKS + 1,) + CACHE[1:])), ValueError,
     "differ in shape"),
    ("cache_rank", dict(k_cache=torch.zeros(CACHE[1:])), ValueError, "k_cache must be"),
    ("table_dtype", dict(block_tables=torch.zeros((NUM_SEQS, 3))), TypeError,
     "block_tables must be int32"),
    ("table_rank", dict(block_tables=torch.zeros((3,), dtype=torch.int32)), ValueError,
     "block_tables must have rank 2"),
    ("table_strides", dict(block_tables=transposed((NUM_SEQS, 3)).to(torch.int32)), ValueError,
     "block_tables must be contiguous"),
    ("seq_lens_dtype", dict(seq_lens=torch.ones((NUM_SEQS,))), TypeError, "seq_lens must be"),
    ("table_rows", dict(block_tables=torch.zeros((NUM_SEQS + 1, 3), dtype=torch.int32)),
     ValueError, "rows but seq_lens"),
    ("device", dict(seq_lens=torch.ones((NUM_SEQS,), dtype=torch.int32, device="meta")),
     ValueError, "one device"),
]


def call_decode(**args: Any) -> Any:
    from radixkv.kernels.paged_decode import paged_decode

    return paged_decode(**args)


def call_prefill(**args: Any) -> Any:
    from radixkv.kernels.paged_prefill import paged_prefill

    return paged_prefill(**args)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [case[1:] for case in ATTENTION_CASES],
    ids=[case[0] for case in ATTENTION_CASES],
)
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_attention_launchers_reject(
    op: str, change: dict[str, Any], error: type[Exception], message: str
) -> None:
    call: Callable[..., Any] = call_decode if op == "decode" else call_prefill
    make = decode_args if op == "decode" else prefill_args
    with pytest.raises(error, match=message):
        call(**make(**change))


def test_decode_needs_one_row_per_sequence() -> None:
    with pytest.raises(ValueError, match="one query row per sequence"):
        call_decode(**decode_args(query=torch.zeros((NUM_SEQS + 1, NUM_HEADS, HEAD_DIM))))


@pytest.mark.parametrize("num_splits", [0, 65])
def test_decode_rejects_split_counts(num_splits: int) -> None:
    with pytest.raises(ValueError, match="num_splits must be in"):
        call_decode(**decode_args(), num_splits=num_splits)


def test_decode_tiling_must_be_a_power_of_two() -> None:
    from radixkv.kernels.paged_decode import DecodeTiling

    with pytest.raises(ValueError, match="power of two"):
        DecodeTiling(tile_n=24)


def test_prefill_rejects_query_start_loc() -> None:
    with pytest.raises(ValueError, match="num_seqs \\+ 1 = 3 entries"):
        call_prefill(**prefill_args(query_start_loc=torch.tensor([0, 5], dtype=torch.int32)))
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        call_prefill(**prefill_args(query_start_loc=torch.tensor([0.0, 2.0, 5.0])))


STORE_CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("slots_dtype", dict(slot_mapping=torch.zeros((3,))), TypeError, "slot_mapping must be"),
    ("slots_len", dict(slot_mapping=torch.arange(4)), ValueError, "4 slots for 3 tokens"),
    ("rows", dict(key=torch.zeros((3, NUM_KV_HEADS + 1, HEAD_DIM))), ValueError,
     "differ in shape"),
    ("heads", dict(key=torch.zeros((3, 1, HEAD_DIM)), value=torch.zeros((3, 1, HEAD_DIM))),
     ValueError, "cache holds"),
    ("key_strides", dict(key=transposed((3, NUM_KV_HEADS, HEAD_DIM))), ValueError,
     "key must be contiguous"),
    ("device", dict(slot_mapping=torch.arange(3, device="meta")), ValueError, "one device"),
]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [case[1:] for case in STORE_CASES],
    ids=[case[0] for case in STORE_CASES],
)
def test_store_kv_rejects(change: dict[str, Any], error: type[Exception], message: str) -> None:
    from radixkv.kernels.store_kv import store_kv

    with pytest.raises(error, match=message):
        store_kv(**store_args(**change))


POOL = (2, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
COPY_CASES: list[tuple[str, torch.Tensor, Any, type[Exception], str]] = [
    ("pool_rank", torch.zeros(POOL[1:]), [[0, 1]], ValueError, "kv_cache must be"),
    ("pool_strides", torch.zeros(POOL).transpose(3, 4), [[0, 1]], ValueError,
     "contiguous within a block"),
    ("pairs_shape", torch.zeros(POOL), [[0, 1, 2]], ValueError, "block_pairs must be"),
    ("pairs_dtype", torch.zeros(POOL), torch.tensor([[0.0, 1.0]]), TypeError,
     "block_pairs must be int32"),
    ("range", torch.zeros(POOL), [[0, NUM_BLOCKS]], ValueError, "outside the cache"),
    ("twice", torch.zeros(POOL), [[0, 1], [2, 1]], ValueError, "destination of two copies"),
    ("chain", torch.zeros(POOL), [[0, 1], [1, 2]], ValueError, "both a source and a dest"),
]


@pytest.mark.parametrize(
    ("kv_cache", "pairs", "error", "message"),
    [case[1:] for case in COPY_CASES],
    ids=[case[0] for case in COPY_CASES],
)
def test_copy_blocks_rejects(
    kv_cache: torch.Tensor, pairs: Any, error: type[Exception], message: str
) -> None:
    from radixkv.kernels.copy_blocks import copy_blocks

    if not isinstance(pairs, torch.Tensor):
        pairs = torch.tensor(pairs)
    with pytest.raises(error, match=message):
        copy_blocks(kv_cache, pairs)


def test_cpu_tensors_without_the_interpreter_get_a_clear_error() -> None:
    script = (
        "import torch\n"
        "from radixkv.kernels.store_kv import store_kv\n"
        "rows = torch.zeros((1, 1, 16))\n"
        "cache = torch.zeros((1, 16, 1, 16))\n"
        "try:\n"
        "    store_kv(rows, rows, cache, cache, torch.zeros(1, dtype=torch.int64))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert "RADIXKV_ATTENTION=reference" in done.stdout
