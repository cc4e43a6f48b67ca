"""Benchmark the Triton paged-attention kernels on a GPU, next to torch's SDPA.

Decode is memory-bound: it is reported as achieved bandwidth (bytes of K/V, queries, outputs
and block tables moved, over time) in GB/s and as a share of the device's peak HBM bandwidth.
Prefill is reported in TFLOP/s (4 * head_dim flops per query-key pair per head, causal pairs
only). torch.nn.functional.scaled_dot_product_attention runs on the same data laid out
contiguously, (batch, heads, tokens, head_dim), with uniform lengths so it needs no padding
mask; its numbers use the same accounting.

The goal case is decode at batch 64 with 4k-token contexts (Llama-3-8B layer: 32 query heads,
8 KV heads, head_dim 128, block size 16): at least 70% of peak on an H200. Sweeps over split
counts and tilings of that case show where the default stands.

    python bench/bench_kernels.py [--dtype bf16] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GOAL_PERCENT_OF_PEAK = 70.0
# Peak HBM bandwidth in GB/s by device-name fragment, most specific first.
PEAK_GBPS = [
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def decode_bytes(
    seq_lens: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
    elem_size: int, block_size: int,
) -> int:
    """Bytes one decode call must move: K and V of every context token, q in, out, tables."""
    kv = 2 * sum(seq_lens) * num_kv_heads * head_dim * elem_size
    q_and_out = 2 * len(seq_lens) * num_heads * head_dim * elem_size
    tables = sum(math.ceil(n / block_size) for n in seq_lens) * 4 + len(seq_lens) * 4
    return kv + q_and_out + tables


def attention_flops(chunks: Sequence[tuple[int, int]], num_heads: int, head_dim: int) -> int:
    """Flops of causal attention over (cached prefix, new tokens) chunks: QK^T and PV."""
    pairs = 0
    for prefix, new in chunks:
        # query t (0-based in the chunk) sees prefix + t + 1 keys
        pairs += new * prefix + new * (new + 1) // 2
    return 4 * head_dim * num_heads * pairs


def peak_gbps(device_name: str) -> float | None:
    for fragment, gbps in PEAK_GBPS:
        if fragment in device_name:
            return gbps
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--quick", action="store_true", help="goal case and one prefill only")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="device peak HBM bandwidth (default: looked up from its name)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write results (default bench/results/kernels_<gpu>.json)")
    return parser.parse_args(argv)


def time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds per call, L2 flushed between calls (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


class Bench:
    """Runs every case on one device; `results` is what lands in the JSON file."""

    goal_case = (64, 4096)  # (batch, context)
    decode_cases = [(1, 4096), (8, 4096), (1, 32768), (16, 16384), (64, 1024), (256, 2048)]
    prefill_cases = [(4, 0, 2048), (1, 0, 8192), (8, 3584, 512)]  # (seqs, prefix, new)
    split_sweep = (1, 2, 4, 8, 16)
    tiling_sweep = [(t, w, s) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    store_shape = (4096, 8192)  # (num_blocks, num_tokens)
    copy_shape = (32, 1024, 256)  # (num_layers, num_blocks, num_pairs)

    def __init__(
        self, args: argparse.Namespace, device: Any, name: str, num_sms: int
    ):
        import torch

        self.torch = torch
        self.device = device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        self.name = name
        self.peak = args.peak_gbps or peak_gbps(name)
        self.quick = args.quick
        self.results: dict[str, Any] = {
            "device": name,
            "num_sms": num_sms,
            "peak_gbps": self.peak,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "python": platform.python_version(),
            "model_shape": dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                                head_dim=HEAD_DIM, block_size=BLOCK_SIZE),
        }

    @property
    def elem_size(self) -> int:
        return int(self.torch.empty((), dtype=self.dtype).element_size())

    def run(self) -> None:
        started = time.perf_counter()
        self.bench_decode()
        self.bench_prefill()
        self.bench_writes()
        self.results["wall_s"] = round(time.perf_counter() - started, 1)

    def percent(self, gbps: float) -> float | None:
        return None if self.peak is None else round(100.0 * gbps / self.peak, 1)

    # --- decode -------------------------------------------------------------------------

    def decode_data(self, batch: int, context: int) -> dict[str, Any]:
        torch = self.torch
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, device=self.device, dtype=self.dtype)
        v_cache = torch.randn(shape, device=self.device, dtype=self.dtype)
        tables = torch.randperm(num_blocks, device=self.device, dtype=torch.int32)
        tables = tables.view(batch, blocks_per_seq)
        seq_lens = torch.full((batch,), context, device=self.device, dtype=torch.int32)
        query = torch.randn((batch, NUM_HEADS, HEAD_DIM), device=self.device, dtype=self.dtype)
        return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                    seq_lens=seq_lens)

    def contiguous_kv(
        self, data: dict[str, Any], batch: int, context: int
    ) -> tuple[Any, Any]:
        """(batch, num_kv_heads, context, head_dim) copies of the paged K and V."""
        tables = data["block_tables"].long()
        k = data["k_cache"][tables].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
        v = data["v_cache"][tables].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def sdpa(self, q: Any, k: Any, v: Any, **kwargs: Any) -> tuple[Callable[[], Any], bool]:
        """An SDPA call on GQA data; falls back to expanding K/V if enable_gqa is refused."""
        import torch.nn.functional as F

        def native() -> Any:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)

        try:
            native()
            return native, False
        except (RuntimeError, TypeError):
            group = q.shape[1] // k.shape[1]
            k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return (lambda: F.scaled_dot_product_attention(q, k_full, v_full, **kwargs)), True

    def bench_decode_case(
        self, batch: int, context: int, sweep: bool = False
    ) -> dict[str, Any]:
        from radixkv.kernels.paged_decode import (
            DecodeTiling,
            choose_num_splits,
            paged_decode,
        )

        data = self.decode_data(batch, context)
        scale = HEAD_DIM**-0.5
        nbytes = decode_bytes([context] * batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                              self.elem_size, BLOCK_SIZE)
        auto_splits = choose_num_splits(
            batch, NUM_KV_HEADS, context, self.results["num_sms"]
        )

        def run(**kwargs: Any) -> dict[str, Any]:
            try:
                ms = time_ms(lambda: paged_decode(**data, scale=scale, **kwargs))
            except Exception as error:  # e.g. a sweep tiling that needs too much shared memory
                return dict(ms=None, gbps=0.0, pct_peak=None, error=type(error).__name__)
            gbps = nbytes / ms / 1e6
            return dict(ms=round(ms, 4), gbps=round(gbps, 1), pct_peak=self.percent(gbps))

        row: dict[str, Any] = dict(batch=batch, context=context, bytes=nbytes,
                                   num_splits=auto_splits, **run())
        k, v = self.contiguous_kv(data, batch, context)
        q = data["query"][:, :, None, :]  # (batch, num_heads, 1, head_dim)
        sdpa_fn, expanded = self.sdpa(q, k, v, scale=scale)
        sdpa_ms = time_ms(sdpa_fn)
        sdpa_gbps = nbytes / sdpa_ms / 1e6
        row["sdpa"] = dict(ms=round(sdpa_ms, 4), gbps=round(sdpa_gbps, 1),
                           pct_peak=self.percent(sdpa_gbps), gqa_expanded=expanded)
        ours = paged_decode(**data, scale=scale).float()
        row["max_abs_diff_vs_sdpa"] = float((ours - sdpa_fn()[:, :, 0].float()).abs().max())
        if sweep:
            row["split_sweep"] = [
                dict(num_splits=s, **run(num_splits=s)) for s in self.split_sweep
            ]
            tilings = [
                DecodeTiling(tile_n=t, num_warps=w, num_stages=s) for t, w, s in self.tiling_sweep
            ]
            row["tiling_sweep"] = [
                dict(tile_n=t.tile_n, num_warps=t.num_warps, num_stages=t.num_stages,
                     **run(num_splits=auto_splits, tiling=t))
                for t in tilings
            ]
        return row

    def bench_decode(self) -> None:
        cases = [self.goal_case] + ([] if self.quick else self.decode_cases)
        rows = []
        for i, (batch, context) in enumerate(cases):
            row = self.bench_decode_case(batch, context, sweep=i == 0)
            self.torch.cuda.empty_cache()
            rows.append(row)
            print(
                f"decode  batch {batch:4d} ctx {context:6d} splits {row['num_splits']:2d}: "
                f"{row['ms']:8.4f} ms {row['gbps']:8.1f} GB/s ({row['pct_peak']}% of peak)   "
                f"sdpa {row['sdpa']['ms']:8.4f} ms {row['sdpa']['gbps']:8.1f} GB/s   "
                f"max|diff| {row['max_abs_diff_vs_sdpa']:.2e}",
                flush=True,
            )
            for entry in row.get("split_sweep", []):
                print(f"    splits {entry['num_splits']:2d}: {entry['gbps']:8.1f} GB/s "
                      f"({entry['pct_peak']}%)", flush=True)
            if "tiling_sweep" in row:
                best = max(row["tiling_sweep"], key=lambda e: e["gbps"])
                print(f"    best tiling: tile_n {best['tile_n']} warps {best['num_warps']} "
                      f"stages {best['num_stages']}: {best['gbps']:.1f} GB/s "
                      f"({best['pct_peak']}%)", flush=True)
        self.results["decode"] = rows
        goal_row = rows[0]
        self.results["goal"] = dict(
            case=f"decode batch {self.goal_case[0]}, {self.goal_case[1]}-token contexts",
            target_pct_peak=GOAL_PERCENT_OF_PEAK,
            achieved_pct_peak=goal_row["pct_peak"],
            met=None if goal_row["pct_peak"] is None
            else goal_row["pct_peak"] >= GOAL_PERCENT_OF_PEAK,
        )

    # --- prefill ------------------------------------------------------------------------

    def bench_prefill_case(self, num_seqs: int, prefix: int, new: int) -> dict[str, Any]:
        from torch.nn.attention.bias import causal_lower_right

        from radixkv.kernels.paged_prefill import paged_prefill

        torch = self.torch
        data = self.decode_data(num_seqs, prefix + new)
        num_tokens = num_seqs * new
        query = torch.randn((num_tokens, NUM_HEADS, HEAD_DIM), device=self.device,
                            dtype=self.dtype)
        query_start_loc = torch.arange(0, num_tokens + 1, new, device=self.device,
                                       dtype=torch.int32)
        scale = HEAD_DIM**-0.5
        flops = attention_flops([(prefix, new)] * num_seqs, NUM_HEADS, HEAD_DIM)

        def ours() -> Any:
            return paged_prefill(query, data["k_cache"], data["v_cache"], data["block_tables"],
                                 query_start_loc, data["seq_lens"], scale)

        ms = time_ms(ours)
        row: dict[str, Any] = dict(num_seqs=num_seqs, prefix=prefix, new=new, flops=flops,
                                   ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        k, v = self.contiguous_kv(data, num_seqs, prefix + new)
        q = query.view(num_seqs, new, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        if prefix == 0:
            sdpa_fn, expanded = self.sdpa(q, k, v, is_causal=True, scale=scale)
        else:
            mask = causal_lower_right(new, prefix + new)
            sdpa_fn, expanded = self.sdpa(q, k, v, attn_mask=mask, scale=scale)
        sdpa_ms = time_ms(sdpa_fn)
        row["sdpa"] = dict(ms=round(sdpa_ms, 4), tflops=round(flops / sdpa_ms / 1e9, 1),
                           gqa_expanded=expanded)
        expected = sdpa_fn().transpose(1, 2).reshape(num_tokens, NUM_HEADS, HEAD_DIM)
        row["max_abs_diff_vs_sdpa"] = float((ours().float() - expected.float()).abs().max())
        return row

    def bench_prefill(self) -> None:
        cases = self.prefill_cases[:1] if self.quick else self.prefill_cases
        rows = []
        for num_seqs, prefix, new in cases:
            row = self.bench_prefill_case(num_seqs, prefix, new)
            self.torch.cuda.empty_cache()
            rows.append(row)
            print(
                f"prefill {num_seqs} x (prefix {prefix:5d} + new {new:5d}): "
                f"{row['ms']:8.4f} ms {row['tflops']:7.1f} TFLOP/s   "
                f"sdpa {row['sdpa']['ms']:8.4f} ms {row['sdpa']['tflops']:7.1f} TFLOP/s   "
                f"max|diff| {row['max_abs_diff_vs_sdpa']:.2e}",
                flush=True,
            )
        self.results["prefill"] = rows

    # --- store_kv, copy_blocks ----------------------------------------------------------

    def bench_writes(self) -> None:
        from radixkv.kernels.copy_blocks import copy_blocks
        from radixkv.kernels.store_kv import store_kv

        torch = self.torch
        num_blocks, num_tokens = self.store_shape
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), device=self.device,
                          dtype=self.dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=self.device)[:num_tokens]
        ms = time_ms(lambda: store_kv(key, value, k_cache, v_cache, slots))
        nbytes = 2 * 2 * key.numel() * self.elem_size  # read and write K and V rows
        gbps = nbytes / ms / 1e6
        self.results["store_kv"] = dict(num_tokens=num_tokens, ms=round(ms, 4),
                                        gbps=round(gbps, 1), pct_peak=self.percent(gbps))
        print(f"store_kv {num_tokens} tokens: {ms:.4f} ms {gbps:.1f} GB/s", flush=True)

        num_layers, num_blocks, num_pairs = self.copy_shape
        pool = torch.zeros((num_layers, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                           device=self.device, dtype=self.dtype)
        ids = torch.randperm(num_blocks)
        pairs = torch.stack([ids[:num_pairs], ids[num_pairs : 2 * num_pairs]], dim=1)
        ms = time_ms(lambda: copy_blocks(pool, pairs))
        nbytes = 2 * num_layers * 2 * num_pairs * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
        nbytes *= self.elem_size
        gbps = nbytes / ms / 1e6
        self.results["copy_blocks"] = dict(num_layers=num_layers, num_pairs=num_pairs,
                                           ms=round(ms, 4), gbps=round(gbps, 1),
                                           pct_peak=self.percent(gbps))
        print(f"copy_blocks {num_pairs} pairs x {num_layers} layers: {ms:.4f} ms "
              f"{gbps:.1f} GB/s (includes the host-side id check)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bench = Bench(
        args, device, torch.cuda.get_device_name(device),
        torch.cuda.get_device_properties(device).multi_processor_count,
    )
    print(f"{bench.name}: peak {bench.peak} GB/s, dtype {args.dtype}", flush=True)
    bench.run()
    goal = bench.results["goal"]
    print(f"goal ({goal['case']}): {goal['achieved_pct_peak']}% of peak, "
          f"target {goal['target_pct_peak']}% -> {'met' if goal['met'] else 'NOT met'}")
    slug = re.sub(r"[^a-z0-9]+", "_", bench.name.lower()).strip("_")
    out = args.json or RESULTS_DIR / f"kernels_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(bench.results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
