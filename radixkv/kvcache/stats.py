"""A snapshot of the KV pool's use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Block counts now, and cumulative prefix-cache counters.

    num_free_blocks + num_cached_blocks + num_referenced_blocks == num_blocks, where cached
    blocks are held only by the radix tree and referenced ones by at least one live sequence.
    Over referenced blocks, each counted once however many sequences share it:
    allocated_slots = block_size per block, live_tokens = the most tokens any holder has in
    it, kv_waste_tokens = allocated_slots - live_tokens. hit_tokens / queried_tokens sum
    num_cached_tokens / (prompt length - 1) over admissions.
    """

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_referenced_blocks: int
    hit_tokens: int
    queried_tokens: int
    allocated_slots: int
    live_tokens: int
    kv_waste_tokens: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
