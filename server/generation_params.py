"""From an OpenAI request to engine parameters, refusing with a 400 what the engine would refuse.

The scheduler rejects requests it cannot run (too long for the context, more sequences than
`max_n`, more KV blocks than the pool holds), but only after the HTTP status is chosen; the
same checks run here first so the client gets a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.config import EngineConfig, kv_blocks_needed
from radixkv.ipc.protocol import EngineReady
from radixkv.sampling_params import BeamSearchParams, SamplingParams, SamplingParamsError
from radixkv.server.errors import bad_request
from radixkv.server.openai_types import GenerationRequest


@dataclass(frozen=True)
class EngineLimits:
    """What one request may ask of this engine."""

    max_model_len: int
    max_n: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: EngineConfig, ready: EngineReady, vocab_size: int) -> EngineLimits:
        return cls(
            max_model_len=ready.max_model_len,
            max_n=config.scheduler.max_n,
            max_num_seqs=config.scheduler.max_num_seqs,
            num_blocks=ready.num_blocks,
            block_size=ready.block_size,
            vocab_size=vocab_size,
        )

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request("the prompt must contain at least one token", param)
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(
                    f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})",
                    param,
                )
        if len(token_ids) >= self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt alone has {len(token_ids)}", param,
            )

    def check_request(self, prompt_len: int, max_tokens: int, width: int) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} "
                "for the completion): reduce the prompt or max_tokens", "max_tokens",
            )
        needed = kv_blocks_needed(prompt_len, max_tokens, width, self.block_size)
        if needed > self.num_blocks:
            raise bad_request(
                f"the request needs up to {needed} KV blocks but the engine's pool has "
                f"{self.num_blocks}: reduce max_tokens, n or the prompt", "max_tokens",
            )

    def default_max_tokens(self, prompt_len: int, width: int) -> int:
        """The longest completion that fits both the context and the KV pool."""
        by_context = self.max_model_len - prompt_len
        prompt_blocks = -(-prompt_len // self.block_size)
        blocks_per_seq = (self.num_blocks - prompt_blocks) // width - 1  # one spare, as the engine
        by_pool = blocks_per_seq * self.block_size
        limit = min(by_context, by_pool)
        if limit < 1:
            raise bad_request(
                "the prompt leaves no room for a completion in this engine", "messages"
            )
        return limit


@dataclass(frozen=True)
class GenerationParams:
    """Exactly one of `sampling` and `beam` is set."""

    sampling: SamplingParams | None
    beam: BeamSearchParams | None
    eos_token_ids: tuple[int, ...]

    @property
    def width(self) -> int:
        """Sequences the engine runs for the request."""
        if self.beam is not None:
            return self.beam.beam_width
        assert self.sampling is not None
        return self.sampling.num_sequences

    @property
    def num_choices(self) -> int:
        if self.beam is not None:
            return self.beam.beam_width
        assert self.sampling is not None
        return self.sampling.n

    @property
    def max_tokens(self) -> int:
        if self.beam is not None:
            return self.beam.max_tokens
        assert self.sampling is not None
        return self.sampling.max_tokens


def check_common(request: GenerationRequest, limits: EngineLimits) -> None:
    """Refusals that do not depend on the prompt."""
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if request.cache_salt is not None and not request.cache_salt:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    n = request.n if request.n is not None else 1
    if n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} on this server, got {n}", "n")


def build_params(
    request: GenerationRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    best_of: int | None,
    eos_token_ids: tuple[int, ...],
    limits: EngineLimits,
) -> GenerationParams:
    """Sampling or beam-search parameters for `request`; a 400 APIError for bad values."""
    n = request.n if request.n is not None else 1
    if best_of is not None and best_of > limits.max_n:
        raise bad_request(
            f"best_of must be at most {limits.max_n} on this server, got {best_of}", "best_of"
        )
    try:
        if request.use_beam_search:
            params = _beam_params(request, n, max_tokens, logprobs, best_of, eos_token_ids)
        else:
            params = GenerationParams(
                sampling=_sampling_params(request, n, max_tokens, logprobs, best_of),
                beam=None,
                eos_token_ids=eos_token_ids,
            )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), _openai_param(exc.param)) from exc
    if params.width > limits.max_num_seqs:
        raise bad_request(
            f"the request needs {params.width} sequences but this engine runs at most "
            f"{limits.max_num_seqs} at once", "n" if best_of is None else "best_of",
        )
    return params


def _sampling_params(
    request: GenerationRequest,
    n: int,
    max_tokens: int,
    logprobs: int | None,
    best_of: int | None,
) -> SamplingParams:
    top_k = request.top_k if request.top_k is not None else 0
    if top_k == -1:  # the spelling vLLM clients use for "no limit"
        top_k = 0
    return SamplingParams(
        n=n,
        best_of=best_of,
        temperature=_or(request.temperature, 1.0),
        top_p=_or(request.top_p, 1.0),
        top_k=top_k,
        min_p=_or(request.min_p, 0.0),
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        presence_penalty=_or(request.presence_penalty, 0.0),
        frequency_penalty=_or(request.frequency_penalty, 0.0),
        seed=request.seed,
        max_tokens=max_tokens,
        stop=_stop_strings(request),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )


def _beam_params(
    request: GenerationRequest,
    n: int,
    max_tokens: int,
    logprobs: int | None,
    best_of: int | None,
    eos_token_ids: tuple[int, ...],
) -> GenerationParams:
    if logprobs is not None:
        raise bad_request("logprobs are not available with beam search", "logprobs")
    if _stop_strings(request):
        raise bad_request(
            "stop strings are not supported with beam search (stop_token_ids are)", "stop"
        )
    if best_of is not None and best_of != n:
        raise bad_request("with beam search the beam width is n; leave best_of unset", "best_of")
    for token_id in request.stop_token_ids or ():
        if token_id < 0:
            raise bad_request(f"stop_token_ids must be >= 0, got {token_id}", "stop_token_ids")
    beam = BeamSearchParams(
        beam_width=n,
        max_tokens=max_tokens,
        length_penalty=request.length_penalty,
        early_stopping=request.early_stopping,
        ignore_eos=request.ignore_eos,
    )
    # Beam search ends a beam on any EOS id; stop token ids join them.
    eos = tuple(sorted({*eos_token_ids, *(request.stop_token_ids or ())}))
    return GenerationParams(sampling=None, beam=beam, eos_token_ids=eos)


def _stop_strings(request: GenerationRequest) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _openai_param(param: str | None) -> str | None:
    return {"beam_width": "n"}.get(param or "", param)

