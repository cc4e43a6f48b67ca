"""KV memory accounting on the serving workloads, with the real scheduler and KV manager.

    python bench/bench_memory.py --workload a              # or a,b,c,d,e
    python bench/bench_memory.py --workload d,e --worker model --num-requests 8

Three ways to hold the same requests' KV:
  paged + shared    radixkv: blocks, cached prefixes and forked sequences shared (each block
                    counted once);
  paged             blocks, nothing shared: every sequence its own table;
  contiguous        a slab of the context length per sequence, reserved at admission (and,
                    for reference, a slab of prompt + max_tokens: the best a contiguous
                    system that knows each output length could do).

1. Over time. The workload runs closed-loop at --concurrency through `Scheduler` and
   `KVCacheManager` (the engine's own classes, so the block math is the engine's), driven by
   a synthetic worker that stands in for the model (or by the real model with --worker model).
   Prefix caching is on for the paged + shared system and off for the others. After every
   step: the slots each system reserves and the tokens they hold. Reported: the share of
   reserved KV holding real tokens (summed over steps), the waste (allocated slots - live
   tokens, over allocated), and for n > 1 / beams the memory sharing saves against private
   copies (PagedAttention reports 6.1-9.8% for parallel sampling, 37.6-55.2% for beam search).
2. In a fixed budget (--kv-budget-tokens). Requests are packed, each at its full length
   (prompt + O tokens per sequence), until the next one no longer fits: through the real
   KVCacheManager for the paged systems (admit, cache the prompt, fork, grow), a slab per
   sequence for contiguous. For (b) and (c) only the last turn of each conversation is
   packed (a conversation's turns never run at once).

Prints the configuration and seed, a table per workload, and writes
bench/results/memory_<workload>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import (  # noqa: E402
    RESULTS,
    add_workload_options,
    load_tokenizer,
    result_header,
    workload_config,
    write_result,
)
from workloads import WORKLOADS, BenchRequest, Workload, build_workload  # noqa: E402

from radixkv.config import SchedulerConfig  # noqa: E402
from radixkv.ipc.protocol import AddRequest, Sample, StepInput, StepOutput  # noqa: E402
from radixkv.kvcache import KVCacheManager, SeqId  # noqa: E402
from radixkv.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402
from radixkv.scheduler.scheduler import Scheduler  # noqa: E402

PAPER = {"parallel_sampling": (0.061, 0.098), "beam_search": (0.376, 0.552)}
SYNTHETIC_VOCAB = 49152
Execute = Callable[[StepInput], StepOutput]


# ------------------------------------------------------------------------ synthetic worker


@dataclass
class SyntheticWorker:
    """Stands in for the model: mirrors each sequence's tokens as the real worker does (sent
    once, then chunks) and returns a deterministic top-k for every sample, a function of the
    sequence's length, last tokens and seed, so runs repeat exactly. The top candidate is
    much likelier than the rest, as with a language model."""

    history: dict[int, list[int]] = field(default_factory=dict)
    specs: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # (num_top, seed)

    def execute(self, step: StepInput) -> StepOutput:
        for seq_id in step.finished_seq_ids:
            self.history.pop(seq_id, None)
            self.specs.pop(seq_id, None)
        for new in step.new_seqs:
            self.history[new.seq_id] = list(new.token_ids)
            seed = new.spec.seed if new.spec.temperature > 0 else None
            self.specs[new.seq_id] = (new.spec.num_top_logprobs, seed)
        samples = []
        for chunk in step.chunks:
            self.history[chunk.seq_id].extend(chunk.token_ids)
            if chunk.sample:
                for seq_id in (chunk.seq_id, *chunk.fanout_seq_ids):
                    samples.append(self._sample(seq_id))
        return StepOutput(step_id=step.step_id, samples=samples)

    def _sample(self, seq_id: int) -> Sample:
        history = self.history[seq_id]
        num_top, seed = self.specs[seq_id]
        key = f"{len(history)}:{history[-4:]}:{seed}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        k = max(num_top, 1)
        tokens = [3 + (h + 7919 * i) % (SYNTHETIC_VOCAB - 3) for i in range(k)]
        gap = 1.0 + (h >> 32) % 1000 / 250.0  # 1.0 .. 5.0 nats between candidates
        logprobs = [-0.05 - (h >> 16) % 100 / 200.0 - i * gap for i in range(k)]
        return Sample(seq_id=seq_id, token_id=tokens[0], logprob=logprobs[0],
                      top_token_ids=tokens[:num_top], top_logprobs=logprobs[:num_top])


# ---------------------------------------------------------------------------- over time


@dataclass(frozen=True)
class StepRecord:
    """KV use after one engine step. `*_slots` are token positions reserved, `*_tokens`
    tokens held in them."""

    running_seqs: int
    seq_tokens: int  # every running sequence's tokens, each its own copy
    allocated_slots: int  # blocks referenced by running sequences (each once) x block_size
    live_tokens: int  # tokens in those blocks (each block once)
    private_slots: int  # every running sequence's table length x block_size
    contiguous_slots: int  # running sequences x context length
    exact_slots: int  # running sequences x (their prompt + max_tokens)
    cached_blocks: int


@dataclass
class Simulation:
    records: list[StepRecord]
    hit_rate: float  # cached prompt tokens / prompt tokens, as servers report them in usage
    num_preemptions: int
    num_requests: int


def to_add_request(request_id: str, request: BenchRequest) -> AddRequest:
    if request.use_beam_search:
        beam = BeamSearchParams(beam_width=request.n, max_tokens=request.max_tokens,
                                ignore_eos=True)
        return AddRequest(request_id, list(request.prompt_token_ids), beam=beam,
                          eos_token_ids=(2,))
    sampling = SamplingParams(n=request.n, temperature=request.temperature, seed=request.seed,
                              max_tokens=request.max_tokens, ignore_eos=True)
    return AddRequest(request_id, list(request.prompt_token_ids), sampling=sampling,
                      eos_token_ids=(2,))


def simulate(
    workload: Workload, *, num_blocks: int, block_size: int, prefix_caching: bool,
    concurrency: int, context_len: int, execute: Execute, max_num_batched_tokens: int = 2048,
) -> Simulation:
    """Run the workload closed-loop: `concurrency` chains in flight, each turn added when the
    previous one finishes; a record after every step."""
    width = max(r.n for r in workload.requests)
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=concurrency * width, max_n=max(16, width),
                        max_num_batched_tokens=max_num_batched_tokens),
        kv, context_len,
    )
    chains = list(workload.chains)
    next_chain = 0
    pending: dict[str, tuple[int, int]] = {}  # request id -> (chain, turn)
    reserve: dict[str, int] = {}  # request id -> prompt + max_tokens

    def submit(chain: int, turn: int) -> None:
        request = chains[chain][turn]
        request_id = f"{chain}-{turn}"
        scheduler.add_request(to_add_request(request_id, request))
        pending[request_id] = (chain, turn)
        reserve[request_id] = len(request.prompt_token_ids) + request.max_tokens

    while next_chain < min(concurrency, len(chains)):
        submit(next_chain, 0)
        next_chain += 1
    records = []
    cached_tokens = prompt_tokens = 0
    while scheduler.has_work:
        for output in scheduler.step(execute):
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if not output.finished:
                continue
            cached_tokens += output.num_cached_tokens
            prompt_tokens += output.num_prompt_tokens
            chain, turn = pending.pop(output.request_id)
            if turn + 1 < len(chains[chain]):
                submit(chain, turn + 1)
            elif next_chain < len(chains):
                submit(next_chain, 0)
                next_chain += 1
        records.append(_record(scheduler, kv, context_len, reserve))
    hit_rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    return Simulation(records, hit_rate, scheduler.num_preemptions, len(workload.requests))


def _record(scheduler: Scheduler, kv: KVCacheManager, context_len: int,
            reserve: dict[str, int]) -> StepRecord:
    running = tokens = private_blocks = exact = 0
    for request in scheduler.running:
        for seq in request.live_seqs:
            if seq.seq_id not in kv:
                continue
            running += 1
            tokens += kv.num_tokens(seq.seq_id)
            private_blocks += len(kv.block_ids(seq.seq_id))
            exact += reserve[request.request_id]
    stats = kv.stats()
    return StepRecord(
        running_seqs=running, seq_tokens=tokens, allocated_slots=stats.allocated_slots,
        live_tokens=stats.live_tokens, private_slots=private_blocks * kv.block_size,
        contiguous_slots=running * context_len, exact_slots=exact,
        cached_blocks=stats.num_cached_blocks,
    )


def usage_summary(shared: Sequence[StepRecord], unshared: Sequence[StepRecord]) -> dict[str, Any]:
    """Per system, over the steps of its run: reserved slots (mean, peak), the share of them
    holding real tokens and the waste. Paged + shared comes from the run with prefix caching;
    the others from the run without (contiguous systems cache no prefixes)."""

    def system(records: Sequence[StepRecord], slots: str, held: str) -> dict[str, Any]:
        reserved = [getattr(r, slots) for r in records]
        real = [getattr(r, held) for r in records]
        total = sum(reserved)
        return {
            "reserved_slots_mean": total / len(records) if records else 0.0,
            "reserved_slots_peak": max(reserved, default=0),
            "real_token_share": sum(real) / total if total else None,
            "waste_share": 1 - sum(real) / total if total else None,
        }

    return {
        "paged_shared": system(shared, "allocated_slots", "live_tokens"),
        "paged": system(unshared, "private_slots", "seq_tokens"),
        "contiguous": system(unshared, "contiguous_slots", "seq_tokens"),
        "contiguous_exact": system(unshared, "exact_slots", "seq_tokens"),
    }


def sharing_saving(records: Sequence[StepRecord]) -> dict[str, float | None]:
    """Memory sharing saves against every sequence holding private blocks: summed over
    steps, and at the step with the most private blocks."""
    private = sum(r.private_slots for r in records)
    if not private:
        return {"saved": None, "saved_at_peak": None}
    peak = max(records, key=lambda r: r.private_slots)
    return {
        "saved": 1 - sum(r.allocated_slots for r in records) / private,
        "saved_at_peak": 1 - peak.allocated_slots / peak.private_slots,
    }


# ------------------------------------------------------------------------ fixed budget


def pack_paged(requests: Sequence[BenchRequest], num_blocks: int, block_size: int,
               shared: bool) -> dict[str, Any]:
    """How many sequences fit at full length in `num_blocks`: requests are added whole, in
    order, until one does not fit. Shared: the prompt is admitted once, cached, forked for
    every other sequence of the request, and each sequence grown by its output. Not shared:
    every sequence admitted on its own with prefix caching off."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=shared)
    next_id = 0
    num_seqs = num_requests = 0
    for request in requests:
        prompt = list(request.prompt_token_ids)
        seq_ids = [SeqId(next_id + i) for i in range(request.n)]
        next_id += request.n
        if not _admit_whole(kv, seq_ids, prompt, request.max_tokens, shared):
            return {"num_sequences": num_seqs, "num_requests": num_requests, "all_fit": False}
        num_seqs += request.n
        num_requests += 1
    return {"num_sequences": num_seqs, "num_requests": num_requests, "all_fit": True}


