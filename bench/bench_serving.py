"""Serving benchmark: a streaming client for any OpenAI-compatible endpoint.

    python bench/bench_serving.py --base-url http://127.0.0.1:8000 --workload a \\
        --num-requests 64 --concurrency 16            # or --request-rate 2.0 (Poisson)

Sends a workload of bench/workloads.py (a: shared system prompts, b: multi-turn chat, c: agent
loop, d: parallel sampling n=4, e: beam search width 4) through /v1/chat/completions (or
/v1/completions with token-id prompts), streamed with `stream_options.include_usage`, and
times every SSE event as it arrives. Per request: TTFT (send -> first content), TPOT
((latency - TTFT) / (output tokens per sequence - 1)), ITL (gaps between content events of
one choice), end-to-end latency; prompt, output and cached tokens from `usage`. It prints the
configuration and seed, a summary table (mean, p50, p99), and the summary JSON; the full result
(every request) goes to bench/results/serving_<workload>.json unless --out says otherwise.

Servers that are not radixkv work too: the client needs only the endpoint. `ignore_eos`
(on by default, so every system generates exactly O tokens) and `use_beam_search` are vLLM-style
extensions; --no-ignore-eos drops the first, and workload (e) is skipped when a probe request
shows the server refuses the second. While a run lasts, /metrics is polled for radixkv's KV
gauges (allocated slots, waste, blocks) when the server has them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (  # noqa: E402
    WORKLOAD_NAMES,
    WORKLOADS,
    BenchRequest,
    Workload,
    WorkloadConfig,
    build_workload,
)

RESULTS = Path(__file__).resolve().parent / "results"
SCRAPED_GAUGES = (
    "radixkv_kv_allocated_slots", "radixkv_kv_waste_tokens", "radixkv_kv_blocks_referenced",
    "radixkv_kv_blocks_cached", "radixkv_num_requests_running", "radixkv_num_requests_waiting",
)
SCRAPED_COUNTERS = (
    "radixkv_prefix_cache_queried_tokens", "radixkv_prefix_cache_hit_tokens",
    "radixkv_preemptions", "radixkv_kv_evicted_blocks",
)


@dataclass(frozen=True)
class ClientOptions:
    """How requests are sent; workload parameters live in WorkloadConfig."""

    base_url: str
    model: str
    endpoint: str = "chat"  # chat | completions
    concurrency: int | None = 16
    request_rate: float | None = None  # Poisson arrivals per second; None sends at once
    ignore_eos: bool = True
    seed: int = 0
    scrape_interval_s: float = 0.5


@dataclass
class RequestRecord:
    """What one request's stream showed; times are seconds from the run's start."""

    chain: int
    turn: int
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    # arrival time of every event that carried content, per choice index
    chunk_times: dict[int, list[float]] = field(default_factory=dict)
    num_choices: int = 1
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    expected_prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def output_tokens(self) -> int:
        """Tokens generated, from usage; without usage, one per content event."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(len(times) for times in self.chunk_times.values())

    @property
    def tpot(self) -> float | None:
        """None when no choice streamed its tokens over several events (radixkv sends each
        beam of a beam search whole, at the end)."""
        per_seq = self.output_tokens / max(self.num_choices, 1)
        streamed = any(len(times) > 1 for times in self.chunk_times.values())
        if self.ttft is None or self.latency is None or per_seq <= 1 or not streamed:
            return None
        return (self.latency - self.ttft) / (per_seq - 1)

    @property
    def itls(self) -> list[float]:
        gaps = []
        for times in self.chunk_times.values():
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        return gaps


