"""Request -> engine parameters, and the limits checked before the engine sees a request."""

from __future__ import annotations

import pytest

from radixkv.server.errors import APIError
from radixkv.server.generation_params import EngineLimits, build_params
from radixkv.server.openai_types import CompletionRequest

LIMITS = EngineLimits(max_model_len=256, max_n=4, max_num_seqs=8, num_blocks=20, block_size=16,
                      vocab_size=384)


def params(**fields: object) -> object:
    request = CompletionRequest.model_validate({"prompt": "x", **fields}, strict=True)
    return build_params(request, max_tokens=request.max_tokens or 16, logprobs=request.logprobs,
                        best_of=request.best_of, eos_token_ids=(2,), limits=LIMITS)


def test_pool_and_context_limits() -> None:
    # 1 prompt block + 2 sequences * (ceil(100 / 16) + 1 spare) = 1 + 2 * 8 = 17 <= 20 blocks.
    LIMITS.check_request(prompt_len=10, max_tokens=100, width=2)
    with pytest.raises(APIError) as caught:  # 1 + 3 * 8 = 25 > 20
        LIMITS.check_request(prompt_len=10, max_tokens=100, width=3)
    assert (caught.value.status, caught.value.param) == (400, "max_tokens")
    with pytest.raises(APIError):  # 200 + 57 > 256
        LIMITS.check_request(prompt_len=200, max_tokens=57, width=1)
    LIMITS.check_request(prompt_len=200, max_tokens=56, width=1)


def test_default_max_tokens_fits_context_and_pool() -> None:
    assert LIMITS.default_max_tokens(prompt_len=250, width=1) == 6  # the context binds
    # (20 - 1) // 2 - 1 = 8 blocks per sequence: 128 tokens.
    assert LIMITS.default_max_tokens(prompt_len=10, width=2) == 128
    for width in (1, 2, 4):
        prompt_len = 10
        fit = LIMITS.default_max_tokens(prompt_len, width)
        LIMITS.check_request(prompt_len, fit, width)


def test_sampling_and_beam_parameters() -> None:
    sampled = params(n=2, temperature=0.5, top_k=-1, stop="END", stop_token_ids=[7])
    assert sampled.sampling.n == 2 and sampled.sampling.top_k == 0  # type: ignore[attr-defined]
    assert sampled.sampling.stop == ("END",) and sampled.beam is None  # type: ignore[attr-defined]
    beam = params(n=3, use_beam_search=True, length_penalty=0.5, stop_token_ids=[7],
                  max_tokens=9)
    assert beam.sampling is None  # type: ignore[attr-defined]
    assert beam.beam.beam_width == 3 and beam.beam.max_tokens == 9  # type: ignore[attr-defined]
    assert beam.eos_token_ids == (2, 7)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 5, "best_of": 5}, "best_of"),
    ({"temperature": -1.0}, "temperature"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"use_beam_search": True, "n": 9}, "n"),
    ({"n": 3, "best_of": 4, "max_tokens": 1}, None),
])
def test_refusals_name_the_field(fields: dict[str, object], param: str | None) -> None:
    if param is None:
        params(**fields)
        return
    with pytest.raises(APIError) as caught:
        params(**fields)
    assert caught.value.status == 400 and caught.value.param == param
