"""The Llama-family model on the paged pool against transformers on the same weights.

Tolerance: logits agree within atol 2e-4 + rtol 1e-4 (fp32; SmolLM2's logits reach ~40, so that
is ~1e-5 relative to the largest logit). Summation order differs between the two
implementations (fused projections, paged attention), so bit equality is not expected.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv.checkpoint import resolve_checkpoint
from radixkv.worker.attention import ReferenceBackend
from radixkv.worker.batch import SeqChunk, build_model_inputs
from radixkv.worker.model_runner import load_model
from radixkv.worker.models.llama import LlamaForCausalLM

ATOL = 2e-4
RTOL = 1e-4
CPU = torch.device("cpu")

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in",
    "def f(x):\n    return",
    "Hello world! How are you today?",
    "Les élèves étudient",
    "A radix tree maps every cached prefix to its blocks.",
    "numbers 0123456789 and emoji 🙂",
    "Copy-on-write shares forked sequences until they write. Then",
]


class PagedHarness:
    """Runs the model over a pool whose free blocks come in a shuffled order."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int, seed: int = 0):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.kv = torch.zeros(
            config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def table_for(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < length:
            table.append(self.free.pop())
        return table

    @torch.no_grad()
    def step(self, work: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
        """Compute the given tokens of each sequence; returns logits of every computed token
        of every chunk, concatenated in `work` order."""
        chunks = []
        for seq, tokens in work:
            start = self.lengths.get(seq, 0)
            chunks.append(SeqChunk(list(tokens), start, self.table_for(seq, start + len(tokens))))
            self.lengths[seq] = start + len(tokens)
        inputs = build_model_inputs(chunks, self.block_size, CPU)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta)
        rows = []
        for i, (_, tokens) in enumerate(work):
            last = int(inputs.last_token_rows[i])
            rows.extend(range(last - len(tokens) + 1, last + 1))
        return self.model.compute_logits(hidden[rows])


def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_llama3", "smollm2"])
def models(request: pytest.FixtureRequest) -> tuple[LlamaForCausalLM, Any, Any]:
    fixture = {
        "tiny_llama": "tiny_llama_dir",
        "tiny_qwen2": "tiny_qwen2_dir",
        "tiny_llama3": "tiny_llama3_sharded_dir",
        "smollm2": "smollm2_gguf",
    }[request.param]
    path = request.getfixturevalue(fixture)
    checkpoint = resolve_checkpoint(path)
    ours = load_model(checkpoint, ReferenceBackend(), torch.float32, CPU)
    from radixkv.tokenizer import Tokenizer

    return ours, _hf_model(Path(path)), Tokenizer.from_checkpoint(checkpoint)


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    assert len(ids) >= 3
    return ids


def test_logits_match_transformers(models: tuple[LlamaForCausalLM, Any, Any]) -> None:
    ours, theirs, tokenizer = models
    harness = PagedHarness(ours, block_size=16, num_blocks=64)
    prompts = [_encode(tokenizer, p) for p in PROMPTS[:4]]
    # All prompts in one flat batch: each attends only to its own blocks.
    logits = harness.step([(i, p) for i, p in enumerate(prompts)])
    offset = 0
    with torch.no_grad():
        for prompt in prompts:
            expected = theirs(torch.tensor([prompt])).logits[0]
            got = logits[offset : offset + len(prompt)]
            offset += len(prompt)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_greedy_continuations_match_transformers(
    models: tuple[LlamaForCausalLM, Any, Any],
) -> None:
    """32 greedy tokens for 8 prompts decoded together; a divergence is accepted only where
    the oracle's own top-2 margin is below 1e-3 (checked, not skipped)."""
    ours, theirs, tokenizer = models
    num_new = 32
    prompts = [_encode(tokenizer, p) for p in PROMPTS]
    harness = PagedHarness(ours, block_size=16, num_blocks=160, seed=1)
    last = harness.step([(i, p) for i, p in enumerate(prompts)])
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    next_tokens = last[ends].argmax(-1).tolist()
    generated: list[list[int]] = [[t] for t in next_tokens]
    for _ in range(num_new - 1):
        logits = harness.step([(i, [g[-1]]) for i, g in enumerate(generated)])
        for i, token in enumerate(logits.argmax(-1).tolist()):
            generated[i].append(token)
    for prompt, ours_tokens in zip(prompts, generated, strict=True):
        expected, margins = _oracle_greedy(theirs, prompt, num_new)
        if ours_tokens == expected:
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours_tokens, expected, strict=True)) if a != b)
        assert margins[step] < 1e-3, (
            f"greedy diverged at step {step} with oracle margin {margins[step]:.2e}: "
            f"{ours_tokens} vs {expected}"
        )


