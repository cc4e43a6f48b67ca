"""Scheduler + ModelRunner in one process on real (tiny random) models: the cache never
changes outputs, forks share blocks, preemption is invisible, beams equal transformers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv.checkpoint import resolve_checkpoint
from radixkv.config import CacheConfig, SchedulerConfig, WorkerConfig
from radixkv.ipc.protocol import AddRequest, RequestOutput
from radixkv.kvcache import KVCacheManager
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.scheduler import Scheduler
from radixkv.worker.kv_pool import KVPool
from radixkv.worker.model_runner import ModelRunner

EOS = 2


class InProcessEngine:
    """The engine's two cores without processes or sockets."""

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint = resolve_checkpoint(checkpoint_dir)
        self.runner = ModelRunner.from_checkpoint(
            self.checkpoint, CacheConfig(block_size=4, kv_cache_tokens=4 * 8), WorkerConfig()
        )
        self.peak_referenced = 0

    def run(
        self,
        requests: Sequence[AddRequest],
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        prefix: bool = True,
        **config: Any,
    ) -> tuple[dict[str, list[RequestOutput]], Scheduler]:
        model_config = self.checkpoint.model_config
        self.runner.pool = KVPool(model_config, num_blocks, block_size, torch.float32,
                                  torch.device("cpu"))
        self.runner.seqs.clear()
        kv = KVCacheManager(num_blocks, block_size, prefix)
        scheduler = Scheduler(SchedulerConfig(**config), kv, model_config.max_model_len)
        for request in requests:
            scheduler.add_request(request)
        outputs: dict[str, list[RequestOutput]] = {}
        self.peak_referenced = 0
        while scheduler.has_work:
            for out in scheduler.step(self.runner.execute):
                outputs.setdefault(out.request_id, []).append(out)
            stats = kv.stats()
            self.peak_referenced = max(self.peak_referenced, stats.num_referenced_blocks)
            kv.check_invariants()
        stats = kv.stats()
        assert stats.num_referenced_blocks == 0
        assert stats.num_free_blocks + stats.num_cached_blocks == num_blocks
        return outputs, scheduler


def streams(outputs: list[RequestOutput]) -> list[list[int]]:
    by_index: dict[int, list[int]] = {}
    for out in outputs:
        for seq in out.seqs:
            by_index.setdefault(seq.index, []).extend(seq.token_ids)
    return [by_index[i] for i in sorted(by_index)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[InProcessEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and avoids contention
    yield InProcessEngine(tiny_llama_dir)
    torch.set_num_threads(threads)


SYSTEM = list(range(10, 47))  # 37 tokens, ends mid-block for block sizes 4 and 16


def workload() -> list[AddRequest]:
    """Requests sharing a system prompt (whole, and cut mid-block), greedy and seeded."""
    requests = []
    for i in range(6):
        prompt = SYSTEM[: 37 - 3 * (i % 3)] + [60 + i] * (1 + i % 4)
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=10)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=10)
        requests.append(AddRequest(f"r{i}", prompt, sampling=params, eos_token_ids=(EOS,)))
    return requests


def test_prefix_cache_never_changes_outputs(engine: InProcessEngine) -> None:
    baseline, _ = engine.run(workload(), prefix=False)
    expected = {rid: streams(outs) for rid, outs in baseline.items()}
    variants = [
        dict(prefix=True),
        dict(prefix=True, block_size=16, max_num_batched_tokens=11),
        dict(prefix=True, max_num_seqs=2),
    ]
    for variant in variants:
        for order in (1, -1):
            outputs, scheduler = engine.run(workload()[::order], **variant)
            got = {rid: streams(outs) for rid, outs in outputs.items()}
            assert got == expected, f"outputs changed with {variant}, order {order}"
            hits = scheduler.kv.stats().hit_tokens
            assert hits > 0, "the variant must actually hit the cache"
    # The requests run one after another on a warm cache, each alone in its batch.
    one_by_one: dict[str, list[list[int]]] = {}
    for request in workload():
        outputs, _ = engine.run([request], prefix=True)
        one_by_one.update({rid: streams(outs) for rid, outs in outputs.items()})
    assert one_by_one == expected


def test_preemption_gives_the_same_outputs(engine: InProcessEngine) -> None:
    requests = [
        AddRequest(f"p{i}", SYSTEM[: 20 + i] + [70 + i],
                   sampling=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                   eos_token_ids=(EOS,))
        for i in range(5)
    ]
    big, _ = engine.run(requests, num_blocks=256)
    small, scheduler = engine.run(requests, num_blocks=28)
    assert scheduler.num_preemptions > 0
    assert {r: streams(o) for r, o in small.items()} == {r: streams(o) for r, o in big.items()}


