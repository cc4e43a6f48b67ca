"""The paged K/V tensors of every layer, sized from a memory budget."""

from __future__ import annotations

import os

import numpy as np
import torch

from radixkv.config import CacheConfig, ConfigError, ModelConfig
from radixkv.worker.attention import AttentionBackend


def available_memory_bytes(device: torch.device) -> int:
    """Memory the pool may take from: free device memory on CUDA, available RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not Linux: assume a modest machine
        return 4 << 30


def num_blocks_for(
    model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype,
    device: torch.device,
) -> int:
    """How many blocks the pool gets: `kv_cache_tokens` if set, else a memory fraction."""
    bytes_per_block = cache_config.block_size * model_config.kv_bytes_per_token(
        torch.finfo(dtype).bits // 8
    )
    if cache_config.kv_cache_tokens is not None:
        return cache_config.kv_cache_tokens // cache_config.block_size
    budget = int(available_memory_bytes(device) * cache_config.memory_fraction)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"the KV pool budget ({budget} bytes) does not hold one block of "
            f"{bytes_per_block} bytes; raise memory_fraction or set kv_cache_tokens"
        )
    return num_blocks


class KVPool:
    """`kv_cache` is (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim).

    Blocks 0 .. num_blocks - 1 are the scheduler's. The extra last one, `scratch_block`, is
    never allocated: K/V that must not be stored (recomputed for prompt logprobs over a
    shared prefix) is written there and never read.
    """

    def __init__(
        self, model_config: ModelConfig, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.block_size = block_size
        shape = (
            model_config.num_layers, 2, num_blocks + 1, block_size,
            model_config.num_kv_heads, model_config.head_dim,
        )
        self.kv_cache = _zeros(shape, dtype, device)

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def copy_blocks(self, backend: AttentionBackend, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer."""
        if not pairs:
            return
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"block copy ({src} -> {dst}) outside a pool of {self.num_blocks}")
        table = torch.tensor(pairs, dtype=torch.int64, device=self.kv_cache.device)
        backend.copy_blocks(self.kv_cache, table)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On CPU through numpy's calloc: the kernel hands out zero pages as they
    are first touched, so a pool of many GiB costs nothing until its blocks are used
    (torch.zeros writes every byte up front: tens of seconds for a big pool)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.zeros(shape, dtype=np.uint16)).view(torch.bfloat16)
    numpy_dtype = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    return torch.from_numpy(np.zeros(shape, dtype=numpy_dtype))
