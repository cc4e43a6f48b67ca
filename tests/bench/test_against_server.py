"""The serving client against a real `radixkv serve` of the tiny model (started the way
compare.py starts its servers), and compare.py's transformers baseline end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import bench_serving
import compare
import pytest
from workloads import WorkloadConfig, build_workload

TINY = ["--num-system-prompts", "2", "--system-tokens", "40", "--question-tokens", "8",
        "--output-tokens", "4", "--prompt-tokens", "16", "--n", "2"]


@pytest.fixture(scope="module")
def server_url(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    with compare.radixkv_server(str(tiny_llama_dir), ["--kv-cache-tokens", "4096",
                                                      "--num-threads", "1"], log) as server:
        yield server.base_url


def serve_bench(url: str, tiny_dir: Path, out: Path, *args: str) -> dict:
    code = bench_serving.main(["--base-url", url, "--tokenizer", str(tiny_dir), "--out",
                               str(out), *TINY, *args])
    assert code == 0
    return json.loads(out.read_text())


def test_shared_prompts_hit_the_cache(server_url: str, tiny_llama_dir: Path,
                                      tmp_path: Path) -> None:
    result = serve_bench(server_url, tiny_llama_dir, tmp_path / "a.json", "--workload", "a",
                         "--num-requests", "8", "--concurrency", "3")
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (8, 0)
    assert s["output_tokens"] == 8 * 4  # ignore_eos: exactly O each
    assert s["prompt_tokens_mismatched"] == 0  # the server's template gives our token ids
    assert s["prompt_tokens"] == sum(r["expected_prompt_tokens"] for r in result["requests"])
    # two 40-token system prompts over 8 requests: at least 6 repeats are hits
    assert s["hit_rate"] > 0.3
    assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["mean"] > 0
    assert result["config"]["workload"]["seed"] == 0 and result["machine"]["num_cpus"]
    kv = result["server_kv"]
    assert kv is not None and kv["counters"]["radixkv_prefix_cache_hit_tokens"] > 0


def test_samples_beams_and_completions(server_url: str, tiny_llama_dir: Path,
                                       tmp_path: Path) -> None:
    d = serve_bench(server_url, tiny_llama_dir, tmp_path / "d.json", "--workload", "d",
                    "--num-requests", "3", "--request-rate", "20")
    assert d["summary"]["completed"] == 3 and d["summary"]["output_tokens"] == 3 * 2 * 4
    assert all(len(r["chunk_times"]) == 2 for r in d["requests"])  # both choices streamed
    e = serve_bench(server_url, tiny_llama_dir, tmp_path / "e.json", "--workload", "e",
                    "--num-requests", "2")
    assert e["summary"]["completed"] == 2 and e["summary"]["output_tokens"] == 2 * 2 * 4
    b = serve_bench(server_url, tiny_llama_dir, tmp_path / "b.json", "--workload", "b",
                    "--num-requests", "4", "--turns", "2", "--endpoint", "completions")
    assert b["summary"]["completed"] == 4
    later_turns = [r for r in b["requests"] if r["turn"] == 1]
    assert all(r["cached_tokens"] > 0 for r in later_turns)  # the history was cached


def test_measure_server_summary(server_url: str, tiny_tokenizer: object) -> None:
    workload = build_workload(WorkloadConfig(kind="c", num_requests=4, preamble_tokens=60,
                                             agent_steps=2, question_tokens=8, output_tokens=3),
                              tiny_tokenizer)  # type: ignore[arg-type]
    summary = compare.measure_server(server_url, workload, concurrency=2)
    assert summary["completed"] == 4 and summary["output_tokens"] == 12
    assert summary["server_kv"]["counters"]["radixkv_prefix_cache_queried_tokens"] > 0
    assert "timeline" not in summary["server_kv"]


def test_compare_baseline_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    code = compare.main(["--model", str(tiny_llama_dir), "--systems", "transformers",
                         "--concurrency", "2,3", "--num-threads", "1", "--workload", "a",
                         "--num-requests", "5", "--out", str(out), *TINY])
    assert code == 0
    result = json.loads(out.read_text())
    for c in ("2", "3"):
        run = result["runs"][c]["systems"]["transformers"]
        assert run["completed"] == 5 and run["output_tokens"] == 5 * 4
        assert run["output_throughput"] > 0
        assert result["runs"][c]["table"][0]["system"] == "transformers"
    assert result["config"]["concurrency"] == [2, 3]
