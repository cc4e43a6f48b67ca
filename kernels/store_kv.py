"""Write a step's new K/V rows into their (block, offset) slots of the paged cache.

    key, value     (num_tokens, num_kv_heads, head_dim)
    slot_mapping   (num_tokens,)   slot = block_id * block_size + offset_in_block
    k_cache        (num_blocks, block_size, num_kv_heads, head_dim)

One program per token copies that token's (num_kv_heads, head_dim) rows. The checks on the
cache pair live here because this op defines the layout every other kernel reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def check_index(name: str, tensor: torch.Tensor, rank: int) -> None:
    """An integer index tensor (block ids, lengths, slots) of `rank` with a contiguous last dim."""
    if tensor.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(tensor.shape)}")
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim, got strides {tensor.stride()}"
        )


def check_rows(name: str, tensor: torch.Tensor) -> None:
    """A (num_tokens or num_seqs, num_heads, head_dim) float tensor whose rows are contiguous."""
    check_float(name, tensor)
    if tensor.dim() != 3:
        raise ValueError(
            f"{name} must be (num_tokens, num_heads, head_dim), got shape {tuple(tensor.shape)}"
        )
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim, got strides {tensor.stride()}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches (num_blocks, block_size, num_kv_heads, head_dim), alike, head_dim contiguous."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, cache)
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be (num_blocks, block_size, num_kv_heads, head_dim), "
                f"got shape {tuple(cache.shape)}"
            )
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {cache.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")


def check_runnable(kernel: object, device: torch.device) -> None:
    """Compiled kernels need GPU tensors; CPU tensors work only with interpreted kernels."""
    if device.type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            "Triton kernels got CPU tensors but are compiled for a GPU: use "
            "RADIXKV_ATTENTION=reference on CPU, or set TRITON_INTERPRET=1 before "
            "radixkv.kernels is imported (slow; for tests)"
        )


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_t, stride_kc_h,
    stride_vc_b, stride_vc_t, stride_vc_h,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_t
    tl.store(
        k_dst + heads[:, None] * stride_kc_h + dims[None, :],
        key.to(k_cache_ptr.dtype.element_ty), mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
        mask=mask,
    )
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_t
    tl.store(
        v_dst + heads[:, None] * stride_vc_h + dims[None, :],
        value.to(v_cache_ptr.dtype.element_ty), mask=mask,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` rows (num_tokens, num_kv_heads, head_dim) into their slots.

    Slots must be distinct and inside the cache (`0 <= slot < num_blocks * block_size`);
    they are not checked, as that would synchronise with the device.
    Raises TypeError for wrong dtypes and ValueError for wrong shapes, strides or devices.
    """
    check_kv_cache(k_cache, v_cache)
    check_rows("key", key)
    check_rows("value", value)
    check_index("slot_mapping", slot_mapping, rank=1)
    check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    num_tokens, num_kv_heads, head_dim = key.shape
    if (num_kv_heads, head_dim) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key rows are ({num_kv_heads}, {head_dim}) but the cache holds "
            f"(num_kv_heads, head_dim) = {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens"
        )
    if num_tokens == 0:
        return
    check_runnable(_store_kv_kernel, key.device)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
