"""ZeroMQ sockets between the processes, child-process start-up, and death detection.

All sockets are `ipc://` paths inside one private directory (mode 0700) made by the front;
the scheduler and worker connect to paths in it. Each direction is one PUSH/PULL pair, so a
process never blocks on a peer that is gone: it polls with a timeout and checks liveness.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from radixkv.ipc.protocol import decode, encode

POLL_INTERVAL_S = 0.05
FLUSH_S = 1.0  # how long a closing process waits for its last records to leave

# Socket file names inside the private directory; "in"/"out" as seen by the named process.
FRONT_IN = "front-in"  # front -> scheduler
FRONT_OUT = "front-out"  # scheduler -> front
WORKER_IN = "worker-in"  # scheduler -> worker
WORKER_OUT = "worker-out"  # worker -> scheduler


class PeerDiedError(RuntimeError):
    """The process on the other end of a channel exited."""


def private_socket_dir() -> Path:
    """A fresh directory only this user can enter, for the ipc:// socket files."""
    path = Path(tempfile.mkdtemp(prefix="radixkv-"))
    os.chmod(path, 0o700)
    return path


def socket_address(socket_dir: Path, name: str) -> str:
    return f"ipc://{socket_dir / name}"


class Channel:
    """A PUSH socket to a peer and a PULL socket from it, carrying protocol records.

    `peer_alive` lets `send` give up (PeerDiedError) instead of blocking forever when the
    peer is gone and its queue is full or was never connected.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        send_addr: str,
        recv_addr: str,
        bind: bool,
        peer_alive: Callable[[], bool] | None = None,
    ):
        self.peer_alive = peer_alive
        self._send = context.socket(zmq.PUSH)
        self._recv = context.socket(zmq.PULL)
        for sock in (self._send, self._recv):
            sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self._send.bind(send_addr)
            self._recv.bind(recv_addr)
        else:
            self._send.connect(send_addr)
            self._recv.connect(recv_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._recv, zmq.POLLIN)

    @property
    def recv_socket(self) -> zmq.Socket[Any]:
        return self._recv

    def send(self, message: Any) -> None:
        data = encode(message)
        while True:
            try:
                self._send.send(data, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if self.peer_alive is not None and not self.peer_alive():
                    raise PeerDiedError("the peer process is gone") from None
                self._send.poll(int(POLL_INTERVAL_S * 1000), zmq.POLLOUT)

    def recv(self, timeout_s: float | None) -> Any | None:
        """The next record, or None if none arrives within `timeout_s` (None: no wait)."""
        wait_ms = 0 if timeout_s is None else int(timeout_s * 1000)
        if not self._poller.poll(wait_ms):
            return None
        return decode(self._recv.recv(copy=True))

    def close(self, flush_s: float = 0.0) -> None:
        """Close both sockets; records still queued for the peer get up to `flush_s` to
        leave (a process's last words, such as a failure report, must not be dropped)."""
        self._send.close(linger=int(flush_s * 1000))
        self._recv.close(linger=0)


def watch_parent() -> int:
    """The parent's pid, for `parent_alive` polls: every loop of the scheduler and worker
    checks it, so neither outlives its parent by more than a poll interval (or one step).

    Polling rather than Linux's PR_SET_PDEATHSIG: that signal fires when the *thread* that
    started the child exits, which would kill an engine created from a short-lived thread.
    """
    return os.getppid()


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def start_process(
    module: str, args: list[str], env_defaults: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Run `python -m module args...` as a child that shares our stdout/stderr; variables in
    `env_defaults` are set unless the user's environment already sets them."""
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in (env_defaults or {}).items():
        env.setdefault(key, value)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Wait for a child to exit, terminating then killing it if it lingers."""
    if proc.poll() is not None:
        return
    try:
        proc.wait(timeout=timeout_s)
        return
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(
    channel: Channel,
    proc: subprocess.Popen[bytes] | None,
    timeout_s: float,
    what: str,
    parent_pid: int | None = None,
) -> Any:
    """Block for the next record, raising PeerDiedError if `proc` (or, when given, our own
    parent) exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        message = channel.recv(POLL_INTERVAL_S)
        if message is not None:
            return message
        if proc is not None and proc.poll() is not None:
            raise PeerDiedError(f"the {what} process exited with code {proc.returncode}")
        if parent_pid is not None and not parent_alive(parent_pid):
            raise PeerDiedError("our parent process exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no message from the {what} within {timeout_s:.0f} s")
