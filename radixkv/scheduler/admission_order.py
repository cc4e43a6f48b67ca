"""Which waiting request is admitted next.

Requests whose prompt is already cached go first (longest cached prefix first): they cost
the least to admit and keep their prefix warm. Requests that waited `aging_steps` steps, and
requests preempted earlier, go before them in arrival order, so nothing starves. A request
sharing a long uncached prefix with one that is computing it right now waits for it to land
in the cache instead of computing it a second time.
"""

from __future__ import annotations

from radixkv.config import SchedulerConfig
from radixkv.kvcache import KVCacheManager
from radixkv.scheduler.request import Request


def admission_order(
    waiting: list[Request], step: int, config: SchedulerConfig, kv: KVCacheManager
) -> list[Request]:
    """The first few waiting requests (a window: the queue may be long) in admission order."""
    window = waiting[: max(4 * config.max_num_seqs, 64)]
    aged: list[Request] = []
    fresh: list[Request] = []
    for request in window:
        waited = step - request.arrival_step
        late = request.admitted or waited >= config.aging_steps
        (aged if late else fresh).append(request)
    fresh.sort(key=lambda r: -kv.peek_prefix(r.seqs[0].token_ids, r.salt))
    return aged + fresh


def waits_for_a_running_prefix(
    request: Request, running: list[Request], kv: KVCacheManager
) -> bool:
    """True when a running request is still computing at least a block of prompt that
    `request` would otherwise compute again."""
    if request.admitted:
        return False
    prompt = request.prompt_token_ids
    cached = kv.peek_prefix(prompt, request.salt)
    for other in running:
        leader = other.seqs[0]
        if other.salt != request.salt or leader.num_computed >= len(other.prompt_token_ids):
            continue
        shared = common_prefix_len(prompt, other.prompt_token_ids)
        if shared - cached >= kv.block_size and leader.num_computed < shared:
            return True
    return False


def common_prefix_len(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    step = 64
    i = 0
    while i + step <= limit and a[i : i + step] == b[i : i + step]:
        i += step
    while i < limit and a[i] == b[i]:
        i += 1
    return i