# ---------------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p99 of `values` times `scale` (1000 for milliseconds); None without values."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": scale * sum(values) / len(values),
        "p50": scale * percentile(values, 50),
        "p99": scale * percentile(values, 99),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Throughput over the run's wall time; latency distributions over completed requests."""
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    with_cache = [r for r in done if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    cache_prompt = sum(r.prompt_tokens for r in with_cache)
    mismatched = [r for r in done if r.expected_prompt_tokens
                  and r.prompt_tokens != r.expected_prompt_tokens]
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (output + prompt) / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "hit_rate": cached / cache_prompt if cache_prompt else None,
        "prompt_tokens_mismatched": len(mismatched),
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None], 1000.0),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None], 1000.0),
        "itl_ms": distribution([gap for r in done for gap in r.itls], 1000.0),
        "e2e_ms": distribution([r.latency for r in done if r.latency is not None], 1000.0),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def format_summary(summary: dict[str, Any]) -> str:
    hit = summary["hit_rate"]
    lines = [
        f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}",
        f"{'duration (s)':<28}{summary['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{summary['request_throughput']:.3f}",
        f"{'output throughput (tok/s)':<28}{summary['output_throughput']:.2f}",
        f"{'total throughput (tok/s)':<28}{summary['total_token_throughput']:.2f}",
        f"{'prompt / output tokens':<28}{summary['prompt_tokens']} / {summary['output_tokens']}",
        f"{'cached tokens (hit rate)':<28}{summary['cached_tokens']} "
        f"({'n/a' if hit is None else f'{hit:.1%}'})",
        f"{'':<28}{'mean':>10}{'p50':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"),
                       ("itl_ms", "ITL (ms)"), ("e2e_ms", "latency (ms)")):
        cells = ["-" if v is None else f"{v:.1f}" for v in summary[key].values()]
        lines.append(f"{label:<28}" + "".join(f"{cell:>10}" for cell in cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- client


def build_payload(request: BenchRequest, options: ClientOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": options.model,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.endpoint == "chat":
        payload["messages"] = [dict(m) for m in request.messages]
    else:
        payload["prompt"] = list(request.prompt_token_ids)
    if request.n > 1:
        payload["n"] = request.n
    if request.seed is not None:
        payload["seed"] = request.seed
    if request.use_beam_search:
        payload["use_beam_search"] = True
        payload["length_penalty"] = 1.0
    if options.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def endpoint_url(options: ClientOptions) -> str:
    path = "/v1/chat/completions" if options.endpoint == "chat" else "/v1/completions"
    return options.base_url.rstrip("/") + path


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], record: RequestRecord,
    clock_zero: float,
) -> None:
    """Send one streamed request and fill `record` from its events."""
    record.num_choices = int(payload.get("n", 1))
    sent = time.perf_counter()
    record.start = sent - clock_zero
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter() - sent
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _apply_event(record, json.loads(data), now)
        record.latency = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


def _apply_event(record: RequestRecord, event: dict[str, Any], now: float) -> None:
    if "error" in event:
        record.error = str(event["error"].get("message", event["error"]))[:300]
        return
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            record.chunk_times.setdefault(int(choice.get("index", 0)), []).append(now)
            if record.ttft is None:
                record.ttft = now
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])


async def run_workload(
    client: httpx.AsyncClient, workload: Workload, options: ClientOptions
) -> tuple[list[RequestRecord], float]:
    """Every chain of the workload, turns in order; returns the records and the wall time.

    With a concurrency, that many chains are in flight at once (so at most that many
    requests). With a request rate, chains arrive as a Poisson process whose rate is the
    request rate over the mean chain length, so requests arrive at `request_rate` on average;
    a concurrency then caps what is in flight.
    """
    url = endpoint_url(options)
    records: list[RequestRecord] = []
    chains = list(enumerate(workload.chains))
    limit = asyncio.Semaphore(options.concurrency or len(chains) or 1)
    clock_zero = time.perf_counter()

    async def run_chain(index: int, chain: Sequence[BenchRequest]) -> None:
        async with limit:
            for turn, request in enumerate(chain):
                record = RequestRecord(chain=index, turn=turn,
                                       expected_prompt_tokens=len(request.prompt_token_ids))
                records.append(record)
                await stream_request(client, url, build_payload(request, options), record,
                                     clock_zero)
                if record.error is not None:
                    return

    tasks = []
    if options.request_rate is None:
        tasks = [asyncio.create_task(run_chain(i, c)) for i, c in chains]
    else:
        rng = random.Random(options.seed)
        mean_len = len(workload.requests) / max(len(chains), 1)
        chain_rate = options.request_rate / mean_len
        arrival = 0.0
        for i, chain in chains:
            delay = arrival - (time.perf_counter() - clock_zero)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run_chain(i, chain)))
            arrival += rng.expovariate(chain_rate)
    await asyncio.gather(*tasks)
    return records, time.perf_counter() - clock_zero


