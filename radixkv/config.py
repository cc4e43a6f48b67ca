"""Frozen configuration, one dataclass per role. Torch-free: every process reads these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value a user gave (or a checkpoint declares) cannot be used."""


RopeType = Literal["default", "llama3", "linear"]


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling.

    `default` uses the plain inverse frequencies; `linear` divides them by `factor`;
    `llama3` applies Llama 3.1's piecewise wavelength rule.
    """

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ConfigError(f"unsupported rope scaling type {self.rope_type!r}")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

    `attention_bias`: the q/k/v projections carry a bias; `attention_out_bias`: o_proj does.
    Llama's `attention_bias` sets both; Qwen2 has the first only.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    attention_out_bias: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model is run on.

        A sliding-window model is exact only inside its window, so it is capped there.
        """
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        values = dict(data)
        values["rope_scaling"] = RopeScaling(**values.get("rope_scaling", {}))
        values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
        return cls(**values)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and whether prefixes are shared through the radix tree.

    The pool holds `kv_cache_tokens` token slots when that is set; otherwise it takes
    `memory_fraction` of the memory the worker can see, after the weights.
    """

    block_size: int = 16
    kv_cache_tokens: int | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block "
                f"of {self.block_size} tokens"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching budgets of one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_n: int = 16
    aging_steps: int = 64

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.max_n <= 0:
            raise ConfigError(f"max_n must be > 0, got {self.max_n}")


DType = Literal["float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class WorkerConfig:
    """Where and how the model runs."""

    device: str = "cpu"
    dtype: DType = "float32"
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError(f"num_threads must be > 0, got {self.num_threads}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the scheduler and worker processes need; travels as JSON at start-up."""

    model: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_options(
        cls,
        model: str | None,
        *,
        block_size: int = 16,
        kv_cache_tokens: int | None = None,
        memory_fraction: float = 0.5,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        max_n: int = 16,
        dtype: DType = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
        seed: int = 0,
    ) -> EngineConfig:
        """The engine options users pass to `LLM(...)` and `radixkv serve`, one flat list."""
        return cls(
            model=model,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_tokens=kv_cache_tokens,
                memory_fraction=memory_fraction,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                max_n=max_n,
            ),
            worker=WorkerConfig(device=device, dtype=dtype, num_threads=num_threads, seed=seed),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        return cls(
            model=data.get("model"),
            cache=CacheConfig(**data.get("cache", {})),
            scheduler=SchedulerConfig(**data.get("scheduler", {})),
            worker=WorkerConfig(**data.get("worker", {})),
        )


def kv_blocks_needed(
    prompt_len: int, max_tokens: int, num_sequences: int, block_size: int
) -> int:
    """Blocks one request can hold at worst: its prompt once (forks share it) plus, per
    sequence, its output and one block for the copy-on-write of the shared tail. The
    scheduler refuses a request that would not fit an empty pool; the server checks first."""
    prompt_blocks = -(-prompt_len // block_size)
    return prompt_blocks + num_sequences * (-(-max_tokens // block_size) + 1)
