"""Replay a request trace through the KV sharing core; or write such a trace.

    python bench/bench_kvcache.py gen --out /tmp/kv_trace.jsonl [--n-samples 4]
    python bench/bench_kvcache.py --trace /tmp/kv_trace.jsonl --kv-tokens 65536 \\
        --max-running 32 --block-size 16

A trace is JSONL, one request per line: {"id": str, "prompt": [int], "output": [int]}, plus
"extra_outputs": [[int], ...] for a parallel-sampling group (forked after admission instead
of admitted again). `gen` also writes <out>.meta.json with its parameters and seed.

The replay is a fixed simulation, single thread: FCFS; at most --max-running sequences; each
step admits waiting requests while it can (`admit` matches the prompt minus its last token and
allocates the rest), then every running sequence grows by one output token, and sequences
whose outputs are complete are cached and freed (`free` with all their tokens). An admitted
prompt's prefill happens in the step that admits it, so its full blocks are cached right away
(`cache`), as the engine's scheduler does after every prefill chunk (and SGLang's radix cache
and vLLM's prefix cache do after prefill): a request admitted later, in the same step or not,
hits them while the first is still running. `--cache-at-finish-only` skips that, caching a
sequence only when it finishes. When a grow finds no block, the newest running request is
preempted (freed with its tokens, requeued at the front, restarted).

Wall-clock time on a shared VM varies from run to run (up to +-25% here), so the replay runs
`--repeat` times (default 5), each time on a fresh manager; `requests_per_s` is the median
run's, every run's rate is listed. The last output line is JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import random
import sys
import time
from array import array
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixkv.kvcache import KVCacheManager, KVCacheStats, SeqId

VOCAB_SIZE = 32_000


TokenIds = Sequence[int]  # array("I") by default, tuples with --tuples


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    prompt: TokenIds
    outputs: tuple[TokenIds, ...]  # one per sequence of the group
    full: tuple[TokenIds, ...]  # prompt + output, per sequence


# --------------------------------------------------------------------------------- gen


def zipf_weights(num_items: int, exponent: float) -> list[float]:
    return [1.0 / (rank**exponent) for rank in range(1, num_items + 1)]


def generate_trace(
    out: Path,
    num_requests: int,
    num_system_prompts: int,
    n_samples: int,
    seed: int,
) -> dict[str, object]:
    """Write the trace; returns its parameters (also written to <out>.meta.json)."""
    rng = random.Random(seed)
    sample_rng = random.Random(seed + 1)  # extra samples never shift the prompts
    system_prompts = [
        [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(512, 2048))]
        for _ in range(num_system_prompts)
    ]
    weights = zipf_weights(num_system_prompts, 1.1)
    with out.open("w") as f:
        for index in range(num_requests):
            system = rng.choices(system_prompts, weights)[0]
            suffix = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(32, 256))]
            output = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(16, 128))]
            record: dict[str, object] = {
                "id": f"req-{index:06d}",
                "prompt": system + suffix,
                "output": output,
            }
            if n_samples > 1:
                record["extra_outputs"] = [
                    [sample_rng.randrange(VOCAB_SIZE) for _ in range(sample_rng.randint(16, 128))]
                    for _ in range(n_samples - 1)
                ]
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    meta: dict[str, object] = {
        "num_requests": num_requests,
        "num_system_prompts": num_system_prompts,
        "system_prompt_len": [512, 2048],
        "zipf_exponent": 1.1,
        "suffix_len": [32, 256],
        "output_len": [16, 128],
        "vocab_size": VOCAB_SIZE,
        "n_samples": n_samples,
        "seed": seed,
    }
    Path(str(out) + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# ------------------------------------------------------------------------------ replay


def load_trace(path: Path, packed: bool = True) -> list[TraceRequest]:
    """Read a trace. Token ids are kept as array("I") (4 bytes a token, the form the KV
    manager packs without a per-token conversion, as vLLM keeps its token ids), or with
    `packed=False` as tuples of Python ints (what a scheduler holding lists passes)."""
    container = (lambda ids: array("I", ids)) if packed else tuple
    requests = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            outputs = [record["output"], *record.get("extra_outputs", ())]
            if not record["prompt"] or any(not output for output in outputs):
                raise SystemExit(f"request {record['id']}: empty prompt or output")
            requests.append(
                TraceRequest(
                    record["id"],
                    container(record["prompt"]),
                    tuple(container(output) for output in outputs),
                    tuple(container(record["prompt"] + output) for output in outputs),
                )
            )
    return requests


@dataclass
class ReplayResult:
    elapsed_s: float
    cpu_s: float
    num_steps: int
    num_sequences: int
    peak_blocks_used: int
    num_preemptions: int


def replay(
    manager: KVCacheManager,
    requests: list[TraceRequest],
    max_running: int,
    check_every: int = 0,
    cache_prompts: bool = True,
) -> ReplayResult:
    """Run the fixed simulation to completion; see the module docstring."""
    admit, fork, grow_each, free = manager.admit, manager.fork, manager.grow_each, manager.free
    cache = manager.cache if cache_prompts else None
    num_blocks = manager.num_blocks
    waiting: deque[int] = deque(range(len(requests)))
    running: list[SeqId] = []  # admission order: the newest last
    live: dict[SeqId, tuple[TokenIds, int]] = {}  # seq -> (all its tokens, request)
    finish_at: defaultdict[int, list[SeqId]] = defaultdict(list)  # step -> seqs done after it
    next_seq_id = step = num_sequences = peak = num_preemptions = 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    while waiting or running:
        while waiting and len(running) < max_running:
            index = waiting[0]
            request = requests[index]
            group_size = len(request.outputs)
            if len(running) + group_size > max_running:
                break
            leader = SeqId(next_seq_id)
            if admit(leader, request.prompt, None) is None:
                break
            waiting.popleft()
            if cache is not None:  # its prefill is this step: later admissions may hit it
                cache(leader, request.prompt)
            for sample in range(group_size):
                seq_id = SeqId(next_seq_id + sample)
                if sample:
                    fork(leader, seq_id)
                running.append(seq_id)
                live[seq_id] = (request.full[sample], index)
                finish_at[step + len(request.outputs[sample]) - 1].append(seq_id)
            next_seq_id += group_size
            num_sequences += group_size
        if not running:
            raise SystemExit(
                f"request {requests[waiting[0]].request_id} does not fit in an empty pool"
            )
        grown = grow_each(running, 1)  # every running sequence: one more token
        if not all(grown):  # a Growth is always truthy, a failed grow is None
            num_preemptions += _grow_with_preemption(manager, running, grown, live, waiting)
        done = finish_at.pop(step, None)
        if done:
            for seq_id in done:
                entry = live.pop(seq_id, None)
                if entry is not None:  # else preempted meanwhile
                    free(seq_id, entry[0])
                    running.remove(seq_id)
        step += 1
        used = num_blocks - manager.num_available_blocks()
        if used > peak:
            peak = used
        if check_every and step % check_every == 0:
            manager.check_invariants()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return ReplayResult(elapsed, cpu, step, num_sequences, peak, num_preemptions)


def _grow_with_preemption(
    manager: KVCacheManager,
    running: list[SeqId],
    grown: list[object],
    live: dict[SeqId, tuple[TokenIds, int]],
    waiting: deque[int],
) -> int:
    """Retry the grows that found no block, preempting the newest running request (freed
    with its tokens, requeued first, restarted later) until each succeeds or is preempted
    itself. Edits `running` in place; returns how many requests were preempted."""
    num_preemptions = 0
    for seq_id, growth in zip(list(running), grown, strict=True):
        if growth is not None:
            continue
        while seq_id in live and manager.grow(seq_id, 1) is None:
            victim = live[running[-1]][1]
            num_preemptions += 1
            for other in [s for s in running if live[s][1] == victim]:
                tokens = live.pop(other)[0]
                manager.free(other, tokens[: manager.num_tokens(other)])
                running.remove(other)
            waiting.appendleft(victim)
    return num_preemptions


def run_replay(args: argparse.Namespace) -> dict[str, object]:
    trace = Path(args.trace)
    meta_path = Path(str(trace) + ".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    num_blocks = args.kv_tokens // args.block_size
    config = {
        "trace": str(trace),
        "trace_meta": meta,
        "seed": meta["seed"] if meta else None,
        "kv_tokens": args.kv_tokens,
        "block_size": args.block_size,
        "num_blocks": num_blocks,
        "max_running": args.max_running,
        "token_ids": "tuple" if args.tuples else "array('I')",
        "cache_prompts": not args.cache_at_finish_only,
        "repeat": 1 if args.profile else args.repeat,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
    }
    print("config: " + json.dumps(config), flush=True)
    requests = load_trace(trace, packed=not args.tuples)
    runs: list[tuple[ReplayResult, KVCacheStats]] = []
    for _ in range(1 if args.profile else args.repeat):
        manager = KVCacheManager(num_blocks, args.block_size)
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        result = replay(
            manager, requests, args.max_running, args.check_every, not args.cache_at_finish_only
        )
        if profiler is not None:
            profiler.disable()
            stats = pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime")
            stats.print_stats(25)
        manager.check_invariants()
        runs.append((result, manager.stats()))
    outcomes = {(kv.hit_tokens, kv.evicted_blocks, run.num_steps) for run, kv in runs}
    assert len(outcomes) == 1, f"the replay is deterministic, but runs differ: {outcomes}"
    # the median run (of two middle ones, the slower)
    result, kv = sorted(runs, key=lambda run: run[0].elapsed_s)[len(runs) // 2]
    summary: dict[str, object] = {
        "requests_per_s": round(len(requests) / result.elapsed_s, 1),
        "requests_per_cpu_s": round(len(requests) / result.cpu_s, 1),
        "sequences_per_s": round(result.num_sequences / result.elapsed_s, 1),
        "requests_per_s_runs": [round(len(requests) / run.elapsed_s, 1) for run, _ in runs],
        "hit_rate": round(kv.hit_rate, 4),
        "evicted_blocks": kv.evicted_blocks,
        "peak_blocks_used": result.peak_blocks_used,
        "invariants": "ok",
        "num_requests": len(requests),
        "num_sequences": result.num_sequences,
        "num_steps": result.num_steps,
        "num_preemptions": result.num_preemptions,
        "elapsed_s": round(result.elapsed_s, 3),
        "cpu_s": round(result.cpu_s, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "hit_tokens": kv.hit_tokens,
        "queried_tokens": kv.queried_tokens,
        "profiled": bool(args.profile),
        "config": config,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gen"]:
        parser = argparse.ArgumentParser(prog="bench_kvcache.py gen")
        parser.add_argument("--out", required=True)
        parser.add_argument("--num-requests", type=int, default=10_000)
        parser.add_argument("--num-system-prompts", type=int, default=20)
        parser.add_argument("--n-samples", type=int, default=1)
        parser.add_argument("--seed", type=int, default=0)
        args = parser.parse_args(argv[1:])
        if args.n_samples < 1:
            parser.error("--n-samples must be >= 1")
        print(f"gen: {json.dumps(vars(args))}", flush=True)
        meta = generate_trace(
            Path(args.out), args.num_requests, args.num_system_prompts, args.n_samples, args.seed
        )
        print(json.dumps({"out": args.out, **meta}))
        return
    parser = argparse.ArgumentParser(prog="bench_kvcache.py")
    parser.add_argument("--trace", required=True)
    parser.add_argument("--kv-tokens", type=int, default=65_536)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--check-every", type=int, default=0, help="check invariants every N steps")
    parser.add_argument("--profile", action="store_true", help="cProfile one replay (slower)")
    parser.add_argument(
        "--repeat", type=int, default=5, help="replays to run; the median one is reported"
    )
    parser.add_argument(
        "--cache-at-finish-only",
        action="store_true",
        help="do not cache admitted prompts; cache sequences only when they finish",
    )
    parser.add_argument("--json-out", help="also write the summary JSON to this file")
    parser.add_argument(
        "--tuples",
        action="store_true",
        help="hold token ids as tuples of ints instead of array('I') (see load_trace)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    print(json.dumps(run_replay(args)))


if __name__ == "__main__":
    main()
