"""bench/workloads.py: the same seed gives the same token ids, and pieces hit their lengths."""

from __future__ import annotations

import random
from typing import Any

import pytest
from workloads import (
    BenchRequest,
    WorkloadConfig,
    build_workload,
    ideal_hit_rate,
    zipf_choices,
)


def content_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("kind", ["a", "b", "c", "d", "e"])
def test_same_seed_same_ids_other_seed_other_ids(smollm2_tokenizer: Any, kind: str) -> None:
    config = WorkloadConfig(kind=kind, num_requests=6, num_system_prompts=2, system_tokens=120,
                            question_tokens=24, output_tokens=16, preamble_tokens=200,
                            prompt_tokens=40, turns=3, agent_steps=2)
    first = build_workload(config, smollm2_tokenizer)
    again = build_workload(config, smollm2_tokenizer)
    other = build_workload(WorkloadConfig(**{**config.to_dict(), "seed": 1}), smollm2_tokenizer)
    assert first.chains == again.chains
    assert [r.prompt_token_ids for r in first.requests] != [
        r.prompt_token_ids for r in other.requests]
    assert len(first.requests) == 6
    for request in first.requests:
        assert list(request.prompt_token_ids) == smollm2_tokenizer.encode_chat(
            list(request.messages))
        assert request.max_tokens == 16


def test_shared_system_prompts_lengths_and_popularity(smollm2_tokenizer: Any) -> None:
    config = WorkloadConfig(kind="a", num_requests=40, num_system_prompts=4, system_tokens=300,
                            question_tokens=48, zipf_s=1.0)
    workload = build_workload(config, smollm2_tokenizer)
    systems = {r.messages[0]["content"] for r in workload.requests}
    assert len(systems) <= 4
    for text in systems:
        assert abs(content_tokens(smollm2_tokenizer, text) - 300) <= 1
    for request in workload.requests:
        assert abs(content_tokens(smollm2_tokenizer, request.messages[1]["content"]) - 48) <= 1
    assert len({r.messages[1]["content"] for r in workload.requests}) == 40  # all distinct
    picks = workload.measured["system_prompt_picks"]
    assert sum(picks) == 40
    assert picks[0] == max(picks)  # the most popular prompt is the first
    assert all(abs(n - 300) <= 1 for n in workload.measured["system_prompt_tokens"])


def test_zipf_choices_follow_the_weights() -> None:
    draws = zipf_choices(random.Random(3), 5, 20000, 1.0)
    counts = [draws.count(k) for k in range(5)]
    assert counts == sorted(counts, reverse=True)
    harmonic = sum(1 / (k + 1) for k in range(5))
    for k, count in enumerate(counts):
        assert count / 20000 == pytest.approx(1 / (k + 1) / harmonic, abs=0.015)
    assert zipf_choices(random.Random(3), 5, 10, 0.0) == zipf_choices(random.Random(3), 5, 10, 0.0)


def test_multi_turn_resends_history(smollm2_tokenizer: Any) -> None:
    config = WorkloadConfig(kind="b", num_requests=7, turns=3, question_tokens=20,
                            output_tokens=30)
    workload = build_workload(config, smollm2_tokenizer)
    assert [len(chain) for chain in workload.chains] == [3, 3, 1]
    for chain in workload.chains:
        for turn, request in enumerate(chain):
            assert len(request.messages) == 2 * turn + 1
            assert [m["role"] for m in request.messages][-1] == "user"
            if turn:
                previous = chain[turn - 1]
                assert request.messages[: 2 * turn - 1] == previous.messages
                answer = request.messages[2 * turn - 1]
                assert answer["role"] == "assistant"
                assert abs(content_tokens(smollm2_tokenizer, answer["content"]) - 30) <= 1
                # the previous prompt (up to its generation prompt) is a token prefix
                shared = common_prefix(request.prompt_token_ids, previous.prompt_token_ids)
                assert shared >= len(previous.prompt_token_ids) - 1


def test_agent_loop_shares_one_preamble(smollm2_tokenizer: Any) -> None:
    config = WorkloadConfig(kind="c", num_requests=6, preamble_tokens=600, agent_steps=2,
                            question_tokens=20, output_tokens=20)
    workload = build_workload(config, smollm2_tokenizer)
    preamble = workload.measured["preamble_tokens"]
    assert 600 <= preamble <= 660  # contents sum to 600; the template adds a few per message
    first = workload.requests[0].prompt_token_ids
    for request in workload.requests[1:]:
        assert common_prefix(request.prompt_token_ids, first) >= preamble - 1
    assert [len(c) for c in workload.chains] == [2, 2, 2]
    step0, step1 = workload.chains[0]
    assert step1.messages[: len(step0.messages)] == step0.messages
    assert [m["role"] for m in step1.messages[-2:]] == ["assistant", "user"]


def test_parallel_sampling_and_beams(smollm2_tokenizer: Any) -> None:
    d = build_workload(WorkloadConfig(kind="d", num_requests=3, prompt_tokens=50, n=4),
                       smollm2_tokenizer)
    e = build_workload(WorkloadConfig(kind="e", num_requests=3, prompt_tokens=50, n=4),
                       smollm2_tokenizer)
    for request in d.requests:
        assert (request.n, request.use_beam_search, request.temperature) == (4, False, 1.0)
        assert request.seed is not None
        assert abs(content_tokens(smollm2_tokenizer, request.messages[0]["content"]) - 50) <= 1
    assert len({r.seed for r in d.requests}) == 3
    for request in e.requests:
        assert (request.n, request.use_beam_search, request.temperature) == (4, True, 0.0)
    # a server warm from (d) must not serve (e) from its cache
    assert not {r.prompt_token_ids for r in d.requests} & {r.prompt_token_ids for r in e.requests}
    assert d.describe()["num_sequences"] == 12


def test_ideal_hit_rate_by_hand() -> None:
    def req(*ids: int) -> BenchRequest:
        return BenchRequest(messages=(), prompt_token_ids=ids, max_tokens=1)

    # 1st: nothing cached (0 of 4); 2nd shares 3 with the 1st (3 of 5); 3rd is the 1st again,
    # a full match capped at len - 1 (3 of 4); 4th shares 4 with the 2nd (4 of 6).
    requests = [req(1, 2, 3, 4), req(1, 2, 3, 9, 9), req(1, 2, 3, 4), req(1, 2, 3, 9, 7, 7)]
    assert ideal_hit_rate(requests) == pytest.approx((0 + 3 + 3 + 4) / (4 + 5 + 4 + 6))
    assert ideal_hit_rate([]) == 0.0


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="workload must be one of"):
        WorkloadConfig(kind="z")
    with pytest.raises(ValueError, match="system_tokens must be >= 1"):
        WorkloadConfig(system_tokens=0)
