"""The tiny Llama's forward through the Triton kernels gives the reference path's logits.

Three steps over one paged pool, each run by a reference model and a Triton model on their
own copies of the pool: prefills (one chunked), then decodes mixed with the chunk's second
half and a sequence that shares another's first two blocks, then a copy-on-write fork.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from radixkv.config import ModelConfig
from radixkv.worker.attention import AttentionBackend, ReferenceBackend
from radixkv.worker.batch import SeqChunk, build_model_inputs
from radixkv.worker.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16
NUM_BLOCKS = 20


def tiny_config(model_dir: Path) -> ModelConfig:
    hf = json.loads((model_dir / "config.json").read_text())
    return ModelConfig(
        architecture="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_parameters"]["rope_theta"],
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=hf["tie_word_embeddings"],
    )


class Runner:
    """One model and its own pool."""

    def __init__(
        self, model_dir: Path, backend: AttentionBackend, pool: torch.Tensor,
        device: torch.device,
    ):
        self.model = LlamaForCausalLM(tiny_config(model_dir), backend).to(device)
        self.model.load_weights(load_file(model_dir / "model.safetensors").items())
        self.backend = backend
        self.pool = pool.clone()
        self.device = device

    @torch.no_grad()
    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits of every token of the step, (num_tokens, vocab_size)."""
        inputs = build_model_inputs(chunks, BLOCK_SIZE, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool, inputs.meta)
        return self.model.compute_logits(hidden)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.backend.copy_blocks(self.pool, torch.tensor(pairs, dtype=torch.int64))


def test_tiny_llama_logits_match_reference(tiny_llama_dir: Path, device: torch.device) -> None:
    from radixkv.worker.triton_backend import TritonBackend

    config = tiny_config(tiny_llama_dir)
    gen = torch.Generator().manual_seed(0)
    # Garbage in every slot: no step may read a slot it has not written.
    pool = torch.randn(
        (config.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim),
        generator=gen,
    ).to(device)
    reference_run = Runner(tiny_llama_dir, ReferenceBackend(), pool, device)
    triton_run = Runner(tiny_llama_dir, TritonBackend(), pool, device)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    a, b, c = tokens(37), tokens(5), tokens(50)
    a_table, b_table, c_table = [3, 9, 1], [7], [12, 0, 5, 14]
    steps = [
        # Prefills, C only its first 20 tokens (chunked).
        [SeqChunk(a, 0, a_table), SeqChunk(b, 0, b_table), SeqChunk(c[:20], 0, c_table)],
        # Decodes of A and B, C's second chunk over its cached first, and D which shares A's
        # first two (full) blocks and computes 6 tokens of its own.
        [
            SeqChunk(tokens(1), 37, a_table), SeqChunk(c[20:], 20, c_table),
            SeqChunk(tokens(1), 5, b_table), SeqChunk(tokens(6), 32, [3, 9, 10]),
        ],
    ]
    for chunks in steps:
        torch.testing.assert_close(
            triton_run.step(chunks), reference_run.step(chunks), atol=1e-4, rtol=1e-4
        )

    # Fork A: its partial last block is copied before the child writes into it.
    for run in (reference_run, triton_run):
        run.copy_blocks([(1, 15)])
    fork_step = [
        SeqChunk(tokens(1), 38, a_table), SeqChunk(tokens(1), 38, [3, 9, 15]),
        SeqChunk(tokens(1), 50, c_table), SeqChunk(tokens(1), 38, [3, 9, 10]),
    ]
    torch.testing.assert_close(
        triton_run.step(fork_step), reference_run.step(fork_step), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(triton_run.pool, reference_run.pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("choice", ["reference", "triton"])
def test_select_backend_honours_the_override(
    choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixkv.worker.attention import select_backend

    monkeypatch.setenv("RADIXKV_ATTENTION", choice)
    assert select_backend(torch.device("cpu")).name == choice  # type: ignore[attr-defined]
