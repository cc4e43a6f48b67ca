"""64 streaming clients at once all complete, each with its own greedy answer."""

from __future__ import annotations

import asyncio

import openai

from tests.server.conftest import KEY_A, ServerProcess

NUM_CLIENTS = 64


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, str | None]:
    text, finish = "", None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


async def _whole(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    result = await client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].text


def test_64_concurrent_streams_complete(tiny_server: ServerProcess, model_name: str) -> None:
    prompts = [f"Client {i} says: the quick brown fox" for i in range(NUM_CLIENTS)]

    async def run() -> tuple[list[tuple[str, str | None]], list[str]]:
        # One connection per stream: the client's pool opens 64 at once.
        async with tiny_server.async_client(KEY_A) as client:
            streamed = await asyncio.gather(*(_stream(client, model_name, p) for p in prompts))
            whole = await asyncio.gather(*(_whole(client, model_name, p) for p in prompts))
        return list(streamed), list(whole)

    streamed, whole = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert [finish for _, finish in streamed] == ["length"] * NUM_CLIENTS
    # Batched 64 ways or not, each client gets exactly its own greedy continuation.
    assert [text for text, _ in streamed] == whole
    assert len(set(whole)) > 1
    metrics = tiny_server.metrics()
    assert metrics["radixkv_num_requests_running"] == 0
    assert metrics["radixkv_kv_blocks_referenced"] == 0
