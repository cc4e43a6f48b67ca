"""POST /v1/chat/completions: messages through the model's chat template, then one request."""

from __future__ import annotations

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
from radixkv.server.generation_params import build_params, check_common
from radixkv.server.logprobs import chat_logprobs
from radixkv.server.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
)
from radixkv.server.state import ServerState, parse_body
from radixkv.server.submission import PromptInput, Submission
from radixkv.tokenizer import ChatTemplateError, Tokenizer


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _ChatRun:
    def __init__(self, state: ServerState, body: ChatCompletionRequest, submission: Submission):
        self.state = state
        self.body = body
        self.submission = submission
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.want_logprobs = bool(body.logprobs)
        self.num_top = body.top_logprobs or 0
        self.choices = [_Choice() for _ in range(submission.params.num_choices)]

    def pieces(self, deltas: list[TextDelta]) -> list[ChatChunkChoice]:
        pieces = []
        for delta in deltas:
            choice = self.choices[delta.index]
            has_tokens = self.want_logprobs and bool(delta.token_ids)
            if not (delta.text or delta.finish_reason or has_tokens):
                continue
            logprobs = None
            if self.want_logprobs:
                entries = chat_logprobs(self.state.tokenizer, delta, self.num_top)
                choice.logprobs.extend(entries)
                logprobs = ChatLogprobs(content=entries)
            choice.text.append(delta.text)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
            pieces.append(
                ChatChunkChoice(
                    index=delta.index,
                    delta={"content": delta.text} if delta.text else {},
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                )
            )
        return pieces

    def chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.state.model_name, choices=choices
        )

    def final(self) -> ChatCompletion:
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=[
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content="".join(choice.text)),
                    logprobs=ChatLogprobs(content=choice.logprobs) if self.want_logprobs else None,
                    finish_reason=choice.finish_reason,
                )
                for index, choice in enumerate(self.choices)
            ],
            usage=self.submission.usage(),
        )

    async def collect(self) -> ChatCompletion:
        async for _, deltas in self.submission.events():
            self.pieces(deltas)
        return self.final()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        include_usage = self.body.stream_options is not None and (
            self.body.stream_options.include_usage
        )
        try:
            # OpenAI opens every choice with the role, then streams content.
            yield event(self.chunk([
                ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""},
                                logprobs=None, finish_reason=None)
                for i in range(len(self.choices))
            ]))
            async for _, deltas in self.submission.events():
                for piece in self.pieces(deltas):
                    yield event(self.chunk([piece]))
            if include_usage:
                usage_chunk = self.chunk([])
                usage_chunk.usage = self.submission.usage()
                yield event(usage_chunk)
        except APIError as error:
            yield error_event(error)
        yield DONE


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    tenant = state.tenancy.tenant(request.headers.get("authorization"))
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    limits = state.limits()
    check_common(body, limits)
    _check_chat_fields(body)
    prompt = PromptInput(*render_chat(state.tokenizer, body.messages, body.add_generation_prompt))
    limits.check_prompt(prompt.token_ids, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if max_tokens is None:
        width = body.n if body.n is not None else 1
        max_tokens = limits.default_max_tokens(len(prompt.token_ids), width)
    params = build_params(
        body, max_tokens=max_tokens, logprobs=logprobs, best_of=None,
        eos_token_ids=state.eos_token_ids, limits=limits,
    )
    limits.check_request(len(prompt.token_ids), params.max_tokens, params.width)
    salt = state.tenancy.cache_salt(tenant, body.cache_salt)
    submission = Submission(
        state.engine, state.metrics, state.tokenizer, [prompt], params, salt, "chat"
    )
    run = _ChatRun(state, body, submission)
    if body.stream:
        return EventStreamResponse(run.stream())
    result = await unless_disconnected(request, run.collect())
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(result.model_dump(mode="json"))


def render_chat(
    tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool
) -> tuple[str, list[int]]:
    """The prompt text and token ids of a conversation; a 400 APIError if it cannot render."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    conversation = []
    for i, message in enumerate(messages):
        text = message.text()
        if text is None and message.role != "assistant":
            raise bad_request(f"messages[{i}] ({message.role}) has no content", "messages")
        role = "system" if message.role == "developer" else message.role
        conversation.append({"role": role, "content": text or "", "name": message.name})
    try:
        prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    # The template writes its own BOS; encoding adds none again (as Tokenizer.encode_chat).
    return prompt, tokenizer.encode(prompt, add_special_tokens=False)


def _check_chat_fields(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise bad_request("only the text response_format is supported", "response_format")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= body.top_logprobs <= 20:
            raise bad_request(
                f"top_logprobs must be between 0 and 20, got {body.top_logprobs}", "top_logprobs"
            )
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name)
        if value is not None and value < 1:
            raise bad_request(f"{name} must be >= 1, got {value}", name)
