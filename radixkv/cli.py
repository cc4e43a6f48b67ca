"""`radixkv serve`, `radixkv generate`: argparse lives here and nowhere else."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Options every command that starts an engine takes."""
    group = parser.add_argument_group("engine")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--kv-cache-tokens", type=int, default=None,
        help="KV pool size in tokens (default: a fraction of free memory)",
    )
    group.add_argument(
        "--memory-fraction", type=float, default=0.5,
        help="share of free memory for the KV pool when --kv-cache-tokens is not given",
    )
    group.add_argument(
        "--no-prefix-cache", action="store_true",
        help="turn KV sharing through the radix tree off (for comparisons)",
    )
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--max-n", type=int, default=16, help="most sequences one request may ask for"
    )
    group.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    group.add_argument("--device", default="cpu")
    group.add_argument("--num-threads", type=int, default=None)
    group.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        memory_fraction=args.memory_fraction,
        enable_prefix_caching=not args.no_prefix_cache,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_n=args.max_n,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.num_threads,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from radixkv.engine import LLM
    from radixkv.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    with LLM(args.model, **engine_kwargs(args)) as llm:
        if args.chat:
            result = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            result = llm.generate(args.prompt, params, use_tqdm=False)
    sys.stdout.write(result[0].outputs[0].text + "\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from radixkv.server.app import serve

    return serve(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one completion, printed to stdout")
    gen.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument(
        "model", nargs="?", default=None,
        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", action="append", default=[],
        help="accepted key (repeatable); each key is a tenant with its own prefix cache",
    )
    serve.add_argument(
        "--served-model-name", default=None,
        help="the name clients send as `model` (default: the checkpoint's name)",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=4 << 20,
        help="larger request bodies get 413",
    )
    add_engine_options(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
