"""The Llama family on a paged KV pool: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias).

The forward pass takes one flat batch that mixes single-token decodes and prefill chunks of
several sequences (see `radixkv.worker.attention`): there is no batch dimension, only tokens.
Q/K/V and gate/up are each one fused matmul; weights load from Hugging Face names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.config import ModelConfig, RopeScaling
from radixkv.worker.attention import AttentionBackend, AttentionMetadata, paged_attention


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not fit the model (missing, unexpected or misshapen)."""


def rope_inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, scaled as the checkpoint asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(in_band, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with cos/sin tables for every position up front."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: RopeScaling):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables(torch.get_default_device())

    def build_tables(self, device: torch.device) -> None:
        """(Re)compute the cos/sin tables in float32 on `device`."""
        if device.type == "meta":
            return
        inv_freq = rope_inverse_frequencies(self.head_dim, self.base, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim // 2)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions][:, None, :]  # (num_tokens, 1, head_dim // 2)
        sin = self.sin[positions][:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.rotary = rotary
        self.backend = backend

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(
            self.backend, q, k, v, kv_layer[0], kv_layer[1], meta, self.scale
        )  # (num_tokens, num_heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_layer, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# Hugging Face name suffix -> (our parameter suffix, shard index within a fused weight).
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Decoder stack + LM head over a flat, paged batch.

    `kv_cache` is the whole pool, (num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim); layer i reads and writes `kv_cache[i]`.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """(num_tokens,) ids and positions -> (num_tokens, hidden_size) final hidden states."""
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, kv_cache[i], meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, hidden_size) -> (num_rows, vocab_size) float32 logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @classmethod
    def empty(
        cls, config: ModelConfig, backend: AttentionBackend, device: torch.device
    ) -> LlamaForCausalLM:
        """A model whose parameters are placeholders on the meta device (no memory, no random
        init); `load_weights` puts the checkpoint's tensors in their place."""
        with torch.device("meta"):
            model = cls(config, backend)
        model.rotary.build_tables(device)
        return model

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> None:
        """Take Hugging Face-named tensors; every parameter must be filled exactly once.

        Tensors are adopted as parameters without a copy where possible (first touches of
        fresh memory are slow; the loader already made these tensors).
        """
        params = dict(self.named_parameters())
        fused_parts: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still carry a copy of the embedding
            target = self._fused_target(name)
            if target is not None:
                fused_name, shard = target
                fused_parts.setdefault(fused_name, {})[shard] = tensor
                continue
            self._set_param(params, name, tensor, dtype)
            loaded.add(name)
        for fused_name, parts in fused_parts.items():
            expected = 3 if "qkv_proj" in fused_name else 2
            if sorted(parts) != list(range(expected)):
                raise WeightLoadError(f"checkpoint lacks some parts of {fused_name}")
            fused = torch.cat([parts[i] for i in range(expected)])
            self._set_param(params, fused_name, fused, dtype)
            loaded.add(fused_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}")

    @staticmethod
    def _fused_target(name: str) -> tuple[str, int] | None:
        for suffix, (fused_suffix, shard) in _FUSED_SHARDS.items():
            for kind in (".weight", ".bias"):
                if name.endswith(suffix + kind):
                    return name[: -len(suffix + kind)] + fused_suffix + kind, shard
        return None

    def _set_param(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
        dtype: torch.dtype | None,
    ) -> None:
        param = params.get(name)
        if param is None:
            raise WeightLoadError(f"checkpoint tensor {name!r} has no place in the model")
        if param.shape != tensor.shape:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        if param.device.type == "meta":
            value = tensor.to(dtype or param.dtype).contiguous()
            module_name, _, attr = name.rpartition(".")
            module = self.get_submodule(module_name) if module_name else self
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            param.copy_(tensor.to(param.dtype))
