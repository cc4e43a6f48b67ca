"""Where the KV sharing core's time goes, in measures this noisy VM cannot move.

    python bench/kvcache_costs.py --trace /tmp/kv_trace.jsonl [--opcode-requests 3000]

Prints its configuration, then JSON (also written to --json-out):

- `bytecodes_per_request`: Python bytecodes executed per request (an opcode tracer over the
  replay of the trace's first --opcode-requests requests), with admitted prompts cached and
  with `--cache-at-finish-only`'s replay. Deterministic: what a change costs or saves.
- `grow_ns_per_seq`: one `grow` call per sequence against one `grow_each` call for all,
  32 sequences on their fast path (best of --timeit-repeat timeit runs).
- `alternating_requests_per_s`: --alternations replays of the whole trace in one process,
  alternating the two modes so both see the same machine phases; median and all runs.

Same pool, running limit and block size options as bench_kvcache.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from itertools import repeat
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kvcache import TraceRequest, load_trace, replay  # noqa: E402

from radixkv.kvcache import KVCacheManager, SeqId  # noqa: E402


def bytecodes_per_request(
    requests: list[TraceRequest], num_blocks: int, block_size: int, max_running: int,
    cache_prompts: bool,
) -> float:
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return tracer

    manager = KVCacheManager(num_blocks, block_size)
    sys.settrace(tracer)
    try:
        replay(manager, requests, max_running, 0, cache_prompts)
    finally:
        sys.settrace(None)
    return round(count / len(requests), 1)


def grow_ns_per_seq(num_seqs: int, timeit_repeat: int) -> dict[str, float]:
    manager = KVCacheManager(num_seqs, 1 << 30)  # one huge block each: always the fast path
    seq_ids = [SeqId(i) for i in range(num_seqs)]
    for seq_id in seq_ids:
        manager.admit(seq_id, [1], None)
    grow, grow_each = manager.grow, manager.grow_each
    number = 2_000
    times = {
        "grow": timeit.repeat(
            lambda: list(map(grow, seq_ids, repeat(1))), number=number, repeat=timeit_repeat
        ),
        "grow_each": timeit.repeat(
            lambda: grow_each(seq_ids, 1), number=number, repeat=timeit_repeat
        ),
    }
    return {name: round(min(t) / number / num_seqs * 1e9, 1) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvcache_costs.py")
    parser.add_argument("--trace", required=True)
    parser.add_argument("--kv-tokens", type=int, default=65_536)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--opcode-requests", type=int, default=3_000)
    parser.add_argument("--alternations", type=int, default=7)
    parser.add_argument("--timeit-repeat", type=int, default=5)
    parser.add_argument("--json-out", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    print("config: " + json.dumps(vars(args)), flush=True)
    requests = load_trace(Path(args.trace))
    num_blocks = args.kv_tokens // args.block_size
    head = requests[: args.opcode_requests]
    modes = {"cache_prompts": True, "cache_at_finish_only": False}
    result: dict[str, object] = {
        "bytecodes_per_request": {
            name: bytecodes_per_request(
                head, num_blocks, args.block_size, args.max_running, cache_prompts
            )
            for name, cache_prompts in modes.items()
        },
        "grow_ns_per_seq": grow_ns_per_seq(args.max_running, args.timeit_repeat),
    }
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.alternations):
        for name, cache_prompts in modes.items():
            manager = KVCacheManager(num_blocks, args.block_size)
            run = replay(manager, requests, args.max_running, 0, cache_prompts)
            rates[name].append(round(len(requests) / run.elapsed_s, 1))
    result["alternating_requests_per_s"] = {
        name: {"median": statistics.median(runs), "runs": runs} for name, runs in rates.items()
    }
    result["config"] = vars(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