def _admit_whole(kv: KVCacheManager, seq_ids: list[SeqId], prompt: list[int],
                 num_output: int, shared: bool) -> bool:
    """All the request's sequences at full length, or none (what was taken is freed)."""
    live: list[SeqId] = []
    for index, seq_id in enumerate(seq_ids):
        if shared and index > 0:
            kv.fork(seq_ids[0], seq_id)
        elif kv.admit(seq_id, prompt, None) is None:
            break
        live.append(seq_id)
        if shared and index == 0:
            kv.cache(seq_id, prompt)
    else:
        if all(kv.grow(seq_id, num_output) is not None for seq_id in seq_ids):
            return True
    for seq_id in live:
        kv.free(seq_id)
    return False


def pack_contiguous(requests: Sequence[BenchRequest], budget_tokens: int,
                    slab: Callable[[BenchRequest], int]) -> dict[str, Any]:
    """Whole requests, each sequence a slab of `slab(request)` slots, until one does not fit."""
    used = num_seqs = num_requests = 0
    for request in requests:
        need = request.n * slab(request)
        if used + need > budget_tokens:
            return {"num_sequences": num_seqs, "num_requests": num_requests, "all_fit": False}
        used += need
        num_seqs += request.n
        num_requests += 1
    return {"num_sequences": num_seqs, "num_requests": num_requests, "all_fit": True}


