"""radixkv: an LLM inference engine built around sharing the KV cache.

Public API only; heavy modules load on first use so `import radixkv` stays cheap and
torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams"]

if TYPE_CHECKING:
    from radixkv.engine import LLM
    from radixkv.sampling_params import BeamSearchParams, SamplingParams

_LAZY = {
    "LLM": "radixkv.engine",
    "SamplingParams": "radixkv.sampling_params",
    "BeamSearchParams": "radixkv.sampling_params",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
