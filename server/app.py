"""The OpenAI-compatible HTTP server: `radixkv serve [MODEL]`.

    GET  /health                503 until the engine serves, and again once it has failed
    GET  /metrics               Prometheus text (KV blocks, prefix-cache tokens, latencies)
    GET  /v1/models
    POST /v1/completions        text / token-id prompts, n, best_of, beam search, echo, logprobs
    POST /v1/chat/completions   messages through the chat template, logprobs + top_logprobs
    POST /tokenize, /detokenize

This process tokenizes, streams and keeps HTTP; the engine runs in the scheduler and worker
processes it starts. It never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixkv.checkpoint import CheckpointError, resolve_checkpoint
from radixkv.config import (
    ConfigError,
    EngineConfig,
)
from radixkv.server.body_limit import BodyLimitMiddleware
from radixkv.server.chat import create_chat_completion, render_chat
from radixkv.server.completions import create_completion
from radixkv.server.errors import bad_request, engine_unavailable, install_error_handlers
from radixkv.server.metrics import CONTENT_TYPE
from radixkv.server.openai_types import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from radixkv.server.state import ServerSettings, ServerState, parse_body

logger = logging.getLogger("radixkv.server")

# /metrics asks the engine for fresh stats and waits this long for them.
_METRICS_STATS_TIMEOUT_S = 0.5


def create_app(state: ServerState, on_start_failure: Callable[[str], None]) -> FastAPI:
    """The ASGI app; its lifespan starts the engine (in the background) and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter = asyncio.create_task(state.engine.start(on_start_failure))
        try:
            yield
        finally:
            await state.engine.close()
            starter.cancel()

    app = FastAPI(title="radixkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=state.settings.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.serving:
            return engine_unavailable(state.engine.status).response()
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> Response:
        await state.engine.fresh_stats(_METRICS_STATS_TIMEOUT_S)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state.tenancy.tenant(request.headers.get("authorization"))
        ready = state.engine.ready
        card = ModelCard(
            id=state.model_name, created=state.created,
            max_model_len=ready.max_model_len if ready is not None else None,
        )
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        state.tenancy.tenant(request.headers.get("authorization"))
        body = await parse_body(request, TokenizeRequest)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            _, tokens = render_chat(state.tokenizer, body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            tokens = state.tokenizer.encode(body.prompt, body.add_special_tokens)
        ready = state.engine.ready
        reply = TokenizeResponse(
            tokens=tokens, count=len(tokens),
            max_model_len=ready.max_model_len if ready is not None else None,
        )
        return JSONResponse(reply.model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        state.tenancy.tenant(request.headers.get("authorization"))
        body = await parse_body(request, DetokenizeRequest)
        state.check_model(body.model)
        vocab_size = state.checkpoint.model_config.vocab_size
        for token_id in body.tokens:
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                    "tokens",
                )
        text = state.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))

    return app


def serve(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Run the server until interrupted; the exit status (1 if the engine failed to start)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        checkpoint = resolve_checkpoint(args.model)
        if args.max_body_bytes <= 0:
            raise ConfigError(f"--max-body-bytes must be > 0, got {args.max_body_bytes}")
        settings = ServerSettings(
            host=args.host,
            port=args.port,
            api_keys=tuple(args.api_key),
            served_model_name=args.served_model_name or checkpoint.name,
            max_body_bytes=args.max_body_bytes,
            engine=EngineConfig.from_options(str(checkpoint.path), **engine_kwargs),
        )
        state = ServerState.build(settings, checkpoint)
    except (CheckpointError, ConfigError) as exc:
        sys.stderr.write(f"radixkv serve: {exc}\n")
        return 2
    exit_code = 0
    server: uvicorn.Server | None = None

    def on_start_failure(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("the engine failed to start: %s", message)
        if server is not None:
            server.should_exit = True

    app = create_app(state, on_start_failure)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level="info",
            timeout_graceful_shutdown=5,
        )
    )
    logger.info(
        "serving %s as %r on http://%s:%d (API keys: %s)", checkpoint.path,
        settings.served_model_name, settings.host, settings.port,
        len(settings.api_keys) or "none",
    )
    server.run()
    return exit_code
