"""POST /v1/completions on the tiny model, through the official openai client."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import openai


def greedy(client: openai.OpenAI, model: str, prompt: str | list[int], **kwargs: Any) -> str:
    result = client.completions.create(model=model, prompt=prompt, temperature=0, **kwargs)
    return result.choices[0].text


def test_models_lists_the_served_model(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    [model] = client.models.list().data
    assert model.id == tiny_llama_dir.resolve().name  # no --served-model-name: the directory
    assert model.owned_by == "radixkv"


def test_completion_usage_and_finish_reason(
    client: openai.OpenAI, model_name: str, http: httpx.Client
) -> None:
    result = client.completions.create(
        model=model_name, prompt="The quick brown fox", max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "text_completion"
    assert result.model == model_name
    [choice] = result.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.text
    usage = result.usage
    assert usage is not None
    prompt_ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == 7
    assert usage.total_tokens == usage.prompt_tokens + 7
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_greedy_is_deterministic_and_token_prompts_match_text(
    client: openai.OpenAI, model_name: str, http: httpx.Client
) -> None:
    prompt = "Paged attention stores keys"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    text = greedy(client, model_name, prompt, max_tokens=12)
    assert greedy(client, model_name, prompt, max_tokens=12) == text
    assert greedy(client, model_name, ids, max_tokens=12) == text


def test_prompt_list_choices_are_prompt_major(client: openai.OpenAI, model_name: str) -> None:
    prompts = ["Hello world!", "A radix tree maps"]
    singles = [greedy(client, model_name, p, max_tokens=6) for p in prompts]
    result = client.completions.create(
        model=model_name, prompt=prompts, n=2, max_tokens=6, temperature=0
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    # index = prompt_index * n + i; greedy, so both samples of a prompt are its single answer.
    assert [c.text for c in result.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert result.usage is not None
    single_usages = [
        client.completions.create(model=model_name, prompt=p, max_tokens=6, temperature=0).usage
        for p in prompts
    ]
    assert result.usage.completion_tokens == 2 * sum(
        u.completion_tokens for u in single_usages if u is not None
    )


def test_n3_sampling_returns_three_seeded_choices(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, prompt="Copy-on-write", n=3, max_tokens=5, temperature=1.0,
                  seed=1234, extra_body={"ignore_eos": True})
    result = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.text for c in result.choices}) > 1  # three streams, not one copied
    assert result.usage.completion_tokens == 15
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.text for c in again.choices] == [c.text for c in result.choices]


def test_best_of_returns_n_of_the_best(client: openai.OpenAI, model_name: str) -> None:
    result = client.completions.create(
        model=model_name, prompt="How are you", n=2, best_of=4, max_tokens=5, temperature=1.0,
        seed=7, logprobs=0,
    )
    assert [c.index for c in result.choices] == [0, 1]
    totals = [sum(c.logprobs.token_logprobs) for c in result.choices]  # type: ignore[union-attr, arg-type]
    assert totals[0] >= totals[1]  # ranked by cumulative logprob


def test_beam_search_returns_n_beams_and_width_one_is_greedy(
    client: openai.OpenAI, model_name: str
) -> None:
    prompt = "Hello world! How"
    result = client.completions.create(
        model=model_name, prompt=prompt, n=3, max_tokens=8, temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 1.0, "ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.text for c in result.choices}) == 3
    assert all(c.finish_reason == "length" for c in result.choices)
    assert result.usage.completion_tokens == 24  # type: ignore[union-attr]
    single = client.completions.create(
        model=model_name, prompt=prompt, n=1, max_tokens=8, temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert single.choices[0].text == greedy(
        client, model_name, prompt, max_tokens=8, extra_body={"ignore_eos": True}
    )


def test_stop_string_cuts_the_text(client: openai.OpenAI, model_name: str) -> None:
    prompt = "The lazy dog"
    full = greedy(client, model_name, prompt, max_tokens=24, extra_body={"ignore_eos": True})
    stop = full[8:11]
    assert len(stop) == 3
    expected = full[: full.find(stop)]
    result = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "stop"


def test_echo_prepends_the_prompt(client: openai.OpenAI, model_name: str) -> None:
    prompt = "Les élèves"
    plain = greedy(client, model_name, prompt, max_tokens=5)
    assert greedy(client, model_name, prompt, max_tokens=5, echo=True) == prompt + plain


def test_logprobs_legacy_format(client: openai.OpenAI, model_name: str) -> None:
    result = client.completions.create(
        model=model_name, prompt="numbers 0123", max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6  # type: ignore[arg-type]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):  # type: ignore[arg-type]
        assert logprob is not None and logprob <= 0
        assert top[token] == logprob  # the chosen token is in its dict
        assert 2 <= len(top) <= 3  # two alternatives (+ the chosen token when not among them)
        assert logprob == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset is not None
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_returns_prompt_logprobs_also_when_cached(
    client: openai.OpenAI, model_name: str, http: httpx.Client
) -> None:
    prompt = f"Hello world! {uuid.uuid4().hex[:6]} The quick brown fox jumps over the lazy dog."
    num_prompt = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])

    def echo() -> tuple[Any, int]:
        result = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
            echo=True, extra_body={"ignore_eos": True},
        )
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.choices[0], result.usage.prompt_tokens_details.cached_tokens or 0

    choice, _ = echo()
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                   strict=True):
        assert logprob is not None and logprob <= 0
        assert top is not None and top[token] == logprob and len(top) in (1, 2)
    assert "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.text_offset[num_prompt] == len(prompt)  # type: ignore[index]

    again, cached = echo()
    assert cached == num_prompt - 1  # every prompt token but the last came from the cache
    assert again.logprobs is not None and again.logprobs.token_logprobs is not None
    for first, second in zip(lp.token_logprobs[1:], again.logprobs.token_logprobs[1:],
                             strict=True):
        assert first is not None and second is not None and abs(first - second) < 1e-4