def capacity(requests: Sequence[BenchRequest], budget_tokens: int, block_size: int,
             context_len: int) -> dict[str, dict[str, Any]]:
    num_blocks = budget_tokens // block_size
    return {
        "paged_shared": pack_paged(requests, num_blocks, block_size, shared=True),
        "paged": pack_paged(requests, num_blocks, block_size, shared=False),
        "contiguous": pack_contiguous(requests, budget_tokens, lambda r: context_len),
        "contiguous_exact": pack_contiguous(
            requests, budget_tokens, lambda r: len(r.prompt_token_ids) + r.max_tokens),
    }


# ------------------------------------------------------------------------------- report


SYSTEM_LABELS = {
    "paged_shared": "paged + shared (radixkv)",
    "paged": "paged, no sharing",
    "contiguous": "contiguous, context-length slab",
    "contiguous_exact": "contiguous, prompt+max_tokens slab",
}


def format_report(kind: str, usage: dict[str, Any], packed: dict[str, Any],
                  budget_tokens: int) -> str:
    lines = [f"{'system':<36}{'mean reserved':>14}{'peak reserved':>15}{'real tokens':>13}"
             f"{'waste':>8}{f'seqs in {budget_tokens} tokens':>24}"]
    for key, label in SYSTEM_LABELS.items():
        u, p = usage[key], packed[key]
        share = "-" if u["real_token_share"] is None else f"{u['real_token_share']:.1%}"
        waste = "-" if u["waste_share"] is None else f"{u['waste_share']:.1%}"
        seqs = f"{p['num_sequences']}{'+' if p['all_fit'] else ''}"
        lines.append(f"{label:<36}{u['reserved_slots_mean']:>14.0f}{u['reserved_slots_peak']:>15}"
                     f"{share:>13}{waste:>8}{seqs:>24}")
    return f"workload {kind}:\n" + "\n".join(lines)


