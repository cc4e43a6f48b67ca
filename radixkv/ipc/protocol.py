"""Every message that crosses a process boundary. Torch-free; msgpack on the wire, no pickle.

A record is a frozen dataclass registered under a tag. On the wire it is a msgpack extension
(type 1) whose payload is `[tag, field_0, field_1, ...]`; nested records nest the same way.
Decoding checks the tag and the field count and raises `ProtocolError` on anything else.

    front ── AddRequest / AbortRequest / Shutdown ──────────► scheduler
    front ◄── EngineReady / StepOutputs / EngineFailure ───── scheduler
    scheduler ── StepInput / Shutdown ──────────────────────► worker
    scheduler ◄── WorkerReady / StepOutput / WorkerFailure ── worker
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from radixkv.sampling_params import BeamSearchParams, SamplingParams

_EXT_RECORD = 1


class ProtocolError(Exception):
    """Bytes that are not a well-formed radixkv message."""


_TAGS: dict[type, int] = {}
_CLASSES: dict[int, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_TUPLE_FIELDS: dict[type, frozenset[str]] = {}

R = TypeVar("R")


def record(tag: int) -> Any:
    """Register a frozen dataclass as a wire record under `tag`."""

    def register(cls: type[R]) -> type[R]:
        if tag in _CLASSES:
            raise RuntimeError(f"protocol tag {tag} used twice")
        _TAGS[cls] = tag
        _CLASSES[tag] = cls
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        _FIELDS[cls] = tuple(f.name for f in fields)
        _TUPLE_FIELDS[cls] = frozenset(f.name for f in fields if str(f.type).startswith("tuple"))
        return cls

    return register


# --------------------------------------------------------------------------- front <-> scheduler


@record(tag=1)
@dataclass(frozen=True)
class AddRequest:
    """A request the scheduler must run: sampled (`sampling`) or beam search (`beam`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams | None = None
    beam: BeamSearchParams | None = None
    salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()


@record(tag=2)
@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@record(tag=3)
@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@record(tag=4)
@dataclass(frozen=True)
class EngineReady:
    num_blocks: int
    block_size: int
    max_model_len: int


@record(tag=5)
@dataclass(frozen=True)
class SeqOutput:
    """What one sequence of a request produced this step (or, at the end, in total).

    Streaming requests (n == best_of, no beams) get only the new tokens of each step; best_of
    and beam search requests get one final message with each sequence's whole output, in
    result order (`index` is the position in that order).
    """

    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    score: float | None = None


@record(tag=6)
@dataclass(frozen=True)
class RequestOutput:
    """`error_kind` says who is at fault when `error` is set: "rejected" (the request cannot
    run on this engine; it produced nothing) or "failed" (the engine broke)."""

    request_id: str
    seqs: list[SeqOutput]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    error: str | None = None
    error_kind: str | None = None
    # Prompt logprobs (once, complete): for prompt tokens 1.., their logprob and the top
    # alternatives as (token id, logprob).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@record(tag=7)
@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler and the KV cache, sent with step outputs."""

    num_running_requests: int
    num_waiting_requests: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_referenced_blocks: int
    kv_waste_tokens: int
    allocated_slots: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    evicted_blocks: int


@record(tag=8)
@dataclass(frozen=True)
class StepOutputs:
    """Outputs of one step; `stats` rides along at most every few hundred ms while busy,
    once more when the engine goes idle, and in answer to a StatsRequest (then
    `stats_token` repeats the request's token)."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    stats_token: int | None = None


@record(tag=9)
@dataclass(frozen=True)
class EngineFailure:
    """The engine can no longer serve (e.g. its worker died); every request has ended."""

    message: str


@record(tag=10)
@dataclass(frozen=True)
class StatsRequest:
    """Ask the scheduler for an EngineStats snapshot now (answered in a StepOutputs)."""

    token: int = 0


# ------------------------------------------------------------------------ scheduler <-> worker


@record(tag=20)
@dataclass(frozen=True)
class SamplingSpec:
    """The worker's view of how to pick one sequence's next token.

    `num_top_logprobs` alternatives are returned with every sample; greedy when temperature
    is 0. `seed` drives a counter-based generator keyed by (seed, position), so a token does
    not depend on the batch it was sampled in.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    num_top_logprobs: int = 0


@record(tag=21)
@dataclass(frozen=True)
class NewSeq:
    """A sequence the worker has not seen: sent once, then only diffs.

    `token_ids` are the tokens before its first chunk (a cached prefix, or a fork's history);
    the worker's history of the sequence is these plus every chunk it computes afterwards.
    The first `num_prompt_tokens` of that history are the prompt (for the penalties).
    """

    seq_id: int
    block_ids: list[int]
    token_ids: list[int]
    num_prompt_tokens: int
    spec: SamplingSpec


@record(tag=22)
@dataclass(frozen=True)
class BlockUpdate:
    """Set `block_table[start : start + len(block_ids)] = block_ids` (appends when at the end)."""

    seq_id: int
    start: int
    block_ids: list[int]


@record(tag=23)
@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence to compute this step, at positions start_pos onwards.

    With `sample`, the logits of the last token are sampled for this sequence and, with the
    same logits, for every sequence in `fanout_seq_ids`: the streams of a parallel-sampling
    request forked off this one, whose prompt it computed once for all of them.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    sample: bool
    fanout_seq_ids: list[int] = field(default_factory=list)
    # Positions before `store_from` already have their K/V in the (shared) pool: they are
    # computed only for their logits and their new K/V is discarded. None: store all.
    store_from: int | None = None
    # Prompt logprobs: the first len(logprob_targets) positions of the chunk report the
    # logprob of these next tokens, with `num_top_logprobs` alternatives.
    logprob_targets: list[int] = field(default_factory=list)
    num_top_logprobs: int = 0


@record(tag=24)
@dataclass(frozen=True)
class StepInput:
    """One engine step. The worker applies, in order: finished ids, new sequences, block
    updates, block copies; then computes the chunks and samples those that ask."""

    step_id: int
    chunks: list[Chunk]
    new_seqs: list[NewSeq] = field(default_factory=list)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)


@record(tag=25)
@dataclass(frozen=True)
class Sample:
    seq_id: int
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@record(tag=26)
@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of the chunk's target tokens (see Chunk.logprob_targets), in order."""

    seq_id: int
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@record(tag=29)
@dataclass(frozen=True)
class StepOutput:
    step_id: int
    samples: list[Sample]
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


@record(tag=27)
@dataclass(frozen=True)
class WorkerReady:
    num_blocks: int
    kv_cache_bytes: int
    device: str


@record(tag=28)
@dataclass(frozen=True)
class WorkerFailure:
    message: str


# Parameter records the front sends inside AddRequest.
record(tag=40)(SamplingParams)
record(tag=41)(BeamSearchParams)


# ------------------------------------------------------------------------------------- codec


def _default(obj: Any) -> Any:
    cls = type(obj)
    tag = _TAGS.get(cls)
    if tag is None:
        raise ProtocolError(f"{cls.__name__} is not a protocol record")
    payload = [tag, *(getattr(obj, name) for name in _FIELDS[cls])]
    return msgpack.ExtType(_EXT_RECORD, msgpack.packb(payload, default=_default))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_RECORD:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    payload = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    if not isinstance(payload, list) or not payload or not isinstance(payload[0], int):
        raise ProtocolError("malformed record payload")
    cls = _CLASSES.get(payload[0])
    if cls is None:
        raise ProtocolError(f"unknown record tag {payload[0]}")
    names = _FIELDS[cls]
    values = payload[1:]
    if len(values) != len(names):
        raise ProtocolError(
            f"{cls.__name__} needs {len(names)} fields, got {len(values)}"
        )
    kwargs = dict(zip(names, values, strict=True))
    for name in _TUPLE_FIELDS[cls]:
        if isinstance(kwargs[name], list):
            kwargs[name] = tuple(kwargs[name])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"invalid {cls.__name__}: {exc}") from exc


def encode(message: Any) -> bytes:
    """Serialise one record."""
    if type(message) not in _TAGS:
        raise ProtocolError(f"{type(message).__name__} is not a protocol record")
    return msgpack.packb(message, default=_default)


def decode(data: bytes) -> Any:
    """Parse bytes made by `encode`; anything else raises ProtocolError."""
    try:
        message = msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable message: {exc}") from exc
    if type(message) not in _TAGS:
        raise ProtocolError(f"expected a record, got {type(message).__name__}")
    return message
