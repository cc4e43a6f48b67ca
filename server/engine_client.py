"""The engine as the asyncio server sees it: requests in, per-request output queues out.

    event loop ── send(AddRequest / AbortRequest / StatsRequest) ──► scheduler process
    engine thread ◄── StepOutputs / EngineFailure ───────────────── scheduler process
        └─ call_soon_threadsafe ─► route each RequestOutput to its request's asyncio.Queue

One daemon thread owns the `EngineHandle` for its whole life: it starts the engine (minutes
for a big model, while /health answers 503), receives every message, and closes the engine
at the end. The event loop sends, under a lock the engine thread also takes to close the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from radixkv.config import EngineConfig
from radixkv.engine_handle import EngineError, EngineHandle
from radixkv.ipc.protocol import (
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineReady,
    EngineStats,
    RequestOutput,
    StatsRequest,
    StepOutputs,
)
from radixkv.output_processor import RequestTracker, TextDelta

logger = logging.getLogger("radixkv.server")

_RECV_TIMEOUT_S = 0.1


class EngineUnavailable(Exception):
    """The engine is still starting, failed, or is shutting down."""


class RequestFailed(Exception):
    """The engine ended this request with an error (`rejected`: before producing anything)."""

    def __init__(self, message: str, rejected: bool):
        super().__init__(message)
        self.rejected = rejected


@dataclass(frozen=True)
class _EngineDown:
    reason: str


class EngineClient:
    """Owns the `EngineHandle`; every method is called on the event loop unless noted."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.ready: EngineReady | None = None
        self.failure: str | None = None
        self.stats: EngineStats | None = None
        self._handle: EngineHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | _EngineDown]] = {}
        self._stats_waiters: dict[int, asyncio.Future[None]] = {}
        self._stats_tokens = itertools.count(1)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------ lifecycle

    @property
    def serving(self) -> bool:
        return self.ready is not None and self.failure is None and not self._closing.is_set()

    @property
    def status(self) -> str:
        """Why the engine is not serving ("serving" when it is)."""
        if self.failure is not None:
            return self.failure
        if self._closing.is_set():
            return "the server is shutting down"
        if self.ready is None:
            return "the engine is starting"
        return "serving"

    async def start(self, on_failure: Callable[[str], None]) -> None:
        """Start the engine thread; returns once the engine serves or has failed to start.

        `on_failure(message)` runs on the loop when it cannot start.
        """
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future[EngineReady | str] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._engine_thread, args=(started,), name="engine", daemon=True
        )
        self._thread.start()
        outcome = await started
        if isinstance(outcome, str):
            self.failure = outcome
            on_failure(outcome)
            return
        self.ready = outcome

    async def close(self) -> None:
        """Stop serving and shut the engine down (waits for its processes to exit).

        An engine still starting is left to its thread, which closes it once it is up (or
        is killed with this process; its children then die with the thread).
        """
        with self._lock:
            self._closing.set()
        self._fail_all("the server is shutting down")
        if self._thread is not None and self.ready is not None:
            await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------------- requests

    async def generate(
        self, request: AddRequest, tracker: RequestTracker
    ) -> AsyncGenerator[list[TextDelta], None]:
        """Run one request; yields the text deltas of each of its outputs.

        Raises EngineUnavailable when the engine is (or goes) down and RequestFailed when the
        engine ends the request with an error. Leaving early (the client went away, a stop
        string ended every stream, the task was cancelled) aborts the request in the engine,
        which releases its blocks. Close the iterator (`contextlib.aclosing`) to make that
        happen at once.
        """
        self._require_serving()
        queue: asyncio.Queue[RequestOutput | _EngineDown] = asyncio.Queue()
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        self._queues[request_id] = queue
        done = False
        try:
            self._send(request)
            while not done:
                item = await queue.get()
                if isinstance(item, _EngineDown):
                    done = True
                    raise EngineUnavailable(item.reason)
                deltas = tracker.apply(item)
                if tracker.error is not None:
                    done = True
                    raise RequestFailed(tracker.error, rejected=tracker.error_rejected)
                if tracker.needs_abort:  # stop strings ended every stream
                    self._send(AbortRequest(request_id))
                    tracker.finished = True
                done = tracker.finished
                yield deltas
        finally:
            # Nothing here may await: this runs while the task is being cancelled.
            del self._queues[request_id]
            if not done and self.serving:
                with contextlib.suppress(EngineUnavailable):
                    self._send(AbortRequest(request_id))

    async def fresh_stats(self, timeout_s: float) -> EngineStats | None:
        """A snapshot the scheduler takes after this call (so after every abort sent before
        it), waiting up to `timeout_s`; else the latest one received."""
        if not self.serving or self._loop is None:
            return self.stats
        token = next(self._stats_tokens)
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._stats_waiters[token] = waiter
        try:
            self._send(StatsRequest(token=token))
            await asyncio.wait_for(waiter, timeout_s)
        except (TimeoutError, EngineUnavailable):
            pass
        finally:
            self._stats_waiters.pop(token, None)
        return self.stats

    # ------------------------------------------------------------------------ internals

    def _require_serving(self) -> None:
        if not self.serving:
            raise EngineUnavailable(self.status)

    def _send(self, message: AddRequest | AbortRequest | StatsRequest) -> None:
        with self._lock:
            handle = self._handle
            if handle is None or not self.serving:
                raise EngineUnavailable(self.status)
            try:
                handle.send(message)
            except EngineError as exc:
                raise EngineUnavailable(str(exc)) from exc

    def _call_soon(self, callback: Callable[[], object]) -> None:
        """Run `callback` on the event loop (from any thread); dropped once the loop is gone."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed since the check
            loop.call_soon_threadsafe(callback)

    def _engine_thread(self, started: asyncio.Future[EngineReady | str]) -> None:
        def report(outcome: EngineReady | str) -> None:
            if not started.done():
                started.set_result(outcome)

        try:
            handle = EngineHandle(self.config)
        except Exception as exc:  # EngineError, or e.g. no room for the socket directory
            self._call_soon(functools.partial(report, str(exc) or type(exc).__name__))
            return
        with self._lock:
            self._handle = handle
        try:
            if not self._closing.is_set():
                self._call_soon(functools.partial(report, handle.ready))
                self._read_loop(handle)
        finally:
            with self._lock:
                self._handle = None
            handle.close()

    def _read_loop(self, handle: EngineHandle) -> None:
        """Every message from the scheduler goes to the loop, in order, until closing."""
        while not self._closing.is_set():
            try:
                message = handle.recv(_RECV_TIMEOUT_S)
            except Exception as exc:  # a broken socket or message: the engine is unusable
                logger.exception("engine reader failed")
                message = EngineFailure(f"the engine connection failed: {exc}")
            if isinstance(message, StepOutputs):
                self._call_soon(functools.partial(self._deliver, message))
            elif isinstance(message, EngineFailure):
                logger.error("engine failure: %s", message.message)
                self._call_soon(functools.partial(self._on_engine_failure, message.message))
                return

    def _deliver(self, message: StepOutputs) -> None:
        for out in message.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:  # else an aborted request's last words
                queue.put_nowait(out)
        if message.stats is not None:
            self.stats = message.stats
        if message.stats_token is not None:
            waiter = self._stats_waiters.pop(message.stats_token, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _on_engine_failure(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(_EngineDown(reason))
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        self._stats_waiters.clear()
