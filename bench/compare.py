"""radixkv against itself without prefix caching and against transformers, in one go.

    python bench/compare.py --workload a --num-requests 64 --concurrency 16
    python bench/compare.py --workload a --num-requests 32 --concurrency 1,4,16   # a sweep

For each concurrency, on this machine, one after the other:
  1. radixkv: `python -m radixkv.cli serve MODEL --port <free> ...` is started, /health
     awaited, the workload sent by bench/bench_serving.py's client, the server stopped;
  2. the same with --no-prefix-cache;
  3. transformers `generate` in static batches (batch size = the concurrency, left padding)
     on the same token ids: max_new_tokens = min_new_tokens = O, greedy (sampling with
     num_return_sequences=n for (d), num_beams=n for (e)).
Every system gets --num-threads threads (the servers' worker, torch in the baseline). A fresh
server per run keeps one run's cache out of the next. Prints a ratio table per concurrency
(and the goals of issue 7 for workload a), writes bench/results/compare_<workload>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (  # noqa: E402
    RESULTS,
    ClientOptions,
    add_workload_options,
    distribution,
    load_tokenizer,
    result_header,
    run_benchmark,
    workload_config,
    write_result,
)
from workloads import Workload, build_workload  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RADIXKV = "radixkv"
NO_CACHE = "radixkv --no-prefix-cache"
BASELINE = "transformers"
SYSTEMS = (RADIXKV, NO_CACHE, BASELINE)
GOALS = ((RADIXKV, BASELINE, 5.0), (RADIXKV, NO_CACHE, 3.0))  # (system, against, at least)
SHORT = {RADIXKV: "radixkv", NO_CACHE: "no-cache", BASELINE: "hf"}  # ratio column labels


# ------------------------------------------------------------------------------ the table


def ratio_table(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per system that ran: its numbers and its output-token throughput over each
    other system's (None where that one did not run or produced nothing)."""
    rows = []
    for name in [s for s in SYSTEMS if s in runs] + [s for s in runs if s not in SYSTEMS]:
        summary = runs[name]
        row = {
            "system": name,
            "output_throughput": summary["output_throughput"],
            "request_throughput": summary["request_throughput"],
            "ttft_p50_ms": (summary.get("ttft_ms") or {}).get("p50"),
            "tpot_mean_ms": (summary.get("tpot_ms") or {}).get("mean"),
            "e2e_p50_ms": (summary.get("e2e_ms") or {}).get("p50"),
            "hit_rate": summary.get("hit_rate"),
        }
        for other in runs:
            base = runs[other]["output_throughput"]
            row[f"x_{other}"] = summary["output_throughput"] / base if base else None
        rows.append(row)
    return rows


