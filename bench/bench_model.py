"""Model-path speed on this machine: radixkv's paged model vs transformers on the same weights.

Measures the default model's load time, prefill tokens/s and decode tokens/s at batch 1 and
batch 16, both implementations with the same thread count, fp32. radixkv runs with the
attention backend the engine picks for the device (`select_backend`: the CPU backend here).

    python bench/bench_model.py [--model PATH] [--threads 2] [--prompt-len 256] [--decode-steps 32]
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

import torch

from radixkv.checkpoint import resolve_checkpoint
from radixkv.worker.attention import select_backend
from radixkv.worker.batch import SeqChunk, build_model_inputs
from radixkv.worker.model_runner import load_model

RESULTS = Path(__file__).parent / "results"
CPU = torch.device("cpu")


def timed(fn: Any, repeats: int) -> float:
    """Best wall time of `repeats` runs (the machine is shared; the best run is the signal)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def radixkv_path(checkpoint: Any, batch: int, prompt_len: int, steps: int,
                 repeats: int, rng: random.Random) -> dict[str, float]:
    model = load_model(checkpoint, select_backend(CPU), torch.float32, CPU)
    config = checkpoint.model_config
    block_size = 16
    blocks_per_seq = (prompt_len + steps) // block_size + 1
    kv = torch.zeros(config.num_layers, 2, batch * blocks_per_seq, block_size,
                     config.num_kv_heads, config.head_dim)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(prompt_len)]
               for _ in range(batch)]

    @torch.inference_mode()
    def prefill() -> None:
        inputs = build_model_inputs(
            [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)], block_size, CPU
        )
        hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta)
        model.compute_logits(hidden[inputs.last_token_rows])

    @torch.inference_mode()
    def decode() -> None:
        tokens = [1] * batch
        for step in range(steps):
            chunks = [SeqChunk([tokens[i]], prompt_len + step, tables[i]) for i in range(batch)]
            inputs = build_model_inputs(chunks, block_size, CPU)
            hidden = model(inputs.input_ids, inputs.positions, kv, inputs.meta)
            tokens = model.compute_logits(hidden).argmax(-1).tolist()

    prefill_s = timed(prefill, repeats)
    decode_s = timed(lambda: (prefill(), decode()), repeats) - prefill_s
    return {
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_tokens_per_s": batch * steps / decode_s,
    }


def transformers_path(path: Path, batch: int, prompt_len: int, steps: int,
                      repeats: int, rng: random.Random, model: Any) -> dict[str, float]:
    vocab = model.config.vocab_size
    ids = torch.tensor([[rng.randrange(100, vocab) for _ in range(prompt_len)]
                        for _ in range(batch)])

    @torch.inference_mode()
    def prefill() -> Any:
        out = model(ids, use_cache=True)
        return out

    @torch.inference_mode()
    def prefill_and_decode() -> None:
        out = prefill()
        cache = getattr(out, "cache", None) or out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            out = model(token, cache=cache, use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)

    prefill_s = timed(prefill, repeats)
    decode_s = timed(prefill_and_decode, repeats) - prefill_s
    return {
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_tokens_per_s": batch * steps / decode_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2 GGUF")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "model_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print("config:", json.dumps(config), "machine:", platform.processor() or platform.machine(),
          f"{os.cpu_count()} cpus")

    started = time.perf_counter()
    checkpoint = resolve_checkpoint(args.model)
    load_model(checkpoint, select_backend(CPU), torch.float32, CPU)
    radixkv_load_s = time.perf_counter() - started

    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    if checkpoint.kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(checkpoint.path.parent), gguf_file=checkpoint.path.name, dtype=torch.float32
        ).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint.path), dtype=torch.float32)
    transformers_load_s = time.perf_counter() - started

    rows = []
    for batch in (1, 16):
        ours = radixkv_path(checkpoint, batch, args.prompt_len, args.decode_steps,
                            args.repeats, random.Random(args.seed))
        theirs = transformers_path(checkpoint.path, batch, args.prompt_len, args.decode_steps,
                                   args.repeats, random.Random(args.seed), hf)
        rows.append({"batch": batch, "radixkv": ours, "transformers": theirs})
    result = {
        "config": config,
        "load_s": {"radixkv": radixkv_load_s, "transformers": transformers_load_s},
        "rows": rows,
    }
    print(f"load: radixkv {radixkv_load_s:.1f} s, transformers {transformers_load_s:.1f} s")
    print(f"{'batch':>5} {'impl':>12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in rows:
        for impl in ("radixkv", "transformers"):
            r = row[impl]
            print(f"{row['batch']:>5} {impl:>12} {r['prefill_tokens_per_s']:>14.1f} "
                  f"{r['decode_tokens_per_s']:>13.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
