"""Server-sent events: chunks concatenate to the non-streamed answer; usage; [DONE]."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
import openai


def sse_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    """The raw `data:` payloads of one streamed response, in order."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in response.iter_lines() if line]


def test_greedy_stream_concatenates_to_the_completion(
    client: openai.OpenAI, model_name: str
) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name, prompt="Hello world! How are you", max_tokens=20, temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert len(chunks) > 3  # deltas, not one block
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_seeded_n2_stream_matches_per_choice(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name, prompt="Copy-on-write shares", n=2, max_tokens=10, temperature=0.8,
        seed=99,
    )
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert dict(texts) == {c.index: c.text for c in whole.choices}


def test_stop_string_stream_matches(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name, prompt="The quick", max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[10:12]
    whole = client.completions.create(stop=stop, **kwargs).choices[0]
    chunks = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.text == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stream_matches_and_opens_with_the_role(
    client: openai.OpenAI, model_name: str
) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name, messages=[{"role": "user", "content": "Hello world"}],
        max_tokens=12, temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_include_usage_sends_a_final_usage_chunk_then_done(
    http: httpx.Client, model_name: str
) -> None:
    body = {"model": model_name, "prompt": "A radix tree", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(http, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert all(json.loads(e)["usage"] is None for e in events[:-2])


def test_without_include_usage_no_usage_chunk(http: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    events = sse_events(http, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] and c["usage"] is None for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_beam_and_best_of_stream_their_final_choices(
    client: openai.OpenAI, model_name: str
) -> None:
    for extra in ({"use_beam_search": True}, {"best_of": 3}):
        kwargs: dict[str, Any] = dict(
            model=model_name, prompt="Hello", n=2, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )
        whole = client.completions.create(**kwargs)
        texts: dict[int, str] = defaultdict(str)
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert dict(texts) == {c.index: c.text for c in whole.choices}, extra


def test_stream_echo_sends_the_prompt_first(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(client.completions.create(
        model=model_name, prompt="Hello world", max_tokens=3, temperature=0, echo=True,
        stream=True,
    ))
    assert chunks[0].choices[0].text == "Hello world"


def test_stream_echo_with_logprobs_equals_the_non_streamed_response(
    client: openai.OpenAI, model_name: str
) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_name, prompt=["Hello world", "The quick brown"], max_tokens=3,
        temperature=0, echo=True, logprobs=1, extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = defaultdict(str)
    logprobs: dict[int, list[float | None]] = defaultdict(list)
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None and choice.logprobs.token_logprobs is not None:
                logprobs[choice.index] += choice.logprobs.token_logprobs
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        streamed = logprobs[choice.index]
        assert streamed[0] is None and choice.logprobs.token_logprobs[0] is None
        assert len(streamed) == len(choice.logprobs.token_logprobs)
        for a, b in zip(streamed[1:], choice.logprobs.token_logprobs[1:], strict=True):
            assert a is not None and b is not None and abs(a - b) < 1e-4
