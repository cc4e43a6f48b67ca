"""Everything the request handlers share: settings, tokenizer, engine client, metrics, tenancy."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from radixkv.checkpoint import Checkpoint
from radixkv.config import EngineConfig
from radixkv.server.engine_client import EngineClient
from radixkv.server.errors import bad_request, engine_unavailable, from_validation_error
from radixkv.server.generation_params import EngineLimits
from radixkv.server.metrics import ServerMetrics
from radixkv.server.tenancy import Tenancy
from radixkv.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    host: str
    port: int
    api_keys: tuple[str, ...]
    served_model_name: str
    max_body_bytes: int
    engine: EngineConfig


@dataclass
class ServerState:
    settings: ServerSettings
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    engine: EngineClient
    tenancy: Tenancy
    metrics: ServerMetrics
    eos_token_ids: tuple[int, ...]
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, settings: ServerSettings, checkpoint: Checkpoint) -> ServerState:
        tokenizer = Tokenizer.from_checkpoint(checkpoint)
        engine = EngineClient(settings.engine)
        eos = set(checkpoint.model_config.eos_token_ids) | set(tokenizer.eos_token_ids)
        return cls(
            settings=settings,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            engine=engine,
            tenancy=Tenancy(settings.api_keys),
            metrics=ServerMetrics(lambda: engine.stats, lambda: engine.serving),
            eos_token_ids=tuple(sorted(eos)),
        )

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    def limits(self) -> EngineLimits:
        """The engine's limits; a 503 APIError while it is not serving."""
        ready = self.engine.ready
        if ready is None or not self.engine.serving:
            raise engine_unavailable(self.engine.status)
        return EngineLimits.of(
            self.settings.engine, ready, self.checkpoint.model_config.vocab_size
        )

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise bad_request(
                f"the model {name!r} does not exist on this server; it serves "
                f"{self.model_name!r}", "model", code="model_not_found",
            )


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`; a 400 APIError for bad JSON or bad fields."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
