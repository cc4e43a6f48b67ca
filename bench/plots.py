"""PNG plots from the benchmark results in bench/results/.

    python bench/plots.py [--compare bench/results/compare_a_sweep.json]
                          [--memory bench/results/memory_a.json]

  throughput_vs_concurrency.png  output tokens/s against concurrency, one line per system
                                 (a compare.py run with a --concurrency sweep)
  kv_utilisation.png             KV reserved and the share of it holding real tokens, engine
                                 step by step: paged + shared, paged, contiguous (bench_memory)
  hit_rate_by_workload.png       prefix-cache hit rate per workload: measured through the
                                 server (serving_*.json, compare_*.json), in the engine's own
                                 accounting (memory_*.json), and the best an unbounded cache
                                 could do
A plot whose input is missing is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = {"a": "shared system\nprompts", "b": "multi-turn", "c": "agent loop",
             "d": "parallel\nsampling n=4", "e": "beam search\nwidth 4"}
COLOURS = {"radixkv": "tab:blue", "radixkv --no-prefix-cache": "tab:orange",
           "transformers": "tab:gray"}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _caption(result: dict[str, Any]) -> str:
    machine = result.get("machine", {})
    cpus = machine.get("num_cpus", "?")
    return f"{machine.get('cpu', '?')}, {cpus} CPUs, {result.get('date', '')}"


def throughput_vs_concurrency(compare: dict[str, Any], out: Path) -> None:
    levels = sorted(int(c) for c in compare["runs"])
    systems: list[str] = []
    for c in levels:
        systems += [s for s in compare["runs"][str(c)]["systems"] if s not in systems]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in systems:
        points = [(c, compare["runs"][str(c)]["systems"][system]["output_throughput"])
                  for c in levels if system in compare["runs"][str(c)]["systems"]]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system,
                color=COLOURS.get(system))
    workload = compare["config"]["workload"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight; baseline batch size)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Workload {workload['kind']}: {workload['num_requests']} requests, "
                 f"O={workload['output_tokens']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, _caption(compare), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def kv_utilisation(memory: dict[str, Any], out: Path) -> None:
    shared = memory["timeline"]["shared"]
    unshared = memory["timeline"]["unshared"]
    series = [
        ("paged + shared (radixkv)", shared, "allocated_slots", "live_tokens", "tab:blue"),
        ("paged, no sharing", unshared, "private_slots", "seq_tokens", "tab:green"),
        ("contiguous, context-length slab", unshared, "contiguous_slots", "seq_tokens",
         "tab:red"),
    ]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    for label, records, slots, held, colour in series:
        steps = [r["step"] for r in records]
        top.plot(steps, [r[slots] for r in records], label=label, color=colour)
        bottom.plot(steps, [100.0 * r[held] / r[slots] if r[slots] else float("nan")
                            for r in records], label=label, color=colour)
    top.set_yscale("log")
    top.set_ylabel("KV reserved (token slots)")
    bottom.set_ylabel("reserved KV holding tokens (%)")
    bottom.set_ylim(0, 105)
    bottom.set_xlabel("engine step")
    config = memory["config"]
    top.set_title(f"Workload {config['workload']['kind']}, concurrency {config['concurrency']}, "
                  f"block {config['block_size']}, context {config['context_len']}", fontsize=10)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="center right")
    fig.text(0.01, 0.01, _caption(memory), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


def hit_rates(results_dir: Path) -> dict[str, dict[str, float]]:
    """workload -> {source: hit rate} from whatever result files exist."""
    rates: dict[str, dict[str, float]] = {k: {} for k in WORKLOADS}
    for kind in WORKLOADS:
        memory = _load(results_dir / f"memory_{kind}.json")
        if memory is not None:
            rates[kind]["engine accounting (bench_memory)"] = memory["engine_hit_rate"]
            rates[kind]["best possible (unbounded cache)"] = memory["workload"]["ideal_hit_rate"]
        serving = _load(results_dir / f"serving_{kind}.json")
        if serving is not None and serving.get("summary", {}).get("hit_rate") is not None:
            rates[kind]["server cached_tokens (bench_serving)"] = serving["summary"]["hit_rate"]
            rates[kind].setdefault("best possible (unbounded cache)",
                                   serving["workload"]["ideal_hit_rate"])
    return {k: v for k, v in rates.items() if v}


def hit_rate_by_workload(rates: dict[str, dict[str, float]], out: Path) -> None:
    sources = sorted({s for v in rates.values() for s in v})
    kinds = list(rates)
    width = 0.8 / len(sources)
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for i, source in enumerate(sources):
        xs = [k + (i - (len(sources) - 1) / 2) * width for k in range(len(kinds))]
        ys = [100.0 * rates[kind].get(source, float("nan")) for kind in kinds]
        ax.bar(xs, ys, width, label=source)
    ax.set_xticks(range(len(kinds)), [f"({k}) {WORKLOADS[k]}" for k in kinds], fontsize=8)
    ax.set_ylabel("prompt tokens served from the cache (%)")
    ax.set_ylim(0, 105)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Prefix-cache hit rate by workload", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--compare", type=Path, default=None,
                        help="default: compare_a_sweep.json in the results folder")
    parser.add_argument("--memory", type=Path, default=None,
                        help="default: memory_a.json in the results folder")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: the results folder")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or args.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    compare = _load(args.compare or args.results_dir / "compare_a_sweep.json")
    if compare is None:
        print("no compare sweep result: skipping throughput_vs_concurrency.png")
    else:
        throughput_vs_concurrency(compare, out_dir / "throughput_vs_concurrency.png")
        print(f"wrote {out_dir / 'throughput_vs_concurrency.png'}")
    memory = _load(args.memory or args.results_dir / "memory_a.json")
    if memory is None:
        print("no memory result: skipping kv_utilisation.png")
    else:
        kv_utilisation(memory, out_dir / "kv_utilisation.png")
        print(f"wrote {out_dir / 'kv_utilisation.png'}")
    rates = hit_rates(args.results_dir)
    if not rates:
        print("no memory or serving results: skipping hit_rate_by_workload.png")
    else:
        hit_rate_by_workload(rates, out_dir / "hit_rate_by_workload.png")
        print(f"wrote {out_dir / 'hit_rate_by_workload.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
