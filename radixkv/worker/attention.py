"""Paged attention for the model: the batch metadata and the one place a backend is picked.

The flat batch puts decodes first: sequences `0 .. num_decode_seqs - 1` compute exactly one
token each (rows `0 .. num_decode_seqs - 1` of the flat batch); the rest are prefill chunks.

    rows   | d0 d1 d2 | p0 p0 p0 p0 | p1 p1 |
    seqs   | decodes  | prefill chunks    |
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from radixkv import envs
from radixkv.kernels import reference


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens live in the paged pool.

    slot_mapping     (num_tokens,) int64   slot each new token's K/V is written to
    block_tables     (num_seqs, max_blocks) int32
    seq_lens         (num_seqs,) int32     context length after this step
    query_start_loc  (num_seqs + 1,) int32 cumulative new-token counts
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decode_seqs: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    # Slices by phase, made once per step and shared by every layer (backends may memoise
    # per-step plans on these very tensors).
    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        return self.block_tables[: self.num_decode_seqs]

    @cached_property
    def decode_seq_lens(self) -> torch.Tensor:
        return self.seq_lens[: self.num_decode_seqs]

    @cached_property
    def prefill_block_tables(self) -> torch.Tensor:
        return self.block_tables[self.num_decode_seqs :]

    @cached_property
    def prefill_seq_lens(self) -> torch.Tensor:
        return self.seq_lens[self.num_decode_seqs :]

    @cached_property
    def prefill_query_start_loc(self) -> torch.Tensor:
        starts = self.query_start_loc[self.num_decode_seqs :]
        return starts - starts[0]


class AttentionBackend(Protocol):
    """The four paged ops, with the signatures of `radixkv.kernels.reference`."""

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor: ...

    def paged_prefill(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...

    def copy_blocks(self, kv_cache: torch.Tensor, block_pairs: torch.Tensor) -> None: ...


class ReferenceBackend:
    """Pure torch; the CPU path."""

    name = "reference"
    store_kv = staticmethod(reference.store_kv)
    paged_decode = staticmethod(reference.paged_decode)
    paged_prefill = staticmethod(reference.paged_prefill)
    copy_blocks = staticmethod(reference.copy_blocks)


def select_backend(device: torch.device) -> AttentionBackend:
    """Triton for CUDA tensors; on CPU the torch reference ops with a decode that reads
    shared prefixes once (`cpu_attention`). RADIXKV_ATTENTION=reference|triton overrides."""
    choice = envs.attention_backend()
    if choice == "reference":
        return ReferenceBackend()
    if choice == "auto" and device.type != "cuda":
        from radixkv.worker.cpu_attention import CPUBackend

        return CPUBackend()
    from radixkv.worker.triton_backend import TritonBackend

    return TritonBackend()


def paged_attention(
    backend: AttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V rows, then attend: (num_tokens, num_heads, head_dim)."""
    backend.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    num_decodes = meta.num_decode_seqs
    if num_decodes == meta.num_seqs:
        return backend.paged_decode(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
        )
    if num_decodes == 0:
        return backend.paged_prefill(
            query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, scale,
        )
    decode_out = backend.paged_decode(
        query[:num_decodes], k_cache, v_cache, meta.decode_block_tables,
        meta.decode_seq_lens, scale,
    )
    prefill_out = backend.paged_prefill(
        query[num_decodes:], k_cache, v_cache, meta.prefill_block_tables,
        meta.prefill_query_start_loc, meta.prefill_seq_lens, scale,
    )
    return torch.cat([decode_out, prefill_out], dim=0)
