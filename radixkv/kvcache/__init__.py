"""The KV sharing core: refcounted blocks, a radix tree of computed prefixes, LRU eviction,
copy-on-write forks. Pure Python over integers: no torch, no I/O.

The scheduler imports `KVCacheManager` (and the records it returns) and nothing else.
Layers import one way: block_allocator <- radix_tree (+ radix_node, eviction) <- manager.
"""

from radixkv.kvcache.admission import Admission
from radixkv.kvcache.block_allocator import BlockAllocator
from radixkv.kvcache.errors import (
    BlockRefcountError,
    InvalidTokensError,
    KVCacheError,
    SequenceExistsError,
    UnknownSequenceError,
)
from radixkv.kvcache.eviction import LRUOrder
from radixkv.kvcache.growth import NO_GROWTH, Growth
from radixkv.kvcache.ids import BlockCopy, BlockId, Salt, SeqId
from radixkv.kvcache.insert_result import InsertResult
from radixkv.kvcache.manager import KVCacheManager
from radixkv.kvcache.prefix_match import PrefixMatch
from radixkv.kvcache.radix_node import RadixNode
from radixkv.kvcache.radix_tree import RadixTree
from radixkv.kvcache.stats import KVCacheStats

__all__ = [
    "Admission",
    "BlockAllocator",
    "BlockCopy",
    "BlockId",
    "BlockRefcountError",
    "Growth",
    "InsertResult",
    "InvalidTokensError",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheStats",
    "LRUOrder",
    "NO_GROWTH",
    "PrefixMatch",
    "RadixNode",
    "RadixTree",
    "Salt",
    "SeqId",
    "SequenceExistsError",
    "UnknownSequenceError",
]
