"""Server-sent events, and the client-disconnect handling every generation needs.

A stream is `data: <json>` events ending in `data: [DONE]`, as OpenAI streams and as the
serving benchmark clients parse. When the client goes away, the body generator is closed at
once (not left for the garbage collector), so the engine request behind it is aborted and
its blocks are released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from radixkv.server.errors import APIError

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def event(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


def error_event(error: APIError) -> bytes:
    """An error after the 200 header went out: the OpenAI error body as one event."""
    return b"data: " + error.response().body + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse of SSE events that always closes its body generator."""

    def __init__(self, content: AsyncGenerator[bytes, None]):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._generator = content

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            # Runs even when cancelled by a disconnect; the generator's cleanup never awaits.
            await self._generator.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and returning None) if the client disconnects first.

    For non-streamed responses, where nothing else notices a client that left.
    """
    work_task: asyncio.Future[T] = asyncio.ensure_future(work)
    disconnect_task: asyncio.Future[Any] = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        tasks: set[asyncio.Future[Any]] = {work_task, disconnect_task}
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.cancelled():
        return None
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message: Any = await request.receive()
        if message["type"] == "http.disconnect":
            return
