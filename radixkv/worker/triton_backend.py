"""The Triton backend: the paged-attention ops of `radixkv.kernels`, run as Triton kernels.

`radixkv.worker.attention.select_backend` picks it for CUDA tensors or when
RADIXKV_ATTENTION=triton. On CPU tensors the kernels only run under TRITON_INTERPRET=1
(set before triton is imported), which the tests use; it is slow and meant for checking.
"""

from __future__ import annotations

import torch

from radixkv.kernels import reference
from radixkv.kernels.copy_blocks import copy_blocks
from radixkv.kernels.paged_decode import paged_decode
from radixkv.kernels.paged_prefill import paged_prefill
from radixkv.kernels.store_kv import store_kv


class TritonBackend:
    """Triton kernels with the signatures of `radixkv.kernels.reference`."""

    name = "triton"
    store_kv = staticmethod(store_kv)
    paged_decode = staticmethod(paged_decode)
    paged_prefill = staticmethod(paged_prefill)

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, block_pairs: torch.Tensor) -> None:
        """The parallel kernel, unless a block is both copied from and into in this batch
        (a block freed and handed out again within one step): then torch's indexing copy,
        which reads every source before writing."""
        pairs = block_pairs.tolist()
        if {dst for _, dst in pairs} & {src for src, _ in pairs}:
            reference.copy_blocks(kv_cache, block_pairs.to(kv_cache.device))
            return
        copy_blocks(kv_cache, block_pairs)
