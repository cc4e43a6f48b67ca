"""bench/bench_memory.py: the accounting on small cases worked out by hand (block size 4,
context length 32), then the command end to end on the tiny model, then the plots."""

from __future__ import annotations

import json
from pathlib import Path

import bench_memory
import plots
import pytest
from bench_memory import (
    StepRecord,
    SyntheticWorker,
    capacity,
    pack_contiguous,
    pack_paged,
    sharing_saving,
    simulate,
    usage_summary,
)
from workloads import BenchRequest, Workload, WorkloadConfig

BLOCK = 4
CONTEXT = 32


def req(ids: list[int], n: int = 1, max_tokens: int = 3) -> BenchRequest:
    return BenchRequest(messages=(), prompt_token_ids=tuple(ids), max_tokens=max_tokens, n=n,
                        temperature=1.0 if n > 1 else 0.0, seed=5 if n > 1 else None)


def run(requests: list[BenchRequest], prefix_caching: bool,
        context_len: int = CONTEXT) -> bench_memory.Simulation:
    workload = Workload(WorkloadConfig(kind="a"), tuple((r,) for r in requests))
    return simulate(workload, num_blocks=64, block_size=BLOCK, prefix_caching=prefix_caching,
                    concurrency=2, context_len=context_len, execute=SyntheticWorker().execute)


def test_over_time_without_sharing_by_hand() -> None:
    # Prompts of 6 and 9 tokens, 3 output tokens each, both admitted at once.
    # step 1: prefill; they hold 6 and 9 tokens: 2 + 3 blocks = 20 slots; contiguous
    #         reserves 2 x 32; exact slabs are 6+3 and 9+3.
    # step 2: one decode each: 7 and 10 tokens, still 2 + 3 blocks.
    # step 3: the third output token ends both; nothing is held.
    sim = run([req(list(range(100, 106))), req(list(range(200, 209)))], prefix_caching=False)
    assert sim.records == [
        StepRecord(2, 15, 20, 15, 20, 64, 21, 0),
        StepRecord(2, 17, 20, 17, 20, 64, 21, 0),
        StepRecord(0, 0, 0, 0, 0, 0, 0, 0),
    ]
    usage = usage_summary(sim.records, sim.records)
    assert usage["contiguous"]["real_token_share"] == pytest.approx(32 / 128)
    assert usage["contiguous"]["reserved_slots_peak"] == 64
    assert usage["paged"]["real_token_share"] == pytest.approx(32 / 40)
    assert usage["contiguous_exact"]["waste_share"] == pytest.approx(1 - 32 / 42)
    assert usage["paged"]["reserved_slots_mean"] == pytest.approx(40 / 3)


def test_over_time_with_a_shared_prefix_by_hand() -> None:
    # Both prompts start with the same 8 tokens (2 blocks): A = P + 2 tokens, B = P + 3.
    # step 1: A prefills 10 tokens (3 blocks); B waits for A's prefix rather than compute it.
    # step 2: A decodes (11 tokens, 3 blocks); B hits the 2 shared blocks and gets 1 new one
    #         for its 3 own tokens: 4 distinct blocks (16 slots) hold 8 + 3 + 3 = 14 tokens;
    #         private tables would be 3 + 3 blocks (24 slots) for 11 + 11 tokens.
    # step 3: A ends (its third block stays cached); B holds 12 tokens in 3 blocks.
    # step 4: B ends. Hits: 8 of the 10 + 11 prompt tokens.
    prefix = list(range(300, 308))
    sim = run([req(prefix + [1, 2]), req(prefix + [3, 4, 5])], prefix_caching=True)
    assert sim.records[:3] == [
        StepRecord(1, 10, 12, 10, 12, 32, 13, 0),
        StepRecord(2, 22, 16, 14, 24, 64, 27, 0),
        StepRecord(1, 12, 12, 12, 12, 32, 14, 1),
    ]
    assert sim.records[-1].running_seqs == 0
    assert sim.hit_rate == pytest.approx(8 / 21)
    saving = sharing_saving(sim.records)
    assert saving["saved"] == pytest.approx(1 - (12 + 16 + 12) / (12 + 24 + 12))
    assert saving["saved_at_peak"] == pytest.approx(1 - 16 / 24)


