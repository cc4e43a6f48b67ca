"""Typed errors of the sharing core: misuse by a caller, never our own bugs (those assert)."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error the KV sharing core raises on purpose."""


class BlockRefcountError(KVCacheError):
    """A block was increfed or decrefed while free: a double free or a use after free."""


class UnknownSequenceError(KVCacheError, LookupError):
    """The sequence id is not live in the manager (never admitted, or already freed)."""


class SequenceExistsError(KVCacheError, ValueError):
    """The sequence id is already live; free it before reusing the id."""


class InvalidTokensError(KVCacheError, ValueError):
    """Token ids or block ids that cannot describe the sequence (empty, too long, mismatched)."""
