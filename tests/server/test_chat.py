"""POST /v1/chat/completions on the tiny model (its chat template is ChatML)."""

from __future__ import annotations

import httpx
import openai

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world! How are you today?"},
]


def test_chat_uses_the_template_and_counts_usage(
    client: openai.OpenAI, model_name: str, http: httpx.Client
) -> None:
    result = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    assert result.object == "chat.completion"
    [choice] = result.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(rendered)
    assert result.usage.completion_tokens == 6
    # The same conversation as a raw ChatML prompt gives the same greedy answer.
    prompt = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHello world! How are you today?<|im_end|>\n<|im_start|>assistant\n"
    )
    raw = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert raw.choices[0].text == choice.message.content


def test_chat_content_parts_and_developer_role(client: openai.OpenAI, model_name: str) -> None:
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello world! "},
                                     {"type": "text", "text": "How are you today?"}]},
    ]
    a = client.chat.completions.create(
        model=model_name, messages=parts, max_tokens=5, temperature=0  # type: ignore[arg-type]
    )
    b = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, temperature=0  # type: ignore[arg-type]
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_n_and_max_completion_tokens(client: openai.OpenAI, model_name: str) -> None:
    result = client.chat.completions.create(
        model=model_name, messages=MESSAGES, n=3, max_completion_tokens=4,  # type: ignore[arg-type]
        temperature=1.0, seed=5, extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage is not None and result.usage.completion_tokens == 12


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI, model_name: str) -> None:
    result = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy took the best
        assert entry.bytes is not None
    special = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}  # skipped in the text
    joined = b"".join(bytes(e.bytes or []) for e in entries if e.token not in special)
    assert joined.decode("utf-8", errors="replace") == choice.message.content


def test_chat_without_max_tokens_fills_the_context(
    client: openai.OpenAI, model_name: str
) -> None:
    long_question = [{"role": "user", "content": "How are you today? " * 20}]
    result = client.chat.completions.create(
        model=model_name, messages=long_question, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    usage = result.usage
    assert usage is not None
    assert result.choices[0].finish_reason == "length"
    assert usage.prompt_tokens > 150
    assert usage.total_tokens == 256  # the tiny model's context
