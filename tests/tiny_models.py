"""Tiny random Llama-family checkpoints built in the test session (no hub access).

Each is a real Hugging Face directory: config.json, safetensors weights, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json. `initializer_range`
is about 0.1 so greedy decoding has clear margins between the top tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values "
    "in fixed-size blocks. A radix tree maps every cached prefix to its blocks. "
    "Copy-on-write shares forked sequences until they write. Hello world! How are you today? "
    "Les élèves étudient à l'école. Ünïcödé, 日本語のテキスト, emoji 🙂🚀 and numbers 0123456789. "
    "def f(x):\n    return x * 2\n"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VOCAB_SIZE = 384


def build_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE trained on CORPUS, with chat special tokens at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def build_tiny_model(
    out_dir: Path,
    architecture: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    num_kv_heads: int = 2,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> Path:
    """Write a random tiny checkpoint of `architecture` ('llama' or 'qwen2') to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if architecture == "llama":
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
        if rope_scaling is not None:
            rope = {**rope_scaling, "rope_theta": 500000.0}
        config: Any = LlamaConfig(**common, rope_parameters=rope)
    elif architecture == "qwen2":
        config = Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}
        )
    else:
        raise ValueError(f"unknown tiny architecture {architecture!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if architecture == "qwen2":
        # Random init leaves the QKV biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    model.eval()
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)
    return out_dir
