"""The scheduler process: sockets around `Scheduler`, and the worker's parent.

    python -m radixkv.scheduler.loop --socket-dir DIR --config FILE

Between steps it drains the front's messages; each step it sends one StepInput to the worker
and waits for its StepOutput, checking every 50 ms that the worker still lives. If the worker
dies or fails, every request ends with an error and the front hears `EngineFailure`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import zmq

from radixkv.checkpoint import resolve_checkpoint
from radixkv.config import EngineConfig
from radixkv.ipc.protocol import (
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineReady,
    RequestOutput,
    Shutdown,
    StatsRequest,
    StepOutput,
    StepOutputs,
    WorkerFailure,
    WorkerReady,
)
from radixkv.ipc.transport import (
    FLUSH_S,
    FRONT_IN,
    FRONT_OUT,
    WORKER_IN,
    WORKER_OUT,
    Channel,
    PeerDiedError,
    parent_alive,
    socket_address,
    start_process,
    stop_process,
    wait_for,
    watch_parent,
)
from radixkv.kvcache import KVCacheManager
from radixkv.scheduler.request import RequestError
from radixkv.scheduler.scheduler import Scheduler

STARTUP_TIMEOUT_S = 600.0
STATS_INTERVAL_S = 0.25


class EngineDown(Exception):
    """The worker is gone; the engine cannot serve."""


class SchedulerProcess:
    def __init__(self, socket_dir: Path, config_path: Path, config: EngineConfig):
        self.config = config
        self.parent = watch_parent()
        self.context = zmq.Context()
        self.front = Channel(
            self.context,
            send_addr=socket_address(socket_dir, FRONT_OUT),
            recv_addr=socket_address(socket_dir, FRONT_IN),
            bind=False,
            peer_alive=lambda: parent_alive(self.parent),
        )
        self.worker = Channel(
            self.context,
            send_addr=socket_address(socket_dir, WORKER_IN),
            recv_addr=socket_address(socket_dir, WORKER_OUT),
            bind=True,
        )
        self.worker_proc: subprocess.Popen[bytes] = start_process(
            "radixkv.worker.loop",
            ["--socket-dir", str(socket_dir), "--config", str(config_path)],
            # OpenMP threads that spin between parallel regions starve the front and the
            # scheduler on a small CPU (measured: a 19x slowdown on 2 cores); sleep instead.
            env_defaults={"OMP_WAIT_POLICY": "PASSIVE"},
        )
        self.worker.peer_alive = lambda: self.worker_proc.poll() is None
        self._last_stats = 0.0
        self._stats_dirty = False
        self._stats_tokens: list[int] = []
        self._rejected: list[RequestOutput] = []

    def run(self) -> int:
        try:
            scheduler = self._start()
        except (EngineDown, PeerDiedError, TimeoutError) as exc:
            if parent_alive(self.parent):
                self._tell_front(EngineFailure(str(exc)))
            self._stop_worker()
            return 1
        try:
            return self._serve(scheduler)
        except (EngineDown, PeerDiedError) as exc:
            if not parent_alive(self.parent):
                return 0  # the front is gone: nobody to tell
            message = f"the engine's worker failed: {exc}"
            self._tell_front(StepOutputs(outputs=scheduler.fail_all(message)))
            self._tell_front(EngineFailure(message))
            return 1
        finally:
            self._stop_worker()

    def _tell_front(self, message: StepOutputs | EngineFailure) -> None:
        with contextlib.suppress(PeerDiedError):
            self.front.send(message)

    def _start(self) -> Scheduler:
        ready = wait_for(
            self.worker, self.worker_proc, STARTUP_TIMEOUT_S, "worker", self.parent
        )
        if isinstance(ready, WorkerFailure):
            raise EngineDown(ready.message)
        assert isinstance(ready, WorkerReady), f"unexpected {type(ready).__name__}"
        checkpoint = resolve_checkpoint(self.config.model)
        cache = self.config.cache
        kv = KVCacheManager(ready.num_blocks, cache.block_size, cache.enable_prefix_caching)
        scheduler = Scheduler(
            self.config.scheduler, kv, checkpoint.model_config.max_model_len
        )
        self.front.send(
            EngineReady(
                num_blocks=ready.num_blocks,
                block_size=cache.block_size,
                max_model_len=scheduler.max_model_len,
            )
        )
        return scheduler

    def _serve(self, scheduler: Scheduler) -> int:
        while True:
            if not self._drain_front(scheduler, wait_s=0.0 if scheduler.has_work else 0.05):
                return 0
            if not parent_alive(self.parent):
                return 0
            if self.worker_proc.poll() is not None:
                raise EngineDown(f"worker exited with code {self.worker_proc.returncode}")
            outputs = self._rejected + scheduler.take_outputs()
            self._rejected = []
            if scheduler.has_work:
                step_input = scheduler.schedule()
                if step_input.chunks or step_input.finished_seq_ids or step_input.block_copies:
                    self.worker.send(step_input)
                    scheduler.update(self._await_step(step_input.step_id))
                outputs += scheduler.take_outputs()
            self._send_outputs(scheduler, outputs)

    def _drain_front(self, scheduler: Scheduler, wait_s: float) -> bool:
        """Apply every queued front message; False when asked to shut down."""
        message = self.front.recv(wait_s)
        while message is not None:
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, AddRequest):
                try:
                    scheduler.add_request(message)
                except RequestError as exc:
                    self._rejected.append(_rejected(message, str(exc)))
            elif isinstance(message, AbortRequest):
                scheduler.abort_request(message.request_id)
            elif isinstance(message, StatsRequest):
                self._stats_tokens.append(message.token)
            message = self.front.recv(None)
        return True

    def _await_step(self, step_id: int) -> StepOutput:
        reply = wait_for(self.worker, self.worker_proc, float("inf"), "worker", self.parent)
        if isinstance(reply, WorkerFailure):
            raise EngineDown(reply.message)
        assert isinstance(reply, StepOutput) and reply.step_id == step_id, "worker out of step"
        return reply

    def _send_outputs(self, scheduler: Scheduler, outputs: list[RequestOutput]) -> None:
        """Outputs, with stats when due: every STATS_INTERVAL_S while busy, once when the
        engine goes idle, and at once for each StatsRequest. An idle engine sends nothing."""
        now = time.monotonic()
        self._stats_dirty |= bool(outputs) or scheduler.has_work
        due = self._stats_dirty and (
            now - self._last_stats >= STATS_INTERVAL_S or not scheduler.has_work
        )
        stats = scheduler.stats() if due or self._stats_tokens else None
        if due:
            self._last_stats = now
            self._stats_dirty = False
        if outputs or due:
            self.front.send(StepOutputs(outputs=outputs, stats=stats))
        for token in self._stats_tokens:
            self.front.send(StepOutputs(outputs=[], stats=stats, stats_token=token))
        self._stats_tokens.clear()

    def _stop_worker(self) -> None:
        if self.worker_proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError, PeerDiedError):
                self.worker.send(Shutdown())
        stop_process(self.worker_proc)
        self.worker.close()
        self.front.close(flush_s=FLUSH_S if parent_alive(self.parent) else 0.0)
        # Terminating the context is what waits for the flush: at interpreter exit pyzmq
        # drops whatever is still queued.
        self.context.term()


def _rejected(message: AddRequest, error: str) -> RequestOutput:
    return RequestOutput(
        request_id=message.request_id, seqs=[],
        num_prompt_tokens=len(message.prompt_token_ids), num_cached_tokens=0,
        finished=True, error=error, error_kind="rejected",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv-scheduler")
    parser.add_argument("--socket-dir", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    config = EngineConfig.from_dict(json.loads(args.config.read_text()))
    return SchedulerProcess(args.socket_dir, args.config, config).run()


if __name__ == "__main__":
    sys.exit(main())
