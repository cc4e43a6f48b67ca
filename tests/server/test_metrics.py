"""GET /metrics, and client disconnects: aborted in the engine, blocks back at baseline."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.server.conftest import ServerProcess

ABORTED = 'radixkv_requests_total{outcome="aborted"}'
FINISHED = 'radixkv_requests_total{outcome="finished"}'


def wait_for_metrics(
    server: ServerProcess, settled: Callable[[dict[str, float]], bool], timeout_s: float = 15.0
) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if settled(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def long_stream_body(model: str) -> dict[str, Any]:
    """Four streams that would run to 200 tokens each: seconds on the tiny model."""
    return {"model": model, "prompt": f"{uuid.uuid4().hex[:8]} Hello", "n": 4, "max_tokens": 200,
            "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True}


def test_metrics_expose_engine_and_server_counters(
    tiny_server: ServerProcess, client: openai.OpenAI, model_name: str
) -> None:
    prompt = f"{uuid.uuid4().hex} A radix tree maps every cached prefix to its blocks."
    before = tiny_server.metrics()
    client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    after = tiny_server.metrics()
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["radixkv_prefix_cache_hit_tokens_total"] == cached
    assert delta["radixkv_prefix_cache_queried_tokens_total"] >= 2 * cached
    assert delta["radixkv_prompt_tokens_total"] == 2 * second.usage.prompt_tokens
    assert delta["radixkv_generation_tokens_total"] == 8
    assert delta[FINISHED] == 2
    assert delta["radixkv_time_to_first_token_seconds_count"] == 2
    assert delta["radixkv_inter_token_latency_seconds_count"] == 6
    assert after["radixkv_kv_blocks"] == 8192 // 16
    assert after["radixkv_kv_blocks_free"] + after["radixkv_kv_blocks_cached"] <= 512
    assert after["radixkv_kv_blocks_cached"] > 0
    assert after["radixkv_engine_serving"] == 1
    for name in ("radixkv_num_requests_running", "radixkv_num_requests_waiting",
                 "radixkv_kv_blocks_referenced", "radixkv_kv_waste_tokens",
                 "radixkv_kv_allocated_slots", "radixkv_preemptions_total",
                 "radixkv_kv_evicted_blocks_total"):
        assert name in after


def test_disconnect_mid_stream_aborts_and_releases_blocks(
    tiny_server: ServerProcess, http: httpx.Client, model_name: str
) -> None:
    before = tiny_server.metrics()
    baseline = before["radixkv_kv_blocks_referenced"]
    with http.stream("POST", "/v1/completions", json=long_stream_body(model_name)) as stream:
        assert stream.status_code == 200
        # Read three events without closing the line iterator (closing it drops the
        # connection, which is the disconnect this test makes below).
        lines = stream.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line).startswith("data: {")
        during = tiny_server.metrics()
        assert during["radixkv_num_requests_running"] == 1
        assert during["radixkv_kv_blocks_referenced"] > baseline
    # Leaving the block closes the connection mid-stream.
    after = wait_for_metrics(
        tiny_server,
        lambda m: m["radixkv_kv_blocks_referenced"] == baseline
        and m["radixkv_num_requests_running"] == 0 and m.get(ABORTED, 0) > before.get(ABORTED, 0),
    )
    assert after["radixkv_kv_blocks_referenced"] == baseline
    assert after["radixkv_num_requests_running"] == 0
    assert after["radixkv_num_requests_waiting"] == 0
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    generated = after["radixkv_generation_tokens_total"] - before["radixkv_generation_tokens_total"]
    assert generated < 4 * 200  # stopped early


def test_disconnect_while_waiting_for_a_whole_response_aborts(
    tiny_server: ServerProcess, http: httpx.Client, model_name: str
) -> None:
    before = tiny_server.metrics()
    body = {**long_stream_body(model_name), "stream": False}
    try:
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        raise AssertionError("the request should still have been running")
    except httpx.ReadTimeout:
        pass  # httpx closes the connection
    after = wait_for_metrics(
        tiny_server,
        lambda m: m.get(ABORTED, 0) > before.get(ABORTED, 0)
        and m["radixkv_kv_blocks_referenced"] == before["radixkv_kv_blocks_referenced"],
    )
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    assert after["radixkv_kv_blocks_referenced"] == before["radixkv_kv_blocks_referenced"]
