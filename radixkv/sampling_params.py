"""User-facing generation parameters, validated with errors a user can act on. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


class SamplingParamsError(ValueError):
    """A generation parameter is out of range; `param` names it (as the OpenAI API spells it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    `n` sequences are returned; `best_of` (>= n) are generated and the n with the highest
    cumulative logprob kept. temperature 0 is greedy. top_k 0 (or -1 style values are not
    accepted) means no top-k limit. `seed` fixes every random choice of the request: the
    same seed gives the same tokens whatever else shares the batch. `logprobs` asks for the
    chosen token's logprob plus that many top alternatives per generated token;
    `prompt_logprobs` the same for every prompt token after the first, cached ones included
    (they are recomputed for their logits; their shared K/V is left untouched).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int(self.n, "n", minimum=1)
        if self.best_of is not None:
            _check_int(self.best_of, "best_of", minimum=1)
            if self.best_of < self.n:
                raise SamplingParamsError(
                    f"best_of must be >= n, got best_of={self.best_of} and n={self.n}", "best_of"
                )
        _check_number(self.temperature, "temperature")
        if self.temperature < 0:
            raise SamplingParamsError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        _check_number(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check_int(self.top_k, "top_k", minimum=0)
        _check_number(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check_number(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(value, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value}", name)
        if self.seed is not None:
            _check_int(self.seed, "seed", minimum=None)
        _check_int(self.max_tokens, "max_tokens", minimum=1)
        for token_id in self.stop_token_ids:
            _check_int(token_id, "stop_token_ids", minimum=0)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingParamsError("stop strings must be non-empty strings", "stop")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(value, name, minimum=0)
                if value > 20:
                    raise SamplingParamsError(f"{name} must be at most 20, got {value}", name)

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated (best_of when set, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search as transformers' `generate(num_beams=beam_width, do_sample=False)` does it.

    Every beam is returned, best first; a finished beam's score is its cumulative logprob
    divided by (generated length ** length_penalty).
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int(self.beam_width, "beam_width", minimum=1)
        _check_int(self.max_tokens, "max_tokens", minimum=1)
        _check_number(self.length_penalty, "length_penalty")
        if not isinstance(self.early_stopping, bool):
            raise SamplingParamsError("early_stopping must be a boolean", "early_stopping")


def _check_int(value: object, name: str, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise SamplingParamsError(f"{name} must be >= {minimum}, got {value}", name)


def _check_number(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamsError(f"{name} must be a number, got {value!r}", name)
    if value != value or value in (float("inf"), float("-inf")):
        raise SamplingParamsError(f"{name} must be finite, got {value}", name)
