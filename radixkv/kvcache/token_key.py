"""Token ids packed into bytes: the radix tree's keys.

Comparing two runs of Python ints costs a rich comparison per token; comparing their packed
bytes is one memcmp, and hashing a packed block is cheap. Each token is TOKEN_BYTES bytes
(unsigned, native order), so token offsets are byte offsets / TOKEN_BYTES.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from radixkv.kvcache.errors import InvalidTokensError

TokenKey = bytes
"""Packed token ids; len(key) == TOKEN_BYTES * number of tokens."""

_TYPECODE = "I"
TOKEN_BYTES = array(_TYPECODE).itemsize
assert TOKEN_BYTES == 4, "array typecode 'I' must be 32 bits on this platform"


def encode_tokens(token_ids: Sequence[int]) -> TokenKey:
    """Pack token ids (0 <= id < 2**32). Raises InvalidTokensError otherwise.

    An `array("I")` is already packed: it is copied as it is, with no per-token work (a list
    or tuple costs a conversion per token, which dominates matching a long prompt).
    """
    if type(token_ids) is array and token_ids.typecode == _TYPECODE:
        return token_ids.tobytes()
    if isinstance(token_ids, bytes | bytearray):
        raise InvalidTokensError("token ids must be a sequence of ints, not bytes")
    try:
        return array(_TYPECODE, token_ids).tobytes()
    except (OverflowError, TypeError) as error:
        raise InvalidTokensError(f"token ids must be ints in [0, 2**32): {error}") from None


def decode_tokens(key: TokenKey) -> tuple[int, ...]:
    """The token ids of a packed key."""
    return tuple(array(_TYPECODE, key))


def common_prefix_tokens(a: TokenKey, b: TokenKey) -> int:
    """How many leading tokens two keys share.

    XOR of the two as little-endian integers: its lowest set bit is in the first differing
    byte, hence in the first differing token (TOKEN_BYTES * 8 bits each).
    """
    size = min(len(a), len(b))
    diff = int.from_bytes(a[:size], "little") ^ int.from_bytes(b[:size], "little")
    if not diff:
        return size // TOKEN_BYTES
    return ((diff & -diff).bit_length() - 1) // (8 * TOKEN_BYTES)


def num_equal_blocks(key: TokenKey, pos: int, end: int, node_tokens: TokenKey, bb: int) -> int:
    """How many leading full blocks (of `bb` bytes) of `node_tokens` equal `key[pos:end]`,
    the first being known equal. Binary search: prefix equality is monotone in length."""
    low = 1
    high = min(len(node_tokens), end - pos) // bb
    while low < high:
        mid = (low + high + 1) // 2
        size = mid * bb
        if key[pos : pos + size] == node_tokens[:size]:
            low = mid
        else:
            high = mid - 1
    return low