class MetricsScraper:
    """Polls /metrics while a run lasts and keeps radixkv's KV gauges (if the server has them)."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float):
        self.client = client
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self._task: asyncio.Task[None] | None = None
        self._zero = 0.0

    async def scrape(self) -> dict[str, float] | None:
        try:
            response = await self.client.get(self.url, timeout=10.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        values = parse_metrics(response.text)
        return values if "radixkv_kv_allocated_slots" in values else None

    async def start(self) -> None:
        self.first = await self.scrape()
        if self.first is not None:
            self._zero = time.perf_counter()
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            values = await self.scrape()
            if values is not None:
                values["t"] = time.perf_counter() - self._zero
                self.samples.append(values)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> dict[str, Any] | None:
        if self._task is None:
            return None
        self._task.cancel()
        self.last = await self.scrape()
        return self.report()

    def report(self) -> dict[str, Any]:
        busy = [s for s in self.samples if s.get("radixkv_kv_allocated_slots", 0) > 0]
        allocated = sum(s["radixkv_kv_allocated_slots"] for s in busy)
        waste = sum(s.get("radixkv_kv_waste_tokens", 0) for s in busy)
        counters = {}
        if self.first is not None and self.last is not None:
            counters = {name: self.last.get(name, 0) - self.first.get(name, 0)
                        for name in SCRAPED_COUNTERS}
        queried = counters.get("radixkv_prefix_cache_queried_tokens", 0)
        return {
            "num_samples": len(self.samples),
            "kv_waste_share": waste / allocated if allocated else None,
            "peak_blocks_referenced": max(
                (s.get("radixkv_kv_blocks_referenced", 0) for s in self.samples), default=0),
            "engine_hit_rate": (counters.get("radixkv_prefix_cache_hit_tokens", 0) / queried
                                if queried else None),
            "counters": counters,
            "timeline": [{k: s[k] for k in ("t", *SCRAPED_GAUGES) if k in s}
                         for s in self.samples],
        }


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page; counters lose their `_total`."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            values[name.removesuffix("_total")] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return values


# -------------------------------------------------------------------------------- one run


async def probe_beam_search(client: httpx.AsyncClient, options: ClientOptions) -> str | None:
    """None when the server takes `use_beam_search`; otherwise why not."""
    probe = BenchRequest(messages=({"role": "user", "content": "Hi"},), prompt_token_ids=(1,),
                         max_tokens=2, n=2, use_beam_search=True)
    record = RequestRecord(chain=-1, turn=0)
    await stream_request(client, endpoint_url(options),
                         build_payload(probe, options), record, time.perf_counter())
    return record.error


async def warm_up(client: httpx.AsyncClient, options: ClientOptions) -> None:
    """One short request that shares nothing with any workload (first-call costs only)."""
    request = BenchRequest(messages=({"role": "user", "content": "Say hello."},),
                           prompt_token_ids=(1,), max_tokens=4)
    record = RequestRecord(chain=-1, turn=0)
    await stream_request(client, endpoint_url(options), build_payload(request, options),
                         record, time.perf_counter())
    if record.error is not None:
        raise RuntimeError(f"the warm-up request failed: {record.error}")


async def run_benchmark(
    workload: Workload, options: ClientOptions, transport: httpx.AsyncBaseTransport | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    """Run `workload` against the server; returns the result (summary, server KV, records)."""
    limits = httpx.Limits(max_connections=(options.concurrency or 256) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits,
                                 transport=transport) as client:
        result: dict[str, Any] = {"workload": workload.describe()}
        if workload.config.kind == "e":
            refused = await probe_beam_search(client, options)
            if refused is not None:
                result["skipped"] = f"the server refused use_beam_search: {refused}"
                return result
        if warmup:
            await warm_up(client, options)
        scraper = MetricsScraper(client, options.base_url, options.scrape_interval_s)
        await scraper.start()
        records, duration = await run_workload(client, workload, options)
        result["server_kv"] = await scraper.stop()
    result["summary"] = summarize(records, duration)
    result["requests"] = [_record_json(r) for r in records]
    return result


def _record_json(record: RequestRecord) -> dict[str, Any]:
    data = asdict(record)
    data["chunk_times"] = {str(k): [round(t, 5) for t in v] for k, v in record.chunk_times.items()}
    return data


# --------------------------------------------------------------------------- results, CLI


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "num_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def result_header(benchmark: str, config: dict[str, Any]) -> dict[str, Any]:
    """What every result file starts with: the command, the date, the machine, the config."""
    return {
        "benchmark": benchmark,
        "command": "python " + " ".join(sys.argv) if sys.argv and sys.argv[0] else "",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "config": config,
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def load_tokenizer(model: str | None) -> Any:
    from radixkv.checkpoint import resolve_checkpoint
    from radixkv.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(resolve_checkpoint(model))


def add_workload_options(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """The workload flags every tool takes (defaults: WorkloadConfig's); with `many`,
    --workload takes a comma-separated list."""
    d = WorkloadConfig()
    g = parser.add_argument_group("workload (bench/workloads.py)")
    names = "; ".join(f"{k}: {v}" for k, v in WORKLOAD_NAMES.items())
    if many:
        g.add_argument("--workload", default="a", help=f"comma-separated: {names}")
    else:
        g.add_argument("--workload", default="a", choices=WORKLOADS, help=names)
    g.add_argument("--num-requests", type=int, default=d.num_requests)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--output-tokens", type=int, default=d.output_tokens, help="O")
    g.add_argument("--question-tokens", type=int, default=d.question_tokens, help="Q")
    g.add_argument("--num-system-prompts", type=int, default=d.num_system_prompts, help="G (a)")
    g.add_argument("--system-tokens", type=int, default=d.system_tokens, help="L (a)")
    g.add_argument("--zipf-s", type=float, default=d.zipf_s, help="Zipf exponent (a)")
    g.add_argument("--turns", type=int, default=d.turns, help="turns per conversation (b)")
    g.add_argument("--preamble-tokens", type=int, default=d.preamble_tokens, help="(c)")
    g.add_argument("--agent-steps", type=int, default=d.agent_steps, help="(c)")
    g.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="(d, e)")
    g.add_argument("--n", type=int, default=d.n, help="samples (d) or beam width (e)")


def workload_config(args: argparse.Namespace, kind: str | None = None) -> WorkloadConfig:
    return WorkloadConfig(
        kind=kind or args.workload, num_requests=args.num_requests, seed=args.seed,
        output_tokens=args.output_tokens, question_tokens=args.question_tokens,
        num_system_prompts=args.num_system_prompts, system_tokens=args.system_tokens,
        zipf_s=args.zipf_s, turns=args.turns, preamble_tokens=args.preamble_tokens,
        agent_steps=args.agent_steps, prompt_tokens=args.prompt_tokens, n=args.n,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help="the name to send (default: the server's first /v1/models entry)")
    parser.add_argument("--tokenizer", default=None,
                        help="checkpoint whose tokenizer measures lengths (default: SmolLM2)")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight (default 16 without --request-rate)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Poisson arrivals per second (seeded by --seed)")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send the ignore_eos extension")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default bench/results/serving_<workload>.json)")
    add_workload_options(parser)
    args = parser.parse_args(argv)
    concurrency = args.concurrency if args.concurrency or args.request_rate else 16
    config = workload_config(args)
    options = ClientOptions(
        base_url=args.base_url, model=args.model or first_model(args.base_url),
        endpoint=args.endpoint, concurrency=concurrency, request_rate=args.request_rate,
        ignore_eos=not args.no_ignore_eos, seed=args.seed,
    )
    header = result_header("serving", {"workload": config.to_dict(), "client": asdict(options),
                                       "tokenizer": args.tokenizer or "default (SmolLM2)"})
    print("config:", json.dumps(header["config"]))
    print(f"seed: {config.seed}")
    workload = build_workload(config, load_tokenizer(args.tokenizer))
    print("workload:", json.dumps(workload.describe()))
    result = {**header, **asyncio.run(run_benchmark(workload, options, warmup=not args.no_warmup))}
    out = args.out or RESULTS / f"serving_{config.kind}.json"
    write_result(out, result)
    if "skipped" in result:
        print(result["skipped"])
        return 0
    print(format_summary(result["summary"]))
    if result.get("server_kv"):
        kv = {k: v for k, v in result["server_kv"].items() if k != "timeline"}
        print("server KV:", json.dumps(kv))
    print(json.dumps(result["summary"]))
    return 0 if result["summary"]["failed"] == 0 else 1


def first_model(base_url: str) -> str:
    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30.0)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


if __name__ == "__main__":
    sys.exit(main())
