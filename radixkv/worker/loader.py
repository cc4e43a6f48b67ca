"""Checkpoint weights -> (Hugging Face Llama parameter name, tensor) pairs.

Every checkpoint comes out under the same names, whatever its format:

    model.embed_tokens.weight                         (vocab_size, hidden_size)
    model.layers.{i}.input_layernorm.weight           (hidden_size,)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  (out_features, in_features)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias      when the model has QKV bias (Qwen2)
    model.layers.{i}.post_attention_layernorm.weight  (hidden_size,)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight   (out_features, in_features)
    model.norm.weight                                 (hidden_size,)
    lm_head.weight                                    absent when the embeddings are tied

Tensors are produced one at a time, so at most one dequantised tensor is alive beyond the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors import safe_open

from radixkv.checkpoint import (
    GGUF_TENSOR_TYPES,
    Checkpoint,
    CheckpointError,
    hf_weight_files,
    read_gguf,
)
from radixkv.gguf_file import GGUFFile, GGUFTensorInfo

# Buffers some older HF checkpoints save next to the parameters; the model recomputes them.
_HF_SKIPPED = re.compile(r".*rotary_emb\.inv_freq$")

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Not parameters: rope_freqs.weight holds Llama 3 rope scaling, read into ModelConfig.rope_scaling.
_GGUF_SKIPPED = frozenset({"rope_freqs.weight"})


def load_weights(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every parameter of `ckpt` as (HF Llama name, CPU tensor of `dtype`), lazily.

    HF directories: every safetensors shard, in index order. GGUF files: each tensor dequantised
    with the gguf package, reshaped to (out, in), and for architecture `llama` with llama.cpp's
    rotary permutation of attn_q/attn_k undone. lm_head.weight is never yielded for tied models.
    Raises CheckpointError for a tensor of an unsupported type or an unknown GGUF tensor name.
    """
    if ckpt.kind == "hf":
        return _load_hf(ckpt, dtype)
    return _load_gguf(ckpt, dtype)


def _load_hf(ckpt: Checkpoint, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    tied = ckpt.model_config.tie_word_embeddings
    for file in hf_weight_files(ckpt.path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _HF_SKIPPED.match(name) or (tied and name == "lm_head.weight"):
                    continue
                tensor = shard.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _load_gguf(ckpt: Checkpoint, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    gguf = read_gguf(ckpt.path)
    config = ckpt.model_config
    permuted = gguf.metadata.get("general.architecture") == "llama"
    for info in gguf.tensors.values():
        if info.name in _GGUF_SKIPPED:
            continue
        name = gguf_to_hf_name(info.name)
        if name is None:
            raise CheckpointError(f"{ckpt.path.name}: unexpected GGUF tensor {info.name}")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights = _dequantise(gguf, info)
        if permuted and ".q_proj." in name:
            weights = unpermute_rotary(weights, config.num_heads)
        elif permuted and ".k_proj." in name:
            weights = unpermute_rotary(weights, config.num_kv_heads)
        yield name, torch.from_numpy(weights).to(dtype)


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _dequantise(gguf: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as float32 in numpy order, (out, in) for a matrix; a fresh, writable array."""
    if info.ggml_type not in GGUF_TENSOR_TYPES:
        raise CheckpointError(
            f"{gguf.path.name}: tensor {info.name} has quantisation type {info.type_name}, "
            "which radixkv cannot dequantise"
        )
    qtype = GGMLQuantizationType(info.ggml_type)
    # A plain in-memory array: gguf's dequantisers slice it thousands of times, slow on a memmap.
    raw = np.fromfile(gguf.path, np.uint8, count=info.nbytes, offset=info.offset)
    if raw.size != info.nbytes:
        raise CheckpointError(f"{gguf.path.name}: tensor {info.name} runs past the end of the file")
    rows = int(np.prod(info.shape[:-1]))
    # (rows, bytes_per_row) -> (rows, row_len)
    values = dequantize(raw.reshape(rows, info.nbytes // rows), qtype)
    return np.asarray(values, dtype=np.float32).reshape(info.shape)


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (or biases) for its interleaved rotary layout.

    Hugging Face rotates dims (j, j + head_dim/2) of a head together; llama.cpp rotates
    adjacent pairs (2j, 2j + 1), so its converter moved row j + half*i of each head to row 2j + i:

        HF rows of a head:        [x0 x1 ... x(h-1) | y0 y1 ... y(h-1)]     h = head_dim / 2
        llama.cpp rows of a head: [x0 y0 x1 y1 ... x(h-1) y(h-1)]

    Here row 2j + i goes back to j + h*i.
    """
    head_dim = weights.shape[0] // num_heads
    rest = weights.shape[1:]
    # (num_heads, half, 2, ...) -> (num_heads, 2, half, ...)
    heads = weights.reshape(num_heads, head_dim // 2, 2, *rest)
    return np.ascontiguousarray(heads.swapaxes(1, 2)).reshape(weights.shape)
