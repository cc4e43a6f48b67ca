"""Every environment variable radixkv reads, typed, in one place. All start with RADIXKV_."""

from __future__ import annotations

import os
from typing import Literal

AttentionChoice = Literal["auto", "reference", "triton"]


def attention_backend() -> AttentionChoice:
    """RADIXKV_ATTENTION: `reference` or `triton` forces a backend; unset picks by device."""
    value = os.environ.get("RADIXKV_ATTENTION", "auto").strip().lower() or "auto"
    if value not in ("auto", "reference", "triton"):
        raise ValueError(
            f"RADIXKV_ATTENTION must be 'reference' or 'triton' (or unset), got {value!r}"
        )
    return value  # type: ignore[return-value]


def debug() -> bool:
    """RADIXKV_DEBUG=1 checks the KV cache invariants after every scheduler step."""
    return os.environ.get("RADIXKV_DEBUG", "0") not in ("", "0", "false", "False")