def test_packing_in_a_budget_by_hand() -> None:
    prefix = list(range(300, 308))
    a, b = req(prefix + [1, 2]), req(prefix + [3, 4, 5])
    # Shared: A is 10 + 3 = 13 tokens, 4 blocks; B reuses A's 2 prefix blocks and adds 2
    # for its 14 tokens: 6 blocks. Private: 4 + 4 blocks.
    assert pack_paged([a, b], 6, BLOCK, shared=True)["num_sequences"] == 2
    assert pack_paged([a, b], 5, BLOCK, shared=True)["num_sequences"] == 1
    assert pack_paged([a, b], 8, BLOCK, shared=False) == {
        "num_sequences": 2, "num_requests": 2, "all_fit": True}
    assert pack_paged([a, b], 7, BLOCK, shared=False) == {
        "num_sequences": 1, "num_requests": 1, "all_fit": False}
    # n=2 over a 10-token prompt: 3 prompt blocks, then each stream writes its outputs into
    # its own copy of the shared partial third block plus a fourth block: 3 + 3 = 6 blocks.
    # Without sharing, 2 x 4. A request fits whole or not at all.
    pair = req(prefix + [1, 2], n=2)
    assert pack_paged([pair], 6, BLOCK, shared=True)["num_sequences"] == 2
    assert pack_paged([pair], 5, BLOCK, shared=True)["num_sequences"] == 0
    assert pack_paged([pair], 8, BLOCK, shared=False)["num_sequences"] == 2
    assert pack_paged([pair], 7, BLOCK, shared=False)["num_sequences"] == 0
    # Contiguous: a 32-slot slab per sequence; exact slabs of 13 and 14.
    assert pack_contiguous([a, b], 64, lambda r: CONTEXT)["num_sequences"] == 2
    assert pack_contiguous([a, b], 63, lambda r: CONTEXT)["num_sequences"] == 1
    assert pack_contiguous([pair], 63, lambda r: CONTEXT)["num_sequences"] == 0
    packed = capacity([a, b], 27, BLOCK, CONTEXT)  # 6 blocks of 4
    assert {k: v["num_sequences"] for k, v in packed.items()} == {
        "paged_shared": 2, "paged": 1, "contiguous": 0, "contiguous_exact": 2}


def test_beams_and_samples_share_and_repeat() -> None:
    prompt = list(range(400, 420))
    beams = BenchRequest(messages=(), prompt_token_ids=tuple(prompt), max_tokens=12, n=4,
                         use_beam_search=True)
    samples = req(prompt, n=4, max_tokens=12)
    for request in (beams, samples):
        first = run([request], prefix_caching=False)
        assert first.records == run([request], prefix_caching=False).records  # deterministic
        assert max(r.running_seqs for r in first.records) == 4
        saving = sharing_saving(first.records)
        assert saving["saved"] is not None and 0.3 < saving["saved"] < 1.0
        for record in first.records:
            assert record.allocated_slots <= record.private_slots
            assert record.contiguous_slots == record.running_seqs * CONTEXT
            assert record.private_slots % BLOCK == 0


def test_command_and_plots_end_to_end(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    code = bench_memory.main([
        "--model", str(tiny_llama_dir), "--workload", "a,d", "--num-requests", "6",
        "--num-system-prompts", "2", "--system-tokens", "40", "--question-tokens", "8",
        "--output-tokens", "4", "--prompt-tokens", "20", "--n", "2", "--concurrency", "2",
        "--capacity-requests", "30", "--kv-budget-tokens", "2048", "--out-dir", str(out),
    ])
    assert code == 0
    a = json.loads((out / "memory_a.json").read_text())
    assert a["config"]["context_len"] == 256  # the tiny model's
    assert a["config"]["workload"]["seed"] == 0 and "command" in a and "date" in a
    assert a["capacity"]["contiguous"]["num_sequences"] == 2048 // 256
    assert a["capacity"]["paged_shared"]["num_sequences"] >= a["capacity"]["paged"][
        "num_sequences"]
    assert 0 < a["engine_hit_rate"] <= a["workload"]["ideal_hit_rate"]
    assert len(a["goals"]) == 2
    d = json.loads((out / "memory_d.json").read_text())
    assert d["sharing_saving"]["paper"] == {"parallel_sampling": [0.061, 0.098]}

    compare = {"config": {"workload": a["config"]["workload"]}, "machine": a["machine"],
               "date": a["date"], "runs": {
                   str(c): {"systems": {"radixkv": {"output_throughput": 10.0 * c},
                                        "transformers": {"output_throughput": 2.0 * c}}}
                   for c in (1, 4)}}
    (out / "compare_a_sweep.json").write_text(json.dumps(compare))
    assert plots.main(["--results-dir", str(out)]) == 0
    for name in ("throughput_vs_concurrency", "kv_utilisation", "hit_rate_by_workload"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    rates = plots.hit_rates(out)
    assert set(rates) == {"a", "d"}
    assert rates["a"]["engine accounting (bench_memory)"] == a["engine_hit_rate"]
