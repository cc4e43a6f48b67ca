"""The worker process: a thin socket shell around ModelRunner.

    python -m radixkv.worker.loop --socket-dir DIR --config FILE
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import zmq

from radixkv.checkpoint import resolve_checkpoint
from radixkv.config import EngineConfig
from radixkv.ipc.protocol import Shutdown, StepInput, WorkerFailure, WorkerReady
from radixkv.ipc.transport import (
    FLUSH_S,
    WORKER_IN,
    WORKER_OUT,
    Channel,
    parent_alive,
    socket_address,
    watch_parent,
)


def run(socket_dir: Path, config: EngineConfig) -> int:
    parent = watch_parent()
    context = zmq.Context()
    channel = Channel(
        context,
        send_addr=socket_address(socket_dir, WORKER_OUT),
        recv_addr=socket_address(socket_dir, WORKER_IN),
        bind=False,
        peer_alive=lambda: parent_alive(parent),
    )
    try:
        from radixkv.worker.model_runner import ModelRunner

        checkpoint = resolve_checkpoint(config.model)
        runner = ModelRunner.from_checkpoint(checkpoint, config.cache, config.worker)
    except Exception as exc:  # report start-up failures instead of vanishing
        channel.send(WorkerFailure(f"worker failed to start: {type(exc).__name__}: {exc}"))
        channel.close(flush_s=FLUSH_S)
        context.term()
        return 1
    channel.send(
        WorkerReady(
            num_blocks=runner.pool.num_blocks,
            kv_cache_bytes=runner.pool.num_bytes,
            device=str(runner.device),
        )
    )
    flush_s = 0.0  # a failure report gets time to leave before the sockets close
    try:
        while True:
            message = channel.recv(0.5)
            if message is None:
                if not parent_alive(parent):
                    return 0
                continue
            if isinstance(message, Shutdown):
                return 0
            if not isinstance(message, StepInput):
                raise TypeError(f"worker got an unexpected {type(message).__name__}")
            channel.send(runner.execute(message))
    except Exception:
        channel.send(WorkerFailure("worker failed:\n" + traceback.format_exc()))
        flush_s = FLUSH_S
        return 1
    finally:
        channel.close(flush_s)
        context.term()  # waits for records closed with a flush time (see Channel.close)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv-worker")
    parser.add_argument("--socket-dir", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    config = EngineConfig.from_dict(json.loads(args.config.read_text()))
    return run(args.socket_dir, config)


if __name__ == "__main__":
    sys.exit(main())
