"""The default model (SmolLM2-135M-Instruct, a real chat model) served with no arguments."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import ServerProcess

SYSTEM = (
    "You are a helpful geography assistant. You answer every question in one short "
    "sentence, naming the city and nothing else."
)


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # No model argument: the default SmolLM2 GGUF; no API keys, so cache_salt is the client's.
    server = ServerProcess(
        None, ["--kv-cache-tokens", "4096"],
        tmp_path_factory.mktemp("smollm2-server") / "server.log",
    )
    try:
        server.wait_ready(timeout_s=300)
        yield server
    finally:
        server.stop()


def ask(client: openai.OpenAI, question: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(  # type: ignore[call-overload]
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        temperature=0,
        **kwargs,
    )


def test_chat_answers_and_reuses_the_system_prompt(smollm2_server: ServerProcess) -> None:
    client = smollm2_server.client()
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct.Q4_1"
    first = ask(client, "What is the capital of France?", max_tokens=12)
    assert "Paris" in (first.choices[0].message.content or "")
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    second = ask(client, "What is the capital of Germany?", max_tokens=12)
    assert "Berlin" in (second.choices[0].message.content or "")
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # The system prompt (and the template around it) came from the cache.
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 25


def test_client_cache_salt_without_keys(smollm2_server: ServerProcess) -> None:
    client = smollm2_server.client()
    salted = ask(client, "What is the capital of France?", max_tokens=1,
                 extra_body={"cache_salt": "tenant-x"})
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # unsalted prefixes don't match

