"""Request, sequence and group state on the scheduler side (plain integers, no tensors).

A request is what a user sent; it owns one sequence per generated stream: n (or best_of)
for parallel sampling, beam_width live beams for beam search. A request is the unit of
admission and preemption: its sequences are all waiting or all running.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from radixkv.ipc.protocol import SamplingSpec
from radixkv.kvcache import SeqId
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.beam import BeamSearchGroup

SEED_MASK = (1 << 63) - 1


class RequestError(ValueError):
    """A request the scheduler cannot run (e.g. longer than the context)."""


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """One generated stream.

    `token_ids` is prompt + output. `num_computed` tokens have K/V in the pool; the rest are
    computed by later chunks (for a decoding sequence that is just the last sampled token).
    """

    seq_id: SeqId
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    spec: SamplingSpec
    num_computed: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_reported: int = 0
    store_from: int = 0  # positions before this are recomputed for prompt logprobs only

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    salt: str | None
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    arrival_step: int
    sampling: SamplingParams | None = None
    beam: BeamSearchGroup | None = None
    beam_params: BeamSearchParams | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    admitted: bool = False
    forked: bool = False
    error: str | None = None
    seed: int = 0
    # Prompt logprobs gathered so far: entry p is for prompt token p + 1.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs_reported: bool = False

    @property
    def num_sequences(self) -> int:
        """Seats the request needs when running: every stream it will generate."""
        if self.beam_params is not None:
            return self.beam_params.beam_width
        assert self.sampling is not None
        return self.sampling.num_sequences

    @property
    def num_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def streams(self) -> bool:
        """Whether outputs go out token by token (no best_of selection, no beams)."""
        return self.beam is None and self.sampling is not None and (
            self.sampling.best_of is None or self.sampling.best_of == self.sampling.n
        )

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt logprobs still to compute (0 when none were asked for)."""
        if self.sampling is None or self.sampling.prompt_logprobs is None:
            return 0
        return len(self.prompt_token_ids) - 1 - len(self.prompt_logprobs)

    def sampling_spec(self, index: int) -> SamplingSpec:
        """How the worker picks stream `index`'s tokens; each stream has its own seed."""
        if self.beam is not None:
            return SamplingSpec(num_top_logprobs=self.beam.num_candidates)
        params = self.sampling
        assert params is not None
        return SamplingSpec(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=(self.seed * 1_000_003 + index) & SEED_MASK,
            num_top_logprobs=params.logprobs or 0,
        )

    def stop_reason(self, seq: Sequence, max_model_len: int) -> FinishReason | None:
        """Why a sampled stream stops after its newest token, if it does."""
        params = self.sampling
        assert params is not None
        token = seq.token_ids[-1]
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= self.max_new_tokens or len(seq.token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None

    @property
    def pending_fork(self) -> bool:
        """A parallel-sampling request whose prompt has not been split into its streams."""
        return not self.forked and self.beam is None and self.num_sequences > 1
