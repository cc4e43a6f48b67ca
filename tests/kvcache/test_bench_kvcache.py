"""bench/bench_kvcache.py end to end on a small trace: gen, replay, fork groups, last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_kvcache.py"


def run(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip().splitlines()


@pytest.mark.parametrize("n_samples", [1, 3])
def test_gen_then_replay(tmp_path: Path, n_samples: int) -> None:
    trace = tmp_path / "trace.jsonl"
    run("gen", "--out", str(trace), "--num-requests", "24", "--num-system-prompts", "3",
        "--n-samples", str(n_samples))
    lines = trace.read_text().splitlines()
    assert len(lines) == 24
    first = json.loads(lines[0])
    extra = {"extra_outputs"} if n_samples > 1 else set()
    assert set(first) == {"id", "prompt", "output"} | extra
    assert 512 + 32 <= len(first["prompt"]) <= 2048 + 256
    assert 16 <= len(first["output"]) <= 128
    assert json.loads((tmp_path / "trace.jsonl.meta.json").read_text())["seed"] == 0

    out = run("--trace", str(trace), "--kv-tokens", "8192", "--max-running", "6",
              "--block-size", "16", "--check-every", "3")
    assert out[0].startswith("config: ") and '"seed": 0' in out[0]
    summary = json.loads(out[-1])
    assert summary["invariants"] == "ok"
    assert summary["num_requests"] == 24
    assert summary["num_sequences"] == 24 * n_samples
    assert 0.0 < summary["hit_rate"] < 1.0
    for field in ("requests_per_s", "evicted_blocks", "peak_blocks_used"):
        assert field in summary

    again = json.loads(run("--trace", str(trace), "--kv-tokens", "8192", "--max-running", "6",
                           "--tuples")[-1])
    for field in ("hit_rate", "evicted_blocks", "peak_blocks_used", "num_steps"):
        assert again[field] == summary[field]  # the replay is deterministic


def test_admitted_prompts_are_cached_for_later_admissions(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    run("gen", "--out", str(trace), "--num-requests", "40", "--num-system-prompts", "2")
    common = ("--trace", str(trace), "--kv-tokens", "16384", "--max-running", "8")
    default = json.loads(run(*common, "--repeat", "3")[-1])
    assert default["config"]["cache_prompts"] is True and default["config"]["repeat"] == 3
    assert len(default["requests_per_s_runs"]) == 3
    assert default["requests_per_s"] == sorted(default["requests_per_s_runs"])[1]  # median
    at_finish = json.loads(run(*common, "--repeat", "1", "--cache-at-finish-only")[-1])
    assert at_finish["config"]["cache_prompts"] is False
    # the first requests of each system prompt run together: with prompts cached once
    # admitted, all but the very first of them hit the system prompt
    assert default["hit_tokens"] > at_finish["hit_tokens"]
    assert default["queried_tokens"] == at_finish["queried_tokens"]


def test_repeat_must_be_positive(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--trace", str(tmp_path / "none.jsonl"), "--repeat", "0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--repeat must be >= 1" in done.stderr


def test_costs_counts_bytecodes_deterministically(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    run("gen", "--out", str(trace), "--num-requests", "20", "--num-system-prompts", "2")
    costs = Path(__file__).resolve().parents[2] / "bench" / "kvcache_costs.py"
    args = [sys.executable, str(costs), "--trace", str(trace), "--kv-tokens", "8192",
            "--max-running", "6", "--opcode-requests", "20", "--alternations", "1",
            "--timeit-repeat", "1", "--json-out", str(tmp_path / "costs.json")]
    first = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    again = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert first.startswith("config: ")
    result, other = json.loads(first.splitlines()[-1]), json.loads(again.splitlines()[-1])
    assert other == json.loads((tmp_path / "costs.json").read_text())  # the last run's
    counts = result["bytecodes_per_request"]
    assert counts == other["bytecodes_per_request"]  # deterministic
    assert set(counts) == {"cache_prompts", "cache_at_finish_only"}
    assert all(count > 0 for count in counts.values())
    assert set(result["grow_ns_per_seq"]) == {"grow", "grow_each"}
    for rates in result["alternating_requests_per_s"].values():
        assert len(rates["runs"]) == 1 and rates["median"] == rates["runs"][0] > 0