def goal_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 7's throughput goals, met or missed, for the systems that ran."""
    lines = []
    for system, against, target in GOALS:
        if system not in runs or against not in runs or not runs[against]["output_throughput"]:
            continue
        ratio = runs[system]["output_throughput"] / runs[against]["output_throughput"]
        verdict = "met" if ratio >= target else "MISSED"
        lines.append(f"{system} / {against} output tok/s = {ratio:.2f}x "
                     f"(goal >= {target:g}x): {verdict}")
    return lines


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    names = [row["system"] for row in rows]
    header = ["system", "out tok/s", "req/s", "TTFT p50 ms", "TPOT ms", "e2e p50 ms", "hit"]
    header += [f"x {SHORT.get(name, name)}" for name in names]
    lines = [header]
    for row in rows:
        line = [row["system"], _num(row["output_throughput"], 2),
                _num(row["request_throughput"], 3), _num(row["ttft_p50_ms"], 0),
                _num(row["tpot_mean_ms"], 1), _num(row["e2e_p50_ms"], 0),
                "-" if row["hit_rate"] is None else f"{row['hit_rate']:.1%}"]
        line += [_num(row[f"x_{name}"], 2) for name in names]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def _num(value: float | None, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


# ----------------------------------------------------------------------------- the servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RunningServer:
    base_url: str
    pid: int


@contextmanager
def radixkv_server(
    model: str | None, server_args: Sequence[str], log_path: Path, timeout_s: float = 900.0
) -> Iterator[RunningServer]:
    """A `radixkv serve` child process on a free port, yielded once /health is 200; stopped
    (SIGINT, then SIGKILL) on the way out."""
    port = free_port()
    command = [sys.executable, "-m", "radixkv.cli", "serve"]
    command += [model] if model else []
    command += ["--port", str(port), *server_args]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env=env)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, base_url, timeout_s, log_path)
            yield RunningServer(base_url, proc.pid)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], base_url: str, timeout_s: float,
                  log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the server exited with code {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not ready within {timeout_s} s (log: {log_path})")


def server_args(args: argparse.Namespace, concurrency: int, width: int,
                prefix_cache: bool) -> list[str]:
    result = ["--num-threads", str(args.num_threads),
              "--max-num-seqs", str(max(64, concurrency * width))]
    if args.kv_cache_tokens is not None:
        result += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    if not prefix_cache:
        result.append("--no-prefix-cache")
    return result + list(args.server_arg)


def run_server_system(
    workload: Workload, args: argparse.Namespace, concurrency: int, prefix_cache: bool,
    log_dir: Path,
) -> dict[str, Any]:
    width = max(r.n for r in workload.requests)
    name = "cache" if prefix_cache else "nocache"
    log_path = log_dir / f"server_{name}_c{concurrency}.log"
    profile = None
    if args.profile:
        profile = RESULTS / f"compare_profile_{workload.config.kind}_{name}_c{concurrency}.txt"
    with radixkv_server(args.model, server_args(args, concurrency, width, prefix_cache),
                        log_path) as server, py_spy(server.pid, profile):
        summary = measure_server(server.base_url, workload, concurrency, args.endpoint)
    if profile is not None and profile.exists():
        summary["profile"] = {"file": profile.name, "top": profile_summary(profile)}
    return summary


@contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """Sample the server and its engine processes with py-spy (collapsed stacks) while the
    block runs; nothing when `out` is None."""
    if out is None:
        yield
        return
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc = subprocess.Popen([binary, "record", "--pid", str(pid), "--subprocesses",
                             "--nonblocking", "--rate", "20", "--format", "raw",
                             "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def profile_summary(path: Path, top: int = 10) -> dict[str, Any]:
    """Per engine process (front, scheduler, worker) of a collapsed-stack file: its share of
    all samples, the functions on most of its stacks (inclusive, frames on nearly every stack
    left out) and the leaf functions (self time), each with its share of the process's
    samples."""
    inclusive: dict[str, Counter[str]] = {}
    leaves: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, text = line.rpartition(" ")
        if not stack or not text.isdigit():
            continue
        count = int(text)
        frames = stack.split(";")
        depth = max(i for i, f in enumerate(frames) if f.startswith("process "))
        role = _process_role(frames[depth])
        functions = [f.split(" (")[0] for f in frames[depth + 1 :]]
        totals[role] += count
        for name in set(functions):
            inclusive.setdefault(role, Counter())[name] += count
        if functions:
            leaves.setdefault(role, Counter())[functions[-1]] += count
    everything = sum(totals.values())
    report: dict[str, Any] = {}
    for role, total in totals.most_common():
        on_most = [(n, c) for n, c in inclusive[role].most_common() if c < 0.95 * total]
        report[role] = {
            "share_of_samples": total / everything,
            "inclusive": {n: round(c / total, 3) for n, c in on_most[:top]},
            "self": {n: round(c / total, 3) for n, c in leaves[role].most_common(top)},
        }
    return report


def _process_role(process: str) -> str:
    for module, role in (("radixkv.worker", "worker"), ("radixkv.scheduler", "scheduler"),
                         ("radixkv.cli", "front")):
        if module in process:
            return role
    return process[:60]


def measure_server(base_url: str, workload: Workload, concurrency: int,
                   endpoint: str = "chat") -> dict[str, Any]:
    """The serving client's summary of one run, with the server's KV report (no timeline)."""
    model_name = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    options = ClientOptions(base_url=base_url, model=model_name, endpoint=endpoint,
                            concurrency=concurrency, seed=workload.config.seed)
    result = asyncio.run(run_benchmark(workload, options))
    if "skipped" in result:
        raise RuntimeError(result["skipped"])
    summary = dict(result["summary"])
    kv = result.get("server_kv") or {}
    summary["server_kv"] = {k: v for k, v in kv.items() if k != "timeline"}
    return summary


# ------------------------------------------------------------------------- the baseline


def load_transformers_model(model: str | None, num_threads: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from radixkv.checkpoint import default_model_path

    torch.set_num_threads(num_threads)
    path = Path(model) if model else default_model_path()
    if path.is_dir():
        loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return loaded.eval()


def run_transformers(model: Any, workload: Workload, batch_size: int) -> dict[str, Any]:
    """Static batches of `batch_size` requests in workload order; every request in a batch
    finishes when the batch does."""
    import torch

    requests = workload.requests
    out_len = workload.config.output_tokens
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    pad = int(pad[0] if isinstance(pad, list) else (pad if pad is not None else 0))
    latencies: list[float] = []
    output_tokens = prompt_tokens = 0
    started = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + list(r.prompt_token_ids)
                            for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids))
                             + [1] * len(r.prompt_token_ids) for r in batch])
        batch_started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, pad_token_id=pad,
                                 max_new_tokens=out_len, min_new_tokens=out_len,
                                 **_generate_mode(batch[0]))
        latencies += [time.perf_counter() - batch_started] * len(batch)
        output_tokens += out[:, width:].numel()  # min_new_tokens: every row is out_len long
        prompt_tokens += sum(len(r.prompt_token_ids) for r in batch)
    duration = time.perf_counter() - started
    absent = distribution([])
    return {
        "completed": len(requests), "failed": 0, "duration_s": duration,
        "request_throughput": len(requests) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "cached_tokens": 0,
        "hit_rate": None, "ttft_ms": absent, "tpot_ms": absent, "itl_ms": absent,
        "e2e_ms": distribution(latencies, 1000.0),
    }


