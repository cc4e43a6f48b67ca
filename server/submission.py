"""One HTTP request's engine requests (one per prompt), run together and timed.

    Submission.events()  ->  (prompt_index, [TextDelta, ...]), as outputs arrive

Every prompt's request is sent at once; their outputs interleave. Closing the iterator early
(client gone) aborts every request still running. Usage and latency metrics are kept here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from radixkv.ipc.protocol import AddRequest
from radixkv.output_processor import RequestTracker, TextDelta
from radixkv.server.engine_client import EngineClient, EngineUnavailable, RequestFailed
from radixkv.server.errors import APIError, bad_request, engine_unavailable
from radixkv.server.generation_params import GenerationParams
from radixkv.server.metrics import ServerMetrics
from radixkv.server.openai_types import PromptTokensDetails, Usage
from radixkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptInput:
    text: str | None
    token_ids: list[int]


class Submission:
    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        tokenizer: Tokenizer,
        prompts: list[PromptInput],
        params: GenerationParams,
        salt: str | None,
        id_prefix: str,
    ):
        self.engine = engine
        self.metrics = metrics
        self.prompts = prompts
        self.params = params
        self.salt = salt
        self.arrival = time.monotonic()
        self.trackers = [
            RequestTracker(
                f"{id_prefix}-{uuid.uuid4().hex}",
                tokenizer,
                prompt.token_ids,
                params.sampling,
                params.eos_token_ids,
                prompt.text,
            )
            for prompt in prompts
        ]

    async def events(self) -> AsyncGenerator[tuple[int, list[TextDelta]], None]:
        """(prompt index, deltas) per engine output. Raises APIError on failure."""
        if len(self.trackers) == 1:
            async with contextlib.aclosing(self._run_one(0)) as outputs:
                async for deltas in outputs:
                    yield 0, deltas
            return
        queue: asyncio.Queue[tuple[int, list[TextDelta] | None, BaseException | None]]
        queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async with contextlib.aclosing(self._run_one(index)) as outputs:
                    async for output in outputs:
                        queue.put_nowait((index, output, None))
            except Exception as exc:
                queue.put_nowait((index, None, exc))
            else:
                queue.put_nowait((index, None, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.trackers))]
        try:
            running = len(tasks)
            while running:
                index, item, error = await queue.get()
                if error is not None:
                    raise error
                if item is None:
                    running -= 1
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # each aborts its engine request as it unwinds

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(
            len(stream.token_ids) for t in self.trackers for stream in t.streams.values()
        )
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(t.num_cached_tokens for t in self.trackers)
            ),
        )

    async def _run_one(self, index: int) -> AsyncGenerator[list[TextDelta], None]:
        tracker = self.trackers[index]
        request = AddRequest(
            request_id=tracker.request_id,
            prompt_token_ids=self.prompts[index].token_ids,
            sampling=self.params.sampling,
            beam=self.params.beam,
            salt=self.salt,
            eos_token_ids=self.params.eos_token_ids,
        )
        outcome = "aborted"
        last_output: float | None = None
        try:
            self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
            async with contextlib.aclosing(self.engine.generate(request, tracker)) as outputs:
                async for deltas in outputs:
                    num_new = sum(len(d.token_ids) for d in deltas)
                    if num_new:
                        now = time.monotonic()
                        if last_output is None:
                            self.metrics.time_to_first_token.observe(now - self.arrival)
                        else:
                            self.metrics.inter_token_latency.observe(now - last_output)
                        last_output = now
                        self.metrics.generation_tokens.inc(num_new)
                    yield deltas
            outcome = "finished"
        except EngineUnavailable as exc:
            outcome = "failed"
            raise engine_unavailable(str(exc)) from exc
        except RequestFailed as exc:
            outcome = "failed"
            raise self._classify(exc) from exc
        finally:
            self.metrics.requests.labels(outcome=outcome).inc()

    @staticmethod
    def _classify(exc: RequestFailed) -> APIError:
        """A rejected request is the client's (400); any other failure means the engine
        broke and every request ended with it (503)."""
        if exc.rejected:
            return bad_request(f"the engine refused the request: {exc}")
        return engine_unavailable(f"the engine failed: {exc}")
