"""Packed token keys."""

from __future__ import annotations

import pytest

from radixkv.kvcache import InvalidTokensError
from radixkv.kvcache.token_key import (
    TOKEN_BYTES,
    common_prefix_tokens,
    decode_tokens,
    encode_tokens,
)


def test_round_trip_and_width() -> None:
    tokens = [0, 1, 31_999, 2**32 - 1]
    key = encode_tokens(tokens)
    assert len(key) == 4 * TOKEN_BYTES
    assert decode_tokens(key) == tuple(tokens)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
        ([256, 1], [512, 1], 0),  # differ only in a higher byte of the first token
        ([7, 2**32 - 1], [7, 2**32 - 2], 1),
    ],
)
def test_common_prefix_tokens(a: list[int], b: list[int], expected: int) -> None:
    assert common_prefix_tokens(encode_tokens(a), encode_tokens(b)) == expected
    assert common_prefix_tokens(encode_tokens(b), encode_tokens(a)) == expected


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], b"\x01\x02"])
def test_bad_token_ids_raise(bad: object) -> None:
    with pytest.raises(InvalidTokensError):
        encode_tokens(bad)  # type: ignore[arg-type]


def test_an_array_of_the_key_type_is_packed_as_it_is() -> None:
    from array import array

    assert encode_tokens(array("I", [1, 2, 3])) == encode_tokens([1, 2, 3])
    assert encode_tokens(array("q", [1, 2, 3])) == encode_tokens([1, 2, 3])  # other widths