def _generate_mode(request: Any) -> dict[str, Any]:
    if request.use_beam_search:
        return {"do_sample": False, "num_beams": request.n, "num_return_sequences": request.n}
    if request.n > 1 or request.temperature > 0:
        return {"do_sample": True, "temperature": request.temperature or 1.0, "top_k": 0,
                "top_p": 1.0, "num_return_sequences": request.n}
    return {"do_sample": False}


# --------------------------------------------------------------------------------- main


def parse_concurrencies(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency must be positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: the built-in SmolLM2)")
    parser.add_argument("--concurrency", type=parse_concurrencies, default=[16],
                        help="one value, or a comma-separated sweep (1,4,16)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536,
                        help="the servers' KV pool (65,536 SmolLM2 tokens are 2.8 GiB)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of: {', '.join(SYSTEMS)}")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more argument for both servers (repeatable)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default bench/results/compare_<workload>.json)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy the servers while they serve; collapsed stacks to "
                             "bench/results/compare_profile_*.txt, a summary in the JSON")
    add_workload_options(parser)
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    config = workload_config(args)
    header = result_header("compare", {
        "workload": config.to_dict(), "concurrency": args.concurrency, "systems": systems,
        "model": args.model or "default (SmolLM2-135M-Instruct, fp32)",
        "num_threads": args.num_threads, "kv_cache_tokens": args.kv_cache_tokens,
        "endpoint": args.endpoint, "server_args": args.server_arg,
    })
    print("config:", json.dumps(header["config"]))
    print(f"seed: {config.seed}")
    workload = build_workload(config, load_tokenizer(args.model))
    print("workload:", json.dumps(workload.describe()))

    runs: dict[int, dict[str, dict[str, Any]]] = {c: {} for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="radixkv-compare-") as tmp:
        for prefix_cache, name in ((True, RADIXKV), (False, NO_CACHE)):
            if name not in systems:
                continue
            for c in args.concurrency:
                print(f"[{name}] concurrency {c} ...", flush=True)
                runs[c][name] = run_server_system(workload, args, c, prefix_cache, Path(tmp))
                print(f"[{name}] concurrency {c}: "
                      f"{runs[c][name]['output_throughput']:.2f} output tok/s", flush=True)
    if BASELINE in systems:
        model = load_transformers_model(args.model, args.num_threads)
        run_transformers(model, _warmup_workload(workload), 1)
        for c in args.concurrency:
            print(f"[{BASELINE}] batch size {c} ...", flush=True)
            runs[c][BASELINE] = run_transformers(model, workload, c)
            print(f"[{BASELINE}] batch size {c}: "
                  f"{runs[c][BASELINE]['output_throughput']:.2f} output tok/s", flush=True)

    result = {**header, "workload": workload.describe(), "runs": {}, "goals": {}}
    for c in args.concurrency:
        rows = ratio_table(runs[c])
        print(f"\nworkload {config.kind}, concurrency {c}:")
        print(format_table(rows))
        goals = goal_lines(runs[c]) if config.kind == "a" else []
        for line in goals:
            print(line)
        result["runs"][str(c)] = {"systems": runs[c], "table": rows}
        result["goals"][str(c)] = goals
    write_result(args.out or RESULTS / f"compare_{config.kind}.json", result)
    return 0


def _warmup_workload(workload: Workload) -> Workload:
    """One short request, so the baseline's first-call costs stay out of its timing."""
    first = workload.requests[0]
    short = type(first)(messages=first.messages, prompt_token_ids=first.prompt_token_ids[:8],
                        max_tokens=first.max_tokens, n=first.n,
                        use_beam_search=first.use_beam_search, temperature=first.temperature)
    config = type(workload.config)(**{**workload.config.to_dict(), "output_tokens": 2})
    return Workload(config, ((short,),))


if __name__ == "__main__":
    sys.exit(main())
