"""bench/bench_serving.py against a scripted in-process SSE server (httpx.MockTransport):
metrics from event arrival times, usage parsing, concurrency, chains, Poisson arrivals."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from bench_serving import (
    ClientOptions,
    RequestRecord,
    build_payload,
    parse_metrics,
    percentile,
    run_benchmark,
    run_workload,
    stream_request,
    summarize,
)
from workloads import BenchRequest, Workload, WorkloadConfig

URL = "http://fake"


def chat_event(index: int, content: str | None, usage: dict[str, Any] | None = None) -> bytes:
    choices = [] if content is None else [
        {"index": index, "delta": {"content": content}, "finish_reason": None}]
    body: dict[str, Any] = {"object": "chat.completion.chunk", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ScriptedServer:
    """Streams `num_tokens` content events per choice: the first after `first_s`, the rest
    every `gap_s`; then usage; then [DONE]. Counts requests in flight."""

    def __init__(self, first_s: float = 0.0, gap_s: float = 0.0, num_tokens: int = 3,
                 cached: int = 0, refuse_beams: bool = False):
        self.first_s = first_s
        self.gap_s = gap_s
        self.num_tokens = num_tokens
        self.cached = cached
        self.refuse_beams = refuse_beams
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)
        body = json.loads(request.content)
        if self.refuse_beams and body.get("use_beam_search"):
            return httpx.Response(400, json={"error": {"message": "no beams here"}})
        self.bodies.append(body)
        return httpx.Response(200, content=self.events(body),
                              headers={"content-type": "text/event-stream"})

    async def events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        n = body.get("n", 1)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        yield b"data: " + json.dumps(role).encode() + b"\n\n"
        await asyncio.sleep(self.first_s)
        for i in range(self.num_tokens):
            if i:
                await asyncio.sleep(self.gap_s)
            for index in range(n):
                yield chat_event(index, f" t{i}")
        prompt = len(body["messages"][-1]["content"])
        # the client stops reading at [DONE], so this generator never runs past it
        self.in_flight -= 1
        yield chat_event(0, None, {
            "prompt_tokens": prompt, "completion_tokens": n * self.num_tokens,
            "total_tokens": prompt + n * self.num_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached}})
        yield b"data: [DONE]\n\n"


def request(text: str = "hello", n: int = 1, max_tokens: int = 3) -> BenchRequest:
    return BenchRequest(messages=({"role": "user", "content": text},),
                        prompt_token_ids=tuple(range(len(text))), max_tokens=max_tokens, n=n)


def workload_of(chains: list[list[BenchRequest]]) -> Workload:
    return Workload(WorkloadConfig(kind="b"), tuple(tuple(c) for c in chains))


def options(**kwargs: Any) -> ClientOptions:
    return ClientOptions(**{"base_url": URL, "model": "m", **kwargs})


async def one_request(server: ScriptedServer, req: BenchRequest) -> RequestRecord:
    record = RequestRecord(chain=0, turn=0)
    async with httpx.AsyncClient(transport=server.transport()) as client:
        await stream_request(client, f"{URL}/v1/chat/completions",
                             build_payload(req, options()), record, 0.0)
    return record


def test_times_come_from_event_arrivals() -> None:
    server = ScriptedServer(first_s=0.10, gap_s=0.05, num_tokens=5, cached=3)
    record = asyncio.run(one_request(server, request("x" * 40)))
    assert record.ok
    assert 0.10 <= record.ttft < 0.25  # type: ignore[operator]
    assert len(record.chunk_times[0]) == 5  # the empty role event is not content
    assert len(record.itls) == 4
    assert all(0.05 <= gap < 0.15 for gap in record.itls)
    assert record.latency is not None and record.latency >= 0.30
    assert record.tpot == pytest.approx((record.latency - record.ttft) / 4)  # type: ignore[operator]
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (40, 5, 3)


def test_parallel_choices_give_per_choice_gaps_and_per_sequence_tpot() -> None:
    server = ScriptedServer(first_s=0.02, gap_s=0.03, num_tokens=4)
    record = asyncio.run(one_request(server, request(n=3)))
    assert record.num_choices == 3
    assert sorted(record.chunk_times) == [0, 1, 2]
    assert len(record.itls) == 3 * 3
    assert record.output_tokens == 12
    assert record.tpot == pytest.approx((record.latency - record.ttft) / 3)  # type: ignore[operator]


def test_summary_by_hand() -> None:
    a = RequestRecord(chain=0, turn=0, start=0.0, ttft=0.2, latency=1.0,
                      chunk_times={0: [0.2, 0.4, 0.6, 1.0]}, prompt_tokens=100,
                      completion_tokens=5, cached_tokens=80)
    b = RequestRecord(chain=1, turn=0, start=0.5, ttft=0.4, latency=2.0,
                      chunk_times={0: [0.4, 2.0]}, prompt_tokens=60, completion_tokens=3,
                      cached_tokens=0, expected_prompt_tokens=61)
    failed = RequestRecord(chain=2, turn=0, error="HTTP 500: boom")
    s = summarize([a, b, failed], duration_s=4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == 0.5
    assert s["output_throughput"] == 2.0  # 8 tokens / 4 s
    assert s["total_token_throughput"] == (8 + 160) / 4.0
    assert s["hit_rate"] == 80 / 160
    assert s["prompt_tokens_mismatched"] == 1
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(300.0)
    # TPOT: a (1.0 - 0.2) / 4 = 0.2, b (2.0 - 0.4) / 2 = 0.8
    assert s["tpot_ms"]["mean"] == pytest.approx(500.0)
    # ITL: a 0.2, 0.2, 0.4; b 1.6
    assert s["itl_ms"]["mean"] == pytest.approx(600.0)
    assert s["itl_ms"]["p50"] == pytest.approx(300.0)
    assert s["e2e_ms"]["p99"] == pytest.approx(1000.0 + 0.99 * 1000.0)
    assert s["errors"] == ["HTTP 500: boom"]


def test_percentile_matches_linear_interpolation() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 99) == 7.0


def test_concurrency_caps_requests_in_flight_and_chains_run_in_order() -> None:
    server = ScriptedServer(first_s=0.02, gap_s=0.01)
    chains = [[request(f"c{c}t{t}") for t in range(3)] for c in range(5)]

    async def go() -> tuple[list[RequestRecord], float]:
        async with httpx.AsyncClient(transport=server.transport()) as client:
            return await run_workload(client, workload_of(chains), options(concurrency=2))

    records, duration = asyncio.run(go())
    assert len(records) == 15 and all(r.ok for r in records)
    assert server.max_in_flight == 2
    for c in range(5):
        turns = sorted((r for r in records if r.chain == c), key=lambda r: r.turn)
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.start >= earlier.start + earlier.latency  # type: ignore[operator]
    sent = [body["messages"][0]["content"] for body in server.bodies]
    for c in range(5):
        assert [s for s in sent if s.startswith(f"c{c}t")] == [f"c{c}t{t}" for t in range(3)]


def test_poisson_arrivals_follow_the_seeded_schedule() -> None:
    server = ScriptedServer()
    chains = [[request(f"r{i}")] for i in range(6)]

    async def go() -> list[RequestRecord]:
        async with httpx.AsyncClient(transport=server.transport()) as client:
            records, _ = await run_workload(client, workload_of(chains),
                                            options(concurrency=None, request_rate=20.0, seed=7))
            return records

    records = asyncio.run(go())
    rng = random.Random(7)
    expected, t = [], 0.0
    for _ in range(6):
        expected.append(t)
        t += rng.expovariate(20.0)
    starts = [r.start for r in sorted(records, key=lambda r: r.chain)]
    for start, due in zip(starts, expected, strict=True):
        assert due - 0.005 <= start < due + 0.25


def test_beam_workload_is_skipped_when_the_server_refuses_beams() -> None:
    server = ScriptedServer(refuse_beams=True)
    beams = BenchRequest(messages=({"role": "user", "content": "x"},), prompt_token_ids=(1,),
                         max_tokens=2, n=2, use_beam_search=True)
    workload = Workload(WorkloadConfig(kind="e"), ((beams,),))
    result = asyncio.run(run_benchmark(workload, options(), transport=server.transport()))
    assert "no beams here" in result["skipped"]
    assert server.bodies == []


def test_run_benchmark_reports_failures_and_no_server_kv() -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="boom")

    workload = workload_of([[request()], [request()]])
    result = asyncio.run(run_benchmark(workload, options(), transport=httpx.MockTransport(handler),
                                       warmup=False))
    assert result["summary"]["failed"] == 2
    assert result["summary"]["errors"] == ["HTTP 500: boom"]
    assert result["server_kv"] is None


def test_payloads() -> None:
    beams = BenchRequest(messages=({"role": "user", "content": "x"},), prompt_token_ids=(5, 6),
                         max_tokens=7, n=4, use_beam_search=True)
    chat = build_payload(beams, options())
    assert chat["messages"] == [{"role": "user", "content": "x"}]
    assert (chat["n"], chat["use_beam_search"], chat["ignore_eos"], chat["max_tokens"]) == (
        4, True, True, 7)
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    plain = build_payload(request(), options(endpoint="completions", ignore_eos=False))
    assert plain["prompt"] == [0, 1, 2, 3, 4]
    assert "n" not in plain and "ignore_eos" not in plain and "messages" not in plain


def test_parse_metrics() -> None:
    text = (
        "# HELP radixkv_kv_allocated_slots KV token slots\n"
        "# TYPE radixkv_kv_allocated_slots gauge\n"
        "radixkv_kv_allocated_slots 320.0\n"
        "radixkv_prefix_cache_hit_tokens_total 12.0\n"
        'radixkv_requests_total{outcome="finished"} 3.0\n'
    )
    assert parse_metrics(text) == {"radixkv_kv_allocated_slots": 320.0,
                                   "radixkv_prefix_cache_hit_tokens": 12.0}
