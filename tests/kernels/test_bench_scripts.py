"""The GPU benchmark and check script parse, count right, and run end to end on tiny shapes.

The end-to-end run uses the CPU (kernels interpreted) with a stand-in timer, so a GPU
session never finds a Python error in them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_kernels", ROOT / "bench" / "bench_kernels.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


def test_bench_help_runs_without_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--help"],
        capture_output=True, text=True, check=True,
    )
    assert "--dtype" in done.stdout and "--json" in done.stdout


def test_decode_bytes(bench: ModuleType) -> None:
    # 2 sequences of 20 and 33 tokens, 4 query / 2 KV heads, head_dim 8, fp16, block 16.
    kv = 2 * 53 * 2 * 8 * 2
    q_and_out = 2 * 2 * 4 * 8 * 2
    tables = (2 + 3) * 4 + 2 * 4
    assert bench.decode_bytes([20, 33], 4, 2, 8, 2, 16) == kv + q_and_out + tables


def test_attention_flops(bench: ModuleType) -> None:
    # No prefix, 3 new tokens: 1 + 2 + 3 pairs; prefix 4 and 2 new: 5 + 6 pairs.
    assert bench.attention_flops([(0, 3)], 2, 8) == 4 * 8 * 2 * 6
    assert bench.attention_flops([(4, 2), (0, 3)], 1, 8) == 4 * 8 * (11 + 6)


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
     ("NVIDIA A100-SXM4-80GB", 2039.0), ("Some Future GPU", None)],
)
def test_peak_lookup(bench: ModuleType, name: str, peak: float | None) -> None:
    assert bench.peak_gbps(name) == peak


def test_bench_runs_end_to_end_on_tiny_shapes(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    for name, value in [("NUM_HEADS", 4), ("NUM_KV_HEADS", 2), ("HEAD_DIM", 32),
                        ("BLOCK_SIZE", 16)]:
        monkeypatch.setattr(bench, name, value)

    def call_once(fn: Callable[[], object]) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(bench, "time_ms", call_once)
    run = bench.Bench(bench.parse_args(["--peak-gbps", "100"]), device, "tiny", 4)
    run.dtype = torch.float32
    run.goal_case = (2, 40)
    run.decode_cases = [(1, 20)]
    run.prefill_cases = [(2, 0, 24), (1, 16, 8)]
    run.split_sweep = (1, 2)
    run.tiling_sweep = [(16, 4, 2), (32, 4, 2)]
    run.store_shape = (8, 16)
    run.copy_shape = (2, 8, 2)
    run.run()

    results = run.results
    assert [(r["batch"], r["context"]) for r in results["decode"]] == [(2, 40), (1, 20)]
    assert len(results["decode"][0]["split_sweep"]) == 2
    assert len(results["decode"][0]["tiling_sweep"]) == 2
    assert results["goal"]["case"] == "decode batch 2, 40-token contexts"
    assert len(results["prefill"]) == 2
    assert set(results) >= {"store_kv", "copy_blocks", "wall_s"}
    # The contiguous copies SDPA reads hold the same data the kernels read.
    for row in results["decode"] + results["prefill"]:
        assert row["max_abs_diff_vs_sdpa"] < 1e-4, row
