"""Identifiers the sharing core hands out and takes back: plain ints under NewTypes."""

from __future__ import annotations

from typing import NewType, TypeAlias

SeqId = NewType("SeqId", int)
"""One generated stream (a request with n=4 has four); chosen by the scheduler."""

BlockId = NewType("BlockId", int)
"""A physical block of the KV pool, 0 <= id < num_blocks."""

Salt: TypeAlias = str | None
"""Cache namespace (a tenant). Prefixes inserted under one salt are invisible to every other."""

BlockCopy: TypeAlias = tuple[BlockId, BlockId]
"""(src, dst): the worker copies block src's K and V into block dst before computing."""
