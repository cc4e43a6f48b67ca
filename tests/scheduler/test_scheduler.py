"""Scheduler.step() against a fake worker: batching, prefix-aware admission, preemption,
forks, beams, aborts; exact outcomes and the KV invariants after every step."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from radixkv.config import SchedulerConfig
from radixkv.ipc.protocol import AddRequest, RequestOutput, StepInput
from radixkv.kvcache import KVCacheManager
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.request import RequestError
from radixkv.scheduler.scheduler import Scheduler
from tests.scheduler.fake_worker import FakeWorker, next_token, prompt_logprob

BLOCK = 4
EOS = 2


def greedy(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def make(
    num_blocks: int = 64, prefix: bool = True, max_model_len: int = 512, **config: object
) -> tuple[Scheduler, FakeWorker]:
    kv = KVCacheManager(num_blocks, BLOCK, prefix)
    scheduler = Scheduler(SchedulerConfig(**config), kv, max_model_len)  # type: ignore[arg-type]
    return scheduler, FakeWorker(BLOCK)


def add(scheduler: Scheduler, request_id: str, prompt: Sequence[int], **kw: object) -> None:
    params: SamplingParams = kw.pop("params", None) or greedy()  # type: ignore[assignment]
    salt: str | None = kw.pop("salt", None)  # type: ignore[assignment]
    scheduler.add_request(
        AddRequest(request_id, list(prompt), sampling=params, salt=salt, eos_token_ids=(EOS,))
    )


def run(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000
) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work:
            break
        for out in scheduler.step(worker.execute):
            outputs.setdefault(out.request_id, []).append(out)
        scheduler.kv.check_invariants()
    assert not scheduler.has_work, "did not finish"
    return outputs


def tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs for seq in out.seqs if seq.index == index for t in seq.token_ids]


def expected_greedy(prompt: Sequence[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = next_token(history)
        out.append(token)
        if token == EOS:
            break
        history.append(token)
    return out


def assert_all_released(scheduler: Scheduler) -> None:
    stats = scheduler.kv.stats()
    assert stats.num_referenced_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    scheduler.kv.check_invariants()


SYSTEM = list(range(10, 30))  # 20 tokens: 5 full blocks


def test_outputs_are_the_model_function_with_and_without_cache() -> None:
    prompts = {f"r{i}": SYSTEM + [40 + i] * (i + 1) for i in range(6)}
    results = []
    for prefix in (True, False):
        scheduler, worker = make(prefix=prefix)
        for rid, prompt in prompts.items():
            add(scheduler, rid, prompt)
        outputs = run(scheduler, worker)
        results.append({rid: tokens(outputs[rid]) for rid in prompts})
        assert_all_released(scheduler)
    assert results[0] == results[1]
    for rid, prompt in prompts.items():
        assert results[0][rid] == expected_greedy(prompt, 8)


def test_second_request_hits_the_shared_prefix_token_granularly() -> None:
    scheduler, worker = make()
    add(scheduler, "a", SYSTEM + [50, 51, 52])
    run(scheduler, worker)
    # 22 tokens shared, ending mid-block (block 5 holds positions 20..23).
    add(scheduler, "b", SYSTEM + [50, 51, 99, 98])
    first = scheduler.schedule()
    assert first.block_copies, "the partially matched block is copied, not recomputed"
    assert [c.start_pos for c in first.chunks] == [22]
    assert first.chunks[0].token_ids == [99, 98]
    scheduler.update(worker.execute(first))
    outputs = run(scheduler, worker)
    assert outputs["b"][-1].num_cached_tokens == 22
    assert tokens(outputs["b"]) == expected_greedy(SYSTEM + [50, 51, 99, 98], 8)
    assert_all_released(scheduler)


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    scheduler, worker = make()
    prompt = SYSTEM + [50, 51, 52, 53]  # 24 tokens: 6 full blocks
    add(scheduler, "a", prompt)
    run(scheduler, worker)
    add(scheduler, "b", prompt)
    step = scheduler.schedule()
    assert [(c.start_pos, c.token_ids) for c in step.chunks] == [(23, [53])]
    scheduler.update(worker.execute(step))
    outputs = run(scheduler, worker)
    assert outputs["b"][-1].num_cached_tokens == 23
    assert tokens(outputs["b"]) == expected_greedy(prompt, 8)


def test_chunked_prefill_mixes_with_decodes_under_the_token_budget() -> None:
    scheduler, worker = make(max_num_batched_tokens=8)
    add(scheduler, "short", [5, 6, 7])
    scheduler.update(worker.execute(scheduler.schedule()))
    add(scheduler, "long", list(range(60, 80)))
    step = scheduler.schedule()
    sizes = [(c.seq_id, len(c.token_ids), c.sample) for c in step.chunks]
    assert sizes == [(0, 1, True), (1, 7, False)]  # a decode first, then a 7-token chunk
    scheduler.update(worker.execute(step))
    outputs = run(scheduler, worker)
    assert tokens(outputs["long"]) == expected_greedy(list(range(60, 80)), 8)


def test_waiting_requests_with_a_cached_prefix_go_first_but_aged_ones_are_not_starved() -> None:
    scheduler, worker = make(max_num_seqs=1, aging_steps=3)
    add(scheduler, "warm", SYSTEM + [1])
    run(scheduler, worker)
    add(scheduler, "blocker", [70, 71], params=greedy(max_tokens=2))
    add(scheduler, "cold", [90, 91, 92, 93, 94])
    add(scheduler, "hot", SYSTEM + [3])
    order = []
    while scheduler.has_work:
        before = {r.request_id for r in scheduler.running}
        scheduler.step(worker.execute)
        order += [r.request_id for r in scheduler.running if r.request_id not in before]
    # "hot" (20 cached tokens) overtakes both although it arrived last; the two without a
    # cached prefix keep their arrival order.
    assert order == ["hot", "blocker", "cold"]

    scheduler, worker = make(max_num_seqs=1, aging_steps=3)
    add(scheduler, "warm", SYSTEM + [1])
    run(scheduler, worker)
    add(scheduler, "cold", [90, 91, 92, 93, 94])
    for i in range(4):
        add(scheduler, f"hot{i}", SYSTEM + [3 + i], params=greedy(max_tokens=4))
    admitted = []
    while scheduler.has_work:
        before = {r.request_id for r in scheduler.running}
        scheduler.step(worker.execute)
        admitted += [r.request_id for r in scheduler.running if r.request_id not in before]
    # "cold" waits while hot requests overtake it, but only until it has aged 3 steps.
    assert admitted.index("cold") < 4


def test_requests_sharing_an_uncached_prefix_wait_for_the_first() -> None:
    scheduler, worker = make(max_num_batched_tokens=8)
    long_prefix = list(range(100, 132))  # 32 tokens, nothing cached
    add(scheduler, "a", long_prefix + [1])
    add(scheduler, "b", long_prefix + [2])
    outputs = run(scheduler, worker)
    assert outputs["a"][-1].num_cached_tokens == 0
    assert outputs["b"][-1].num_cached_tokens == 32
    assert tokens(outputs["b"]) == expected_greedy(long_prefix + [2], 8)


def test_preemption_by_recompute_gives_the_same_outputs() -> None:
    prompts = {f"r{i}": [20 + i] * 9 + [i] for i in range(5)}
    big, worker = make(num_blocks=200)
    for rid, prompt in prompts.items():
        add(big, rid, prompt, params=greedy(max_tokens=24))
    expected = {rid: tokens(out) for rid, out in run(big, worker).items()}

    small, worker = make(num_blocks=14)
    for rid, prompt in prompts.items():
        add(small, rid, prompt, params=greedy(max_tokens=24))
    got = {rid: tokens(out) for rid, out in run(small, worker).items()}
    assert small.num_preemptions > 0
    assert got == expected
    assert_all_released(small)


def test_parallel_sampling_forks_share_the_prompt_blocks() -> None:
    scheduler, worker = make()
    prompt = list(range(40, 58))  # 18 tokens: 4 full blocks + 2 in the fifth
    add(scheduler, "n4", prompt, params=SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True))
    peak = 0
    outputs: list[RequestOutput] = []
    while scheduler.has_work:
        outputs += scheduler.step(worker.execute)
        peak = max(peak, scheduler.kv.stats().num_referenced_blocks)
        scheduler.kv.check_invariants()
    prompt_blocks, output_blocks = 5, -(-9 // BLOCK)
    assert peak <= prompt_blocks + 4 * (output_blocks + 1)
    assert peak < 4 * (prompt_blocks + output_blocks)  # far below four private copies
    prefill_steps = [s for s in worker.steps if any(c.fanout_seq_ids for c in s.chunks)]
    assert len(prefill_steps) == 1, "the prompt is computed once for all four streams"
    streams = [tokens(outputs, i) for i in range(4)]
    assert [len(s) for s in streams] == [9, 9, 9, 9]
    assert len({tuple(s) for s in streams}) == 4, "each stream samples with its own seed"
    assert_all_released(scheduler)


def test_best_of_returns_the_n_best_by_cumulative_logprob() -> None:
    scheduler, worker = make()
    add(scheduler, "b", [5, 6, 7], params=SamplingParams(n=2, best_of=4, temperature=1.0,
                                                          seed=1, max_tokens=5))
    outputs = run(scheduler, worker)
    assert len(outputs["b"]) == 1, "best_of answers once, at the end"
    final = outputs["b"][0]
    assert [s.index for s in final.seqs] == [0, 1]
    assert final.seqs[0].cumulative_logprob >= final.seqs[1].cumulative_logprob


def test_stop_conditions() -> None:
    scheduler, worker = make()
    prompt = [11, 12, 13]
    free_run = expected_greedy(prompt, 8)
    add(scheduler, "stop-id", prompt, params=greedy(stop_token_ids=(free_run[2],)))
    add(scheduler, "len", prompt, params=greedy(max_tokens=3))
    outputs = run(scheduler, worker)
    assert tokens(outputs["stop-id"]) == free_run[:3]
    assert outputs["stop-id"][-1].seqs[0].finish_reason == "stop"
    assert tokens(outputs["len"]) == free_run[:3]
    assert outputs["len"][-1].seqs[0].finish_reason == "length"


def test_eos_stops_unless_ignored() -> None:
    prompt = _prompt_reaching_eos()
    scheduler, worker = make()
    add(scheduler, "eos", prompt, params=greedy(max_tokens=6))
    add(scheduler, "ignore", prompt, params=greedy(max_tokens=6, ignore_eos=True))
    outputs = run(scheduler, worker)
    assert tokens(outputs["eos"]) == [EOS]
    assert outputs["eos"][-1].seqs[0].finish_reason == "stop"
    assert len(tokens(outputs["ignore"])) == 6


def _prompt_reaching_eos() -> list[int]:
    for a in range(3, 100):
        for b in range(3, 100):
            if next_token([a, b]) == EOS:
                return [a, b]
    raise AssertionError("no two-token prompt leads to EOS")


def test_abort_releases_every_block_and_keeps_the_prefix_cached() -> None:
    scheduler, worker = make()
    add(scheduler, "a", SYSTEM + [1], params=greedy(max_tokens=50))
    for _ in range(4):
        scheduler.step(worker.execute)
    assert scheduler.kv.stats().num_referenced_blocks > 0
    scheduler.abort_request("a")
    outputs = scheduler.take_outputs()
    assert outputs[-1].finished and outputs[-1].seqs[0].finish_reason == "abort"
    assert not scheduler.has_work
    assert_all_released(scheduler)
    assert scheduler.kv.peek_prefix(SYSTEM + [1, 7], None) >= 20
    step = scheduler.schedule()
    assert step.finished_seq_ids == [0], "the worker is told to forget the sequence"


def test_beam_search_forks_and_frees_beams() -> None:
    scheduler, worker = make()
    scheduler.add_request(
        AddRequest("beam", [5, 6, 7, 8, 9], beam=BeamSearchParams(beam_width=3, max_tokens=6),
                   eos_token_ids=(EOS,))
    )
    outputs = run(scheduler, worker)
    final = outputs["beam"][-1]
    assert final.finished and len(final.seqs) == 3
    scores = [s.score for s in final.seqs]
    assert scores == sorted(scores, reverse=True)
    assert any(step.new_seqs and step.chunks for step in worker.steps[1:]), "beams were forked"
    assert_all_released(scheduler)


def test_requests_that_cannot_run_are_rejected() -> None:
    scheduler, _ = make(num_blocks=8, max_model_len=64, max_n=4)
    with pytest.raises(RequestError, match="context length"):
        add(scheduler, "long", [1] * 60, params=greedy(max_tokens=10))
    with pytest.raises(RequestError, match="KV blocks"):
        add(scheduler, "big", [1] * 30, params=greedy(max_tokens=30))
    with pytest.raises(RequestError, match="at most 4"):
        add(scheduler, "wide", [1, 2], params=SamplingParams(n=5))
    with pytest.raises(RequestError, match="at least one token"):
        add(scheduler, "empty", [])
    add(scheduler, "ok", [1, 2])
    with pytest.raises(RequestError, match="already in use"):
        add(scheduler, "ok", [1, 2])


def test_each_sequence_is_sent_to_the_worker_once_then_diffs() -> None:
    scheduler, worker = make()
    add(scheduler, "a", list(range(30, 43)), params=greedy(max_tokens=10))
    run(scheduler, worker)
    new_seq_steps = [i for i, s in enumerate(worker.steps) if s.new_seqs]
    assert new_seq_steps == [0]
    appended = [u for s in worker.steps for u in s.block_updates]
    assert appended and all(len(u.block_ids) >= 1 for u in appended)
    assert all(isinstance(s, StepInput) for s in worker.steps)


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_matches_the_model_function(seed: int) -> None:
    """Random prompts sharing prefixes, random n / best_of / beams, aborts, a pool small
    enough to preempt: greedy outputs are the model function, seeded streams and beams are
    identical to a run with a big pool and no cache, and everything is released at the end."""
    import random

    rng = random.Random(seed)
    bases = [[rng.randrange(3, 100) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    requests = []
    for i in range(14):
        prompt = rng.choice(bases) + [rng.randrange(3, 100) for _ in range(rng.randrange(1, 6))]
        kind = rng.random()
        params: SamplingParams | BeamSearchParams
        if kind < 0.4:
            params = greedy(max_tokens=rng.randrange(1, 16))
        elif kind < 0.8:
            n = rng.randrange(1, 3)
            params = SamplingParams(n=n, best_of=n + rng.randrange(0, 2), temperature=1.0,
                                    seed=i, max_tokens=rng.randrange(1, 16))
        else:
            params = BeamSearchParams(beam_width=rng.randrange(1, 4),
                                      max_tokens=rng.randrange(1, 10))
        requests.append((f"r{i}", prompt, params))
    aborted = {f"r{i}" for i in rng.sample(range(14), 2)}

    def play(num_blocks: int, prefix: bool, abort: bool) -> dict[str, list[list[int]]]:
        scheduler, worker = make(num_blocks=num_blocks, prefix=prefix,
                                 max_num_batched_tokens=rng.choice([6, 16, 64]), max_num_seqs=10)
        for rid, prompt, params in requests:
            if isinstance(params, BeamSearchParams):
                scheduler.add_request(
                    AddRequest(rid, list(prompt), beam=params, eos_token_ids=(EOS,))
                )
            else:
                add(scheduler, rid, prompt, params=params)
        outputs: dict[str, list[RequestOutput]] = {}
        step = 0
        while scheduler.has_work:
            step += 1
            if abort and step == 3:
                for rid in aborted:
                    scheduler.abort_request(rid)
            for out in scheduler.step(worker.execute):
                outputs.setdefault(out.request_id, []).append(out)
            scheduler.kv.check_invariants()
        assert_all_released(scheduler)
        preemptions.append(scheduler.num_preemptions)
        return {
            rid: [tokens(outs, i) for i in range(4)] for rid, outs in outputs.items()
            if not (abort and rid in aborted)
        }

    preemptions: list[int] = []
    reference = play(num_blocks=400, prefix=False, abort=False)
    def blocks_needed(prompt: list[int], params: SamplingParams | BeamSearchParams) -> int:
        beam = isinstance(params, BeamSearchParams)
        width = params.beam_width if beam else params.num_sequences  # type: ignore[union-attr]
        return -(-len(prompt) // BLOCK) + width * (-(-params.max_tokens // BLOCK) + 1)

    smallest = max(blocks_needed(prompt, params) for _, prompt, params in requests)
    tight = play(num_blocks=max(18, smallest), prefix=True, abort=True)
    assert preemptions[0] == 0 and preemptions[1] > 0
    for rid, prompt, params in requests:
        if rid in aborted:
            continue
        assert tight[rid] == reference[rid], rid
        if isinstance(params, SamplingParams) and params.temperature == 0:
            assert reference[rid][0] == expected_greedy(prompt, params.max_tokens)


def test_prompt_logprobs_cover_cached_tokens_without_rewriting_them() -> None:
    """A request asking for prompt logprobs gets them for every prompt token, cached ones
    included: the cached part is recomputed for its logits only (the fake worker asserts
    that positions before store_from are never written), and the values do not depend on
    what was cached, how the prompt was chunked, or preemption."""
    prompt = SYSTEM + [61, 62, 63]
    expected = [prompt_logprob(prompt[: p + 1], prompt[p + 1]) for p in range(len(prompt) - 1)]
    params = greedy(max_tokens=4, prompt_logprobs=2)
    for warm, budget in [(False, 64), (True, 64), (True, 5)]:
        scheduler, worker = make(max_num_batched_tokens=budget)
        if warm:
            add(scheduler, "warm", SYSTEM + [61, 99])
            run(scheduler, worker)
        add(scheduler, "p", prompt, params=params)
        outputs = run(scheduler, worker)["p"]
        carrying = [o for o in outputs if o.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] is outputs[0], "sent once, with the first"
        assert carrying[0].prompt_logprobs == expected
        assert carrying[0].prompt_top_logprobs is not None
        assert all(len(top) == 2 for top in carrying[0].prompt_top_logprobs)
        if warm:
            assert outputs[-1].num_cached_tokens == 21
            discarded = [c for s in worker.steps for c in s.chunks if c.store_from is not None]
            assert discarded and discarded[0].start_pos == 0 and discarded[0].store_from == 21
        assert tokens(outputs) == expected_greedy(prompt, 4)
        assert_all_released(scheduler)


def test_prompt_logprobs_survive_preemption() -> None:
    prompts = {f"r{i}": [20 + i] * 9 + [i, 7, 8] for i in range(4)}
    results = []
    for num_blocks in (200, 14):
        scheduler, worker = make(num_blocks=num_blocks, max_num_batched_tokens=6)
        for rid, prompt in prompts.items():
            add(scheduler, rid, prompt, params=greedy(max_tokens=20, prompt_logprobs=0))
        outputs = run(scheduler, worker)
        results.append({rid: next(o.prompt_logprobs for o in outs if o.prompt_logprobs)
                        for rid, outs in outputs.items()})
        if num_blocks == 14:
            assert scheduler.num_preemptions > 0
    assert results[0] == results[1]
    for rid, prompt in prompts.items():
        assert results[0][rid] == [prompt_logprob(prompt[: p + 1], prompt[p + 1])
                                   for p in range(len(prompt) - 1)]
