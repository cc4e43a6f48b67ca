"""bench/compare.py: the ratio table and goal verdicts from made-up runs, argument handling."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from compare import (
    BASELINE,
    NO_CACHE,
    RADIXKV,
    format_table,
    goal_lines,
    parse_concurrencies,
    ratio_table,
    server_args,
)


def summary(output_tps: float, hit: float | None = None) -> dict[str, Any]:
    return {"output_throughput": output_tps, "request_throughput": output_tps / 64,
            "ttft_ms": {"p50": 120.0}, "tpot_ms": {"mean": 40.0}, "e2e_ms": {"p50": 3000.0},
            "hit_rate": hit}


def test_ratios_are_output_throughput_over_each_other_system() -> None:
    runs = {BASELINE: summary(20.0), RADIXKV: summary(130.0, 0.8), NO_CACHE: summary(40.0, 0.0)}
    rows = ratio_table(runs)
    assert [row["system"] for row in rows] == [RADIXKV, NO_CACHE, BASELINE]  # fixed order
    by_name = {row["system"]: row for row in rows}
    assert by_name[RADIXKV][f"x_{BASELINE}"] == pytest.approx(6.5)
    assert by_name[RADIXKV][f"x_{NO_CACHE}"] == pytest.approx(3.25)
    assert by_name[NO_CACHE][f"x_{BASELINE}"] == pytest.approx(2.0)
    assert by_name[BASELINE][f"x_{RADIXKV}"] == pytest.approx(20 / 130)
    assert by_name[RADIXKV][f"x_{RADIXKV}"] == 1.0
    assert by_name[RADIXKV]["hit_rate"] == 0.8
    assert by_name[RADIXKV]["ttft_p50_ms"] == 120.0


def test_goal_verdicts() -> None:
    met = goal_lines({BASELINE: summary(20.0), RADIXKV: summary(100.0), NO_CACHE: summary(33.3)})
    assert met == [
        f"{RADIXKV} / {BASELINE} output tok/s = 5.00x (goal >= 5x): met",
        f"{RADIXKV} / {NO_CACHE} output tok/s = 3.00x (goal >= 3x): met",
    ]
    missed = goal_lines({BASELINE: summary(30.0), RADIXKV: summary(100.0), NO_CACHE: summary(50.0)})
    assert [line.rsplit(": ", 1)[1] for line in missed] == ["MISSED", "MISSED"]
    assert "3.33x" in missed[0] and "2.00x" in missed[1]
    # a system that did not run, or produced nothing, gives no verdict
    assert goal_lines({RADIXKV: summary(100.0), BASELINE: summary(0.0)}) == []


def test_table_shows_missing_values_as_dashes() -> None:
    baseline = summary(20.0)
    baseline.update(ttft_ms={"p50": float("nan")}, tpot_ms={"mean": float("nan")})
    text = format_table(ratio_table({RADIXKV: summary(100.0, 0.5), BASELINE: baseline}))
    header, first, second = text.splitlines()
    assert header.split()[:3] == ["system", "out", "tok/s"]
    assert "x radixkv" in header and "x hf" in header
    assert first.split()[:3] == ["radixkv", "100.00", "1.562"] and "50.0%" in first
    assert second.split() == ["transformers", "20.00", "0.312", "-", "-", "3000", "-", "0.20",
                              "1.00"]


def test_concurrency_list_and_server_arguments() -> None:
    assert parse_concurrencies("1,4, 16") == [1, 4, 16]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_concurrencies("0,4")
    args = argparse.Namespace(num_threads=2, kv_cache_tokens=65536, server_arg=["--seed", "3"])
    assert server_args(args, 16, 4, prefix_cache=False) == [
        "--num-threads", "2", "--max-num-seqs", "64", "--kv-cache-tokens", "65536",
        "--no-prefix-cache", "--seed", "3"]
    assert server_args(args, 32, 4, prefix_cache=True)[3] == "128"
