"""What generation returns to users of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    score: float | None = None


@dataclass
class RequestResult:
    """Everything a request produced: its prompt and one output per returned sequence."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs: per prompt token, {token id: logprob} for the
    # token itself and the top alternatives; None for the first token (nothing predicts it).
    prompt_logprobs: list[dict[int, float] | None] | None = None
