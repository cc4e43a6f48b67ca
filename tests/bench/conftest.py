"""The bench tools are scripts, not a package: put bench/ on the path so tests import them
as the scripts import each other."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from radixkv.checkpoint import resolve_checkpoint
    from radixkv.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(resolve_checkpoint(None))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: Path) -> Any:
    from radixkv.checkpoint import resolve_checkpoint
    from radixkv.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(resolve_checkpoint(tiny_llama_dir))