@torch.no_grad()
def _oracle_greedy(model: Any, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Plain greedy with transformers (no EOS stop, no logits processors), with the top-2
    logit margin of each step."""
    ids = list(prompt)
    past = None
    tokens, margins = [], []
    next_input = torch.tensor([ids])
    for _ in range(num_new):
        out = model(next_input, cache=past, use_cache=True)
        past = getattr(out, "cache", None) or out.past_key_values
        top2 = out.logits[0, -1].topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        next_input = torch.tensor([[tokens[-1]]])
    return tokens, margins


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paging_does_not_change_logits(
    models: tuple[LlamaForCausalLM, Any, Any], block_size: int
) -> None:
    """One prefill, chunks of 7, and a cached prefix plus continuation agree, on shuffled
    non-contiguous block tables."""
    ours, _, tokenizer = models
    prompt = _encode(tokenizer, " ".join(PROMPTS[:3]))
    num_blocks = 2 * (len(prompt) // block_size + 2) + 8

    whole = PagedHarness(ours, block_size, num_blocks, seed=2).step([(0, prompt)])

    chunked = PagedHarness(ours, block_size, num_blocks, seed=3)
    pieces = [
        chunked.step([(0, prompt[start : start + 7])]) for start in range(0, len(prompt), 7)
    ]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=ATOL, rtol=RTOL)

    # A cached prefix computed by another step, then the rest in one chunk, batched next
    # to an unrelated sequence so the batch mixes a decode and a prefill.
    cut = len(prompt) // 2 + 1
    cached = PagedHarness(ours, block_size, num_blocks, seed=4)
    first = cached.step([(0, prompt[:cut]), (1, prompt[:5])])[:cut]
    rest = cached.step([(1, [prompt[5]]), (0, prompt[cut:])])[1:]
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=ATOL, rtol=RTOL)
    assert any(
        b - a != 1 for a, b in zip(cached.tables[0], cached.tables[0][1:], strict=False)
    ) or len(cached.tables[0]) == 1, "the block table should be non-contiguous"


def test_load_weights_rejects_a_misshapen_tensor(tiny_llama_dir: Path) -> None:
    from radixkv.worker.loader import load_weights
    from radixkv.worker.models.llama import WeightLoadError

    checkpoint = resolve_checkpoint(tiny_llama_dir)
    model = LlamaForCausalLM.empty(checkpoint.model_config, ReferenceBackend(), CPU)
    weights = dict(load_weights(checkpoint, torch.float32))
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightLoadError, match="model.norm.weight|norm.weight"):
        model.load_weights(weights.items())
    weights.pop("model.norm.weight")
    model = LlamaForCausalLM.empty(checkpoint.model_config, ReferenceBackend(), CPU)
    with pytest.raises(WeightLoadError, match="lacks tensors for: norm.weight"):
        model.load_weights(weights.items())


def test_default_checkpoint_path_is_the_packaged_gguf(smollm2_gguf: Path) -> None:
    assert resolve_checkpoint(None).path == smollm2_gguf
    assert os.path.getsize(smollm2_gguf) > 50_000_000
