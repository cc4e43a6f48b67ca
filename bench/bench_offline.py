"""Offline throughput and KV sharing of the engine on the default model (SmolLM2, fp32, CPU).

1. Throughput: N requests sharing one system prompt of about L tokens (chat template, a
   different short question each), greedy, O output tokens each (EOS ignored so every system
   produces the same number of tokens): radixkv with prefix caching on, off, and transformers
   `generate` in static batches of B (left-padded) on the same token ids.
2. KV blocks: peak referenced blocks for one n=4 request and one beam-width-4 request, against
   what the same sequences would hold without sharing (each a private copy of its blocks).

    python bench/bench_offline.py [--requests 64] [--system-tokens 1000] [--output-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "What is a radix tree?", "Explain paging in one sentence.", "What is a KV cache?",
    "Why share memory?", "Name a sorting algorithm.", "What is beam search?",
    "Define throughput.", "What is latency?", "How do forks share pages?",
    "What is copy-on-write?", "Why evict in LRU order?", "What does a scheduler do?",
    "What is a token?", "What is a prefix?", "What is batching?", "What is a GPU?",
]


def system_prompt(tokenizer: Any, num_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["cache", "block", "tree", "prefix", "token", "share", "memory", "page", "fork",
             "evict", "serve", "model", "request", "batch", "engine", "kernel"]
    text = "You are a helpful assistant for an inference engine team."
    while len(tokenizer.encode(text)) < num_tokens:
        text += " " + " ".join(rng.choice(words) for _ in range(12)) + "."
    return text


def build_prompts(tokenizer: Any, num_requests: int, system_tokens: int,
                  seed: int) -> list[list[int]]:
    system = system_prompt(tokenizer, system_tokens, seed)
    return [
        tokenizer.encode_chat([
            {"role": "system", "content": system},
            {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"},
        ])
        for i in range(num_requests)
    ]


def run_radixkv(prompts: list[list[int]], output_tokens: int, prefix: bool,
                args: argparse.Namespace) -> dict[str, Any]:
    from radixkv import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    with LLM(kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs,
             enable_prefix_caching=prefix, num_threads=args.threads) as llm:
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (and a cached prefix)
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        stats = llm.stats()
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in results),
        "prompt_tokens": sum(len(p) for p in prompts),
        "tokens": [r.outputs[0].token_ids for r in results],
        "hit_tokens_total": stats.prefix_hit_tokens,
    }


def run_transformers(prompts: list[list[int]], output_tokens: int,
                     args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from radixkv.checkpoint import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    pad = 2
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for start in range(0, len(prompts), args.hf_batch):
        batch = prompts[start : start + args.hf_batch]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                                 pad_token_id=pad)
        outputs += [row[width:].tolist() for row in out]
    elapsed = time.perf_counter() - started
    generated = sum(len(o) for o in outputs)
    return {"seconds": elapsed, "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed, "tokens": outputs}


def kv_sharing(prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Peak referenced blocks with sharing vs private copies, measured in-process."""
    import torch

    from radixkv.checkpoint import resolve_checkpoint
    from radixkv.config import CacheConfig, SchedulerConfig, WorkerConfig
    from radixkv.ipc.protocol import AddRequest
    from radixkv.kvcache import KVCacheManager
    from radixkv.sampling_params import BeamSearchParams, SamplingParams
    from radixkv.scheduler.scheduler import Scheduler
    from radixkv.worker.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint(None)
    block_size = 16
    runner = ModelRunner.from_checkpoint(
        checkpoint, CacheConfig(block_size=block_size, kv_cache_tokens=block_size * 1024),
        WorkerConfig(),
    )
    results = {}
    cases = {
        "parallel_n4": AddRequest("n4", prompt, sampling=SamplingParams(
            n=4, temperature=1.0, seed=0, max_tokens=args.output_tokens, ignore_eos=True),
            eos_token_ids=(2,)),
        "beam_width4": AddRequest("b4", prompt, beam=BeamSearchParams(
            beam_width=4, max_tokens=args.output_tokens, ignore_eos=True), eos_token_ids=(2,)),
    }
    for name, request in cases.items():
        runner.seqs.clear()
        kv = KVCacheManager(runner.pool.num_blocks, block_size, True)
        scheduler = Scheduler(SchedulerConfig(), kv, checkpoint.model_config.max_model_len)
        scheduler.add_request(request)
        peak = 0
        while scheduler.has_work:
            scheduler.step(runner.execute)
            peak = max(peak, kv.stats().num_referenced_blocks)
        private = 4 * -(-(len(prompt) + args.output_tokens) // block_size)
        results[name] = {
            "peak_blocks_shared": peak,
            "blocks_without_sharing": private,
            "memory_saved": 1 - peak / private,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "offline_cpu.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print("config:", json.dumps(config), "machine:", platform.machine(), os.cpu_count(), "cpus")

    from radixkv.checkpoint import resolve_checkpoint
    from radixkv.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_checkpoint(resolve_checkpoint(None))
    prompts = build_prompts(tokenizer, args.requests, args.system_tokens, args.seed)
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")

    runs = {
        "radixkv": run_radixkv(prompts, args.output_tokens, True, args),
        "radixkv_no_prefix_cache": run_radixkv(prompts, args.output_tokens, False, args),
    }
    if not args.skip_transformers:
        runs["transformers_static_batches"] = run_transformers(prompts, args.output_tokens, args)
    reference = runs["radixkv_no_prefix_cache"]["tokens"]
    for name, run in runs.items():
        same = sum(a == b for a, b in zip(run.pop("tokens"), reference, strict=True))
        run["outputs_equal_to_no_cache"] = f"{same}/{len(reference)}"
        print(f"{name:>30}: {run['output_tokens_per_s']:8.1f} output tok/s "
              f"({run['seconds']:.1f} s) same outputs {run['outputs_equal_to_no_cache']}")
    sharing = kv_sharing(prompts[0], args)
    for name, row in sharing.items():
        print(f"{name}: peak {row['peak_blocks_shared']} blocks shared vs "
              f"{row['blocks_without_sharing']} private ({row['memory_saved']:.1%} saved)")
    result = {"config": config, "throughput": runs, "kv_sharing": sharing}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