def test_n4_shares_the_prompt_blocks(engine: InProcessEngine) -> None:
    prompt = SYSTEM + SYSTEM[:10]  # 47 tokens: 11 full blocks of 4 and 3 tokens
    max_tokens = 12
    request = AddRequest("n4", prompt, sampling=SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=(EOS,))
    outputs, _ = engine.run([request], prefix=True)
    prompt_blocks = -(-len(prompt) // 4)
    output_blocks = -(-max_tokens // 4)
    assert engine.peak_referenced <= prompt_blocks + 4 * (output_blocks + 1)
    result = streams(outputs["n4"])
    assert [len(s) for s in result] == [max_tokens] * 4
    assert len({tuple(s) for s in result}) > 1


def test_seeded_parallel_samples_equal_separate_seeded_requests(engine: InProcessEngine) -> None:
    """Stream i of a seeded n=3 request is a pure function of (seed, i, prompt): running the
    request alone or between others, cached or not, changes nothing."""
    prompt = SYSTEM[:25]
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8)
    alone, _ = engine.run([AddRequest("x", prompt, sampling=params, eos_token_ids=(EOS,))],
                          prefix=False)
    crowd, _ = engine.run(
        workload() + [AddRequest("x", prompt, sampling=params, eos_token_ids=(EOS,))],
        max_num_batched_tokens=9,
    )
    assert streams(crowd["x"]) == streams(alone["x"])


def _frequent_eos_model(tiny_llama_dir: Path, out_dir: Path) -> tuple[Path, Any]:
    """A copy of the tiny model whose EOS logit is raised so beams finish early."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3.0
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((tiny_llama_dir / name).read_bytes())
    return out_dir, model.eval()


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (4, 1.0, True), (4, 0.5, False), (2, 2.0, True)],
)
def test_beam_search_equals_transformers(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
    width: int, length_penalty: float, early_stopping: bool,
) -> None:
    directory, hf_model = _frequent_eos_model(
        tiny_llama_dir, tmp_path_factory.mktemp("eos-heavy")
    )
    engine = InProcessEngine(directory)
    max_tokens = 10
    prompts = [SYSTEM[:9], [5, 6, 7, 8, 9, 10, 11], [100, 200, 300]]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    requests = [AddRequest(f"b{i}", p, beam=params, eos_token_ids=(EOS,))
                for i, p in enumerate(prompts)]
    outputs, _ = engine.run(requests, max_num_batched_tokens=64)
    finished_early = False
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=width, num_return_sequences=width, do_sample=False,
                max_new_tokens=max_tokens, length_penalty=length_penalty,
                early_stopping=early_stopping, eos_token_id=EOS, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True,
            )
        final = outputs[f"b{i}"][-1]
        got = [seq.token_ids for seq in final.seqs]
        want = [_strip_padding(row[len(prompt):].tolist()) for row in expected.sequences]
        assert got == want, f"prompt {i}"
        scores = [seq.score for seq in final.seqs]
        torch.testing.assert_close(
            torch.tensor(scores, dtype=torch.float32), expected.sequences_scores.float(),
            atol=1e-4, rtol=1e-4,
        )
        finished_early |= any(s.token_ids[-1] == EOS and len(s.token_ids) < max_tokens
                              for s in final.seqs)
    assert finished_early, "the test should exercise beams that end on EOS"


def _strip_padding(tokens: list[int]) -> list[int]:
    if EOS in tokens:
        return tokens[: tokens.index(EOS) + 1]
    return tokens


def test_prompt_logprobs_equal_transformers_on_cached_prompts(
    engine: InProcessEngine, tiny_llama_dir: Path
) -> None:
    """Prompt logprobs of cached tokens are computed (not skipped) and equal an uncached
    forward pass of transformers; computing them leaves the shared K/V as it was."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    prompt = SYSTEM + [70, 71, 72]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]]
    top = torch.log_softmax(logits, -1)[:-1].topk(3, dim=-1)

    warm = AddRequest("warm", SYSTEM + [80], sampling=SamplingParams(
        temperature=0.0, max_tokens=12), eos_token_ids=(EOS,))
    probe = AddRequest("probe", prompt, sampling=SamplingParams(
        temperature=0.0, max_tokens=4, prompt_logprobs=3), eos_token_ids=(EOS,))
    after = AddRequest("after", SYSTEM + [80], sampling=SamplingParams(
        temperature=0.0, max_tokens=12), eos_token_ids=(EOS,))
    # One at a time: probe hits warm's prefix, after hits what both left.
    outputs, _ = engine.run([warm, probe, after], max_num_batched_tokens=64, max_num_seqs=1)
    first = next(o for o in outputs["probe"] if o.prompt_logprobs is not None)
    assert first.num_cached_tokens >= len(SYSTEM)
    torch.testing.assert_close(torch.tensor(first.prompt_logprobs), expected,
                               atol=1e-4, rtol=1e-4)
    assert first.prompt_top_logprobs is not None
    assert [[t for t, _ in row] for row in first.prompt_top_logprobs] == top.indices.tolist()
    assert streams(outputs["after"]) == streams(outputs["warm"])
