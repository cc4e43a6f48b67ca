"""POST /v1/completions: prompts as text, token ids, or lists of either.

Each prompt is its own engine request; choices are numbered prompt-major, as OpenAI does
(`index = prompt_index * n + i`), and usage is summed over them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixkv.output_processor import TextDelta
from radixkv.server.errors import APIError, bad_request
from radixkv.server.event_stream import (
    DONE,
    EventStreamResponse,
    error_event,
    event,
    unless_disconnected,
)
from radixkv.server.generation_params import EngineLimits, build_params, check_common
from radixkv.server.logprobs import CompletionLogprobsBuilder, merge_completion_logprobs
from radixkv.server.openai_types import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from radixkv.server.state import ServerState, parse_body
from radixkv.server.submission import PromptInput, Submission
from radixkv.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions


@dataclass
class _Choice:
    """One choice as it accumulates (non-streamed responses join the pieces)."""

    logprobs: CompletionLogprobsBuilder
    text: list[str] = field(default_factory=list)
    logprob_parts: list[CompletionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class _CompletionRun:
    def __init__(self, state: ServerState, body: CompletionRequest, submission: Submission):
        self.state = state
        self.body = body
        self.submission = submission
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = submission.params.num_choices
        self.want_logprobs = body.logprobs is not None
        self.choices = {
            p * self.n + i: _Choice(CompletionLogprobsBuilder(state.tokenizer))
            for p in range(len(submission.prompts))
            for i in range(self.n)
        }
        self.echoed: set[int] = set()

    def echo_pieces(self, prompt_index: int) -> list[CompletionChoice]:
        """With echo, every choice of a prompt starts with that prompt (and, with logprobs,
        the prompt tokens' logprobs, which the engine computes, cached tokens included)."""
        self.echoed.add(prompt_index)
        prompt = self.submission.prompts[prompt_index]
        text = prompt.text
        if text is None:
            text = self.state.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        pieces = []
        for i in range(self.n):
            index = prompt_index * self.n + i
            logprobs = None
            if self.want_logprobs:
                tracker = self.submission.trackers[prompt_index]
                entries = tracker.result().prompt_logprobs
                assert entries is not None, "echo with logprobs asks the engine for them"
                logprobs = self.choices[index].logprobs.prompt(prompt.token_ids, entries)
            pieces.append(self._record(index, text, logprobs, None))
        return pieces

    def pending_echoes(self, prompt_index: int | None) -> list[CompletionChoice]:
        """Echo pieces due now: all at once without logprobs; with logprobs, a prompt's
        piece once its first engine output (which carries the prompt logprobs) arrived."""
        if not self.body.echo:
            return []
        if self.want_logprobs:
            if prompt_index is None or prompt_index in self.echoed:
                return []
            return self.echo_pieces(prompt_index)
        if prompt_index is not None:
            return []
        return [piece for p in range(len(self.submission.prompts))
                for piece in self.echo_pieces(p)]

    def pieces(self, prompt_index: int, deltas: list[TextDelta]) -> list[CompletionChoice]:
        pieces = []
        for delta in deltas:
            index = prompt_index * self.n + delta.index
            choice = self.choices[index]
            has_tokens = self.want_logprobs and bool(delta.token_ids)
            if not (delta.text or delta.finish_reason or has_tokens):
                continue
            logprobs = choice.logprobs.generated(delta) if self.want_logprobs else None
            pieces.append(self._record(index, delta.text, logprobs, delta.finish_reason))
        return pieces

    def chunk(self, choices: list[CompletionChoice]) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.state.model_name,
                          choices=choices)

    def final(self) -> Completion:
        choices = [
            CompletionChoice(
                index=index,
                text="".join(choice.text),
                logprobs=merge_completion_logprobs(choice.logprob_parts)
                if self.want_logprobs else None,
                finish_reason=choice.finish_reason,
            )
            for index, choice in sorted(self.choices.items())
        ]
        return Completion(id=self.id, created=self.created, model=self.state.model_name,
                          choices=choices, usage=self.submission.usage())

    def _record(
        self, index: int, text: str, logprobs: CompletionLogprobs | None, finish: str | None
    ) -> CompletionChoice:
        choice = self.choices[index]
        choice.text.append(text)
        if logprobs is not None:
            choice.logprob_parts.append(logprobs)
        if finish is not None:
            choice.finish_reason = finish
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)

    async def collect(self) -> Completion:
        self.pending_echoes(None)
        async for prompt_index, deltas in self.submission.events():
            self.pending_echoes(prompt_index)
            self.pieces(prompt_index, deltas)
        return self.final()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        include_usage = self.body.stream_options is not None and (
            self.body.stream_options.include_usage
        )
        try:
            for piece in self.pending_echoes(None):
                yield event(self.chunk([piece]))
            async for prompt_index, deltas in self.submission.events():
                for piece in self.pending_echoes(prompt_index) + self.pieces(prompt_index, deltas):
                    yield event(self.chunk([piece]))
            if include_usage:
                usage_chunk = self.chunk([])
                usage_chunk.usage = self.submission.usage()
                yield event(usage_chunk)
        except APIError as error:
            yield error_event(error)
        yield DONE


async def create_completion(state: ServerState, request: Request) -> Response:
    tenant = state.tenancy.tenant(request.headers.get("authorization"))
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    limits = state.limits()
    check_common(body, limits)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompts = _prompts(state.tokenizer, body.prompt, limits)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = build_params(
        body, max_tokens=max_tokens, logprobs=body.logprobs, best_of=body.best_of,
        eos_token_ids=state.eos_token_ids, limits=limits,
    )
    if body.echo and body.logprobs is not None and params.sampling is not None:
        params = dataclasses.replace(
            params, sampling=dataclasses.replace(params.sampling, prompt_logprobs=body.logprobs)
        )
    for prompt in prompts:
        limits.check_request(len(prompt.token_ids), params.max_tokens, params.width)
    salt = state.tenancy.cache_salt(tenant, body.cache_salt)
    submission = Submission(
        state.engine, state.metrics, state.tokenizer, prompts, params, salt, "cmpl"
    )
    run = _CompletionRun(state, body, submission)
    if body.stream:
        return EventStreamResponse(run.stream())
    result = await unless_disconnected(request, run.collect())
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(result.model_dump(mode="json"))


def _prompts(
    tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]],
    limits: EngineLimits,
) -> list[PromptInput]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    inputs = []
    if all(isinstance(p, int) for p in prompt):
        inputs.append(PromptInput(None, list(prompt)))
    else:
        for item in prompt:
            if isinstance(item, str):
                inputs.append(PromptInput(item, tokenizer.encode(item)))
            else:
                inputs.append(PromptInput(None, list(item)))  # type: ignore[arg-type]
    for item in inputs:
        limits.check_prompt(item.token_ids, "prompt")
    return inputs