def goal_lines(usage: dict[str, Any], packed: dict[str, Any]) -> list[str]:
    """Issue 7's memory goals (stated for workload a)."""
    waste = usage["paged_shared"]["waste_share"]
    lines = []
    if waste is not None:
        lines.append(f"KV waste of paged + shared = {waste:.2%} of allocated (goal <= 2%): "
                     f"{'met' if waste <= 0.02 else 'MISSED'}")
    contiguous = packed["contiguous"]["num_sequences"]
    paged = packed["paged_shared"]["num_sequences"]
    if contiguous:
        ratio = paged / contiguous
        lines.append(f"concurrent sequences, paged + shared / contiguous = {paged} / "
                     f"{contiguous} = {ratio:.1f}x (goal >= 4x): "
                     f"{'met' if ratio >= 4 else 'MISSED'}")
    return lines


def downsample(records: Sequence[StepRecord], limit: int = 400) -> list[dict[str, Any]]:
    stride = max(1, -(-len(records) // limit))
    return [{"step": i, **asdict(r)} for i, r in enumerate(records) if i % stride == 0]


# --------------------------------------------------------------------------------- main


def run_one(kind: str, args: argparse.Namespace, tokenizer: Any, context_len: int,
            execute_for: Callable[[], tuple[Execute, int]]) -> dict[str, Any]:
    config = workload_config(args, kind)
    workload = build_workload(config, tokenizer)
    print(f"workload {kind}:", json.dumps(workload.describe()), flush=True)
    block_size = args.block_size
    runs = {}
    for prefix_caching in (True, False):
        execute, num_blocks = execute_for()
        runs[prefix_caching] = simulate(
            workload, num_blocks=num_blocks, block_size=block_size,
            prefix_caching=prefix_caching, concurrency=args.concurrency,
            context_len=context_len, execute=execute,
            max_num_batched_tokens=args.max_num_batched_tokens)
    usage = usage_summary(runs[True].records, runs[False].records)
    chain_len = {"b": config.turns, "c": config.agent_steps}.get(kind, 1)
    packing_workload = build_workload(
        replace(config, num_requests=args.capacity_requests * chain_len), tokenizer)
    packed_requests = [chain[-1] for chain in packing_workload.chains]
    packed = capacity(packed_requests, args.kv_budget_tokens, block_size, context_len)
    result: dict[str, Any] = {
        "workload": workload.describe(),
        "usage": usage,
        "capacity": {"budget_tokens": args.kv_budget_tokens, **packed},
        "engine_hit_rate": runs[True].hit_rate,
        "num_preemptions": {"shared": runs[True].num_preemptions,
                            "unshared": runs[False].num_preemptions},
        "num_steps": {"shared": len(runs[True].records), "unshared": len(runs[False].records)},
        "timeline": {"shared": downsample(runs[True].records),
                     "unshared": downsample(runs[False].records)},
    }
    print(format_report(kind, usage, packed, args.kv_budget_tokens))
    print(f"engine hit rate (prefix caching on): {runs[True].hit_rate:.1%}")
    if max(r.n for r in workload.requests) > 1:
        forks = sharing_saving(runs[False].records)  # prefix caching off: forks alone
        with_prefixes = sharing_saving(runs[True].records)
        paper_key = "beam_search" if kind == "e" else "parallel_sampling"
        low, high = PAPER[paper_key]
        result["sharing_saving"] = {"forks_only": forks, "with_prefix_cache": with_prefixes,
                                    "paper": {paper_key: [low, high]}}
        print(f"memory saved by sharing (forks alone, summed over steps): {forks['saved']:.1%} "
              f"(at peak {forks['saved_at_peak']:.1%}); with the prefix cache too: "
              f"{with_prefixes['saved']:.1%}; PagedAttention reports {low:.1%}-{high:.1%}")
    if kind == "a":
        result["goals"] = goal_lines(usage, packed)
        for line in result["goals"]:
            print(line)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint for the tokenizer, the context length and --worker "
                             "model (default: SmolLM2)")
    parser.add_argument("--worker", choices=["synthetic", "model"], default="synthetic",
                        help="who samples the tokens: a deterministic stand-in or the model")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context-len", type=int, default=None,
                        help="contiguous slab per sequence (default: the model's context)")
    parser.add_argument("--kv-budget-tokens", type=int, default=65536,
                        help="budget for the concurrent-sequence count (and the pool size)")
    parser.add_argument("--capacity-requests", type=int, default=512,
                        help="requests (conversations for b, c) generated for the packing")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=2, help="for --worker model")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--out-suffix", default=None,
                        help="file name memory_<workload><suffix>.json (default: '' with the "
                             "synthetic worker, '_model' with the model)")
    add_workload_options(parser, many=True)
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.workload.split(",") if k.strip()]
    if not kinds or set(kinds) - set(WORKLOADS):
        parser.error(f"--workload takes a comma-separated subset of {','.join(WORKLOADS)}")

    from radixkv.checkpoint import resolve_checkpoint

    checkpoint = resolve_checkpoint(args.model)
    context_len = args.context_len or checkpoint.model_config.max_model_len
    execute_for = _executor_factory(args, checkpoint)
    tokenizer = load_tokenizer(args.model)
    for kind in kinds:
        config = workload_config(args, kind)
        header = result_header("memory", {
            "workload": config.to_dict(), "worker": args.worker,
            "concurrency": args.concurrency, "block_size": args.block_size,
            "context_len": context_len, "kv_budget_tokens": args.kv_budget_tokens,
            "capacity_requests": args.capacity_requests,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "model": args.model or "default (SmolLM2-135M-Instruct)",
        })
        print("config:", json.dumps(header["config"]))
        print(f"seed: {config.seed}")
        result = {**header, **run_one(kind, args, tokenizer, context_len, execute_for)}
        suffix = args.out_suffix
        if suffix is None:
            suffix = "" if args.worker == "synthetic" else "_model"
        write_result(args.out_dir / f"memory_{kind}{suffix}.json", result)
    return 0


def _executor_factory(
    args: argparse.Namespace, checkpoint: Any
) -> Callable[[], tuple[Execute, int]]:
    """A fresh worker per simulation: (its execute, the number of blocks its pool has)."""
    num_blocks = args.kv_budget_tokens // args.block_size
    if args.worker == "synthetic":
        return lambda: (SyntheticWorker().execute, num_blocks)

    from radixkv.config import CacheConfig, WorkerConfig
    from radixkv.worker.model_runner import ModelRunner

    runner = ModelRunner.from_checkpoint(
        checkpoint, CacheConfig(block_size=args.block_size, kv_cache_tokens=args.kv_budget_tokens),
        WorkerConfig(num_threads=args.num_threads))

    def fresh() -> tuple[Execute, int]:
        runner.seqs.clear()
        return runner.execute, runner.pool.num_blocks

    return fresh


if __name__ == "__main__":
    sys.exit(main())
