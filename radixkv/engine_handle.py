"""The scheduler process as the front sees it: start, handshake, messages, shutdown.

Used by the offline `LLM` and by the server's engine client. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from typing import Any

import zmq

from radixkv.config import EngineConfig
from radixkv.ipc.protocol import EngineFailure, EngineReady, Shutdown
from radixkv.ipc.transport import (
    FRONT_IN,
    FRONT_OUT,
    Channel,
    PeerDiedError,
    private_socket_dir,
    socket_address,
    start_process,
    stop_process,
    wait_for,
)

# After the scheduler exits, how long its last records may take to arrive.
FINAL_RECORDS_S = 0.2


class EngineError(RuntimeError):
    """The engine failed to start or stopped serving."""


class EngineHandle:
    """Starts the scheduler process (which starts the worker) and talks to it."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0):
        self.config = config
        self.socket_dir = private_socket_dir()
        config_path = self.socket_dir / "engine.json"
        config_path.write_text(json.dumps(config.to_dict()))
        self.context = zmq.Context()
        self.channel = Channel(
            self.context,
            send_addr=socket_address(self.socket_dir, FRONT_IN),
            recv_addr=socket_address(self.socket_dir, FRONT_OUT),
            bind=True,
        )
        self.proc: subprocess.Popen[bytes] = start_process(
            "radixkv.scheduler.loop",
            ["--socket-dir", str(self.socket_dir), "--config", str(config_path)],
        )
        self.channel.peer_alive = lambda: self.proc.poll() is None
        self.failure: str | None = None
        try:
            ready = wait_for(self.channel, self.proc, startup_timeout_s, "scheduler")
        except (PeerDiedError, TimeoutError) as exc:
            self.close()
            raise EngineError(f"the engine failed to start: {exc}") from exc
        if isinstance(ready, EngineFailure):
            self.close()
            raise EngineError(ready.message)
        assert isinstance(ready, EngineReady), f"unexpected {type(ready).__name__}"
        self.ready: EngineReady = ready

    @property
    def alive(self) -> bool:
        return self.failure is None and self.proc.poll() is None

    def send(self, message: Any) -> None:
        if not self.alive:
            raise EngineError(self.failure or "the engine is not running")
        try:
            self.channel.send(message)
        except PeerDiedError as exc:
            self.failure = f"the scheduler process exited with code {self.proc.returncode}"
            raise EngineError(self.failure) from exc

    def recv(self, timeout_s: float | None) -> Any | None:
        """The next message from the scheduler, or None after `timeout_s`.

        An `EngineFailure` is returned (and remembered); a vanished scheduler becomes one.
        """
        message = self.channel.recv(timeout_s)
        if message is None and self.failure is None and self.proc.poll() is not None:
            # What it sent just before exiting (its own failure report, last outputs) may
            # still be in flight: that comes first.
            message = self.channel.recv(FINAL_RECORDS_S)
        if message is None and self.failure is None and self.proc.poll() is not None:
            message = EngineFailure(
                f"the scheduler process exited with code {self.proc.returncode}"
            )
        if isinstance(message, EngineFailure):
            self.failure = message.message
        return message

    def close(self) -> None:
        """Stop the scheduler (and with it the worker); safe to call twice."""
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError, PeerDiedError):
                self.channel.send(Shutdown())
        stop_process(self.proc)
        self.channel.close()
        self.context.term()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
