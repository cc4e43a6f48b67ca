"""The random draw of the sampler: an exponential race, keyed so a draw depends only on
(seed, position), never on the batch or on torch's global generator.

argmax_i(w_i / E_i) with E_i ~ Exp(1) picks token i with probability w_i / sum(w). Each E_i
comes from a splitmix64 hash of (row key, stream, id), computed with int64 tensor ops. To
hash a few hundred values per row instead of the whole vocabulary, the race runs twice:

    weights (vocab) ─► buckets of bucket_size tokens ─► race the bucket masses ─► bucket b
                                                       race the tokens of b   ─► token
    P(token) = mass_b / total * w_token / mass_b = w_token / total
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_BUCKET_STREAM = 1  # noise streams of one row: the bucket round and the token round
_TOKEN_STREAM = 2
_MAX_BUCKET_SIZE = 256  # ~sqrt(vocab) for the vocabularies in use


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of one row's draw; any Python int seed is reduced to 64 bits first."""
    state = (_mix64_int(seed & _MASK64) + position * _GOLDEN) & _MASK64
    return _mix64_int(state)


def exponential_noise(keys: torch.Tensor, stream: int, ids: torch.Tensor) -> torch.Tensor:
    """E ~ Exp(1), float64, one per (key, id): splitmix64 of key + (stream << 32 | id) * golden.

    keys: (rows, 1) int64 (the 64-bit keys as two's complement); ids: (rows or 1, n) int64 in
    [0, 2**32). Every value lies in (0, 37], never 0 or infinite.
    """
    counter = ids + (stream << 32)
    uniform_bits = _mix64(keys + counter * _signed64(_GOLDEN))
    mantissa = _shift_right(uniform_bits, 12)  # 52 bits
    uniform = (mantissa.double() + 0.5) * 2.0**-52  # (2m + 1) / 2**53: exact, inside (0, 1)
    return uniform.log_().neg_()


def race(weights: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """Draw one token per row with probability proportional to `weights` (rows, vocab), >= 0
    with a positive entry in every row: an exponential race keyed by `keys` (see row_key),
    bucket masses first, then the tokens of the winning bucket."""
    num_rows, vocab_size = weights.shape
    device = weights.device
    bucket_size = min(vocab_size, _MAX_BUCKET_SIZE)
    num_buckets = -(-vocab_size // bucket_size)
    padding = num_buckets * bucket_size - vocab_size
    if padding:
        weights = torch.nn.functional.pad(weights, (0, padding))
    buckets = weights.view(num_rows, num_buckets, bucket_size)
    key_t = torch.tensor([_signed64(k) for k in keys], dtype=torch.int64, device=device)[:, None]

    bucket_ids = torch.arange(num_buckets, device=device)[None, :]
    mass = buckets.sum(dim=-1)  # (rows, buckets)
    bucket = (mass / exponential_noise(key_t, _BUCKET_STREAM, bucket_ids)).argmax(dim=-1)

    members = buckets[torch.arange(num_rows, device=device), bucket]  # (rows, bucket_size)
    token_ids = bucket[:, None] * bucket_size + torch.arange(bucket_size, device=device)
    winner = (members / exponential_noise(key_t, _TOKEN_STREAM, token_ids)).argmax(dim=-1)
    return bucket * bucket_size + winner


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic wraps like uint64; only the right shifts need the sign bits masked off
    z = (z ^ _shift_right(z, 30)) * _signed64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed64(_MIX2)
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
