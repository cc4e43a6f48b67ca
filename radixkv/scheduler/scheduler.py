"""Continuous batching over the KV sharing core. No sockets, no torch: plain integers.

One engine step is `schedule()` -> worker -> `update()`; `step(execute)` runs the three.

    schedule():  running requests first (oldest first): decodes and prefill chunks, growing
                 blocks and preempting the newest request when blocks run out; then waiting
                 requests by longest cached prefix (aged ones first), admitted through the
                 KV manager while tokens, seats and blocks last.
    update():    sampled tokens are appended, stop conditions checked, computed prefixes cached,
                 finished sequences freed, beam groups advanced, outputs built.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from radixkv import envs
from radixkv.config import SchedulerConfig, kv_blocks_needed
from radixkv.ipc.protocol import (
    AddRequest,
    EngineStats,
    RequestOutput,
    Sample,
    StepInput,
    StepOutput,
)
from radixkv.kvcache import KVCacheManager, SeqId
from radixkv.scheduler.admission_order import admission_order, waits_for_a_running_prefix
from radixkv.scheduler.beam import BeamCandidates, BeamSearchGroup
from radixkv.scheduler.outputs import build_output
from radixkv.scheduler.prompt_logprobs import collect_prompt_logprobs
from radixkv.scheduler.request import (
    SEED_MASK,
    FinishReason,
    Request,
    RequestError,
    Sequence,
)
from radixkv.scheduler.step_input import Inflight, build_step_input
from radixkv.scheduler.worker_mirror import WorkerMirror


class Scheduler:
    """Owns every request's state between its arrival and its last output."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = (
            min(max_model_len, config.max_model_len) if config.max_model_len else max_model_len
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.seqs: dict[SeqId, tuple[Request, Sequence]] = {}
        self.num_preemptions = 0
        self._step_id = 0
        self._next_seq_id = 0
        self._rng = random.Random()
        self._mirror = WorkerMirror()
        self._outputs: list[RequestOutput] = []
        self._inflight: list[Inflight] = []
        self._debug = envs.debug()

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request. Raises RequestError if it cannot run on this engine."""
        if msg.request_id in self.requests:
            raise RequestError(f"request id {msg.request_id!r} is already in use")
        prompt = list(msg.prompt_token_ids)
        if not prompt:
            raise RequestError("the prompt must contain at least one token")
        params = msg.sampling if msg.beam is None else None
        if msg.beam is None and params is None:
            raise RequestError("a request needs sampling or beam search parameters")
        max_tokens = msg.beam.max_tokens if msg.beam is not None else params.max_tokens  # type: ignore[union-attr]
        if len(prompt) + max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt)} and max_tokens asks for {max_tokens} more"
            )
        width = msg.beam.beam_width if msg.beam is not None else params.num_sequences  # type: ignore[union-attr]
        if width > self.config.max_n:
            raise RequestError(f"at most {self.config.max_n} sequences per request, got {width}")
        if width > self.config.max_num_seqs:
            raise RequestError(
                f"the request needs {width} sequences but the engine runs at most "
                f"{self.config.max_num_seqs} at once"
            )
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=prompt,
            salt=msg.salt,
            eos_token_ids=frozenset(msg.eos_token_ids),
            max_new_tokens=max_tokens,
            arrival_step=self._step_id,
            sampling=params,
            beam_params=msg.beam,
        )
        if params is not None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            request.seed = seed & SEED_MASK
        self._check_fits_pool(request)
        if msg.beam is not None:
            eos = () if msg.beam.ignore_eos else msg.eos_token_ids
            request.beam = BeamSearchGroup(msg.beam, eos, max_tokens)
        leader = self._new_seq(request, index=0, token_ids=list(prompt))
        request.seqs.append(leader)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_fits_pool(self, request: Request) -> None:
        """A request that could not run even alone in an empty pool would never finish."""
        needed = kv_blocks_needed(
            len(request.prompt_token_ids), request.max_new_tokens, request.num_sequences,
            self.kv.block_size,
        )
        if needed > self.kv.num_blocks:
            raise RequestError(
                f"the request needs up to {needed} KV blocks but the pool has "
                f"{self.kv.num_blocks}; shorten it or give the engine more KV memory"
            )

    def abort_request(self, request_id: str) -> None:
        """Finish a request now; its blocks are released (computed prefixes stay cached)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.live_seqs:
            self._finish_seq(request, seq, FinishReason.ABORT)
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish_request(request)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (the worker is gone); nothing is freed remotely."""
        outputs = [
            RequestOutput(
                request_id=r.request_id, seqs=[], num_prompt_tokens=len(r.prompt_token_ids),
                num_cached_tokens=r.num_cached_tokens, finished=True, error=message,
                error_kind="failed",
            )
            for r in self.requests.values()
        ]
        self.waiting.clear()
        self.running.clear()
        self.requests.clear()
        return outputs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # ------------------------------------------------------------------------- the step

    def step(self, execute: Callable[[StepInput], StepOutput]) -> list[RequestOutput]:
        """Schedule, run the worker, apply its samples; returns the outputs of this step."""
        step_input = self.schedule()
        if step_input.chunks or step_input.finished_seq_ids or step_input.block_copies:
            self.update(execute(step_input))
        return self.take_outputs()

    def schedule(self) -> StepInput:
        self._step_id += 1
        self._inflight = []
        token_budget = self.config.max_num_batched_tokens
        token_budget = self._schedule_running(token_budget)
        self._schedule_waiting(token_budget)
        return build_step_input(self._step_id, self._inflight, self.kv, self._mirror)

    def _schedule_running(self, token_budget: int) -> int:
        for request in list(self.running):
            if token_budget == 0:
                break
            if request in self.running:  # not preempted while scheduling an older one
                token_budget -= self._schedule_request(request, token_budget)
        return token_budget

    def _schedule_request(self, request: Request, token_budget: int) -> int:
        """Chunks for the live sequences of a running request; returns the tokens used."""
        used = 0
        for seq, num_tokens in self._plan_chunks(request, token_budget):
            if not self._reserve(request, seq, num_tokens):
                break  # the request itself was preempted (its chunks went with it)
            used += num_tokens
            self._add_chunk(request, seq, num_tokens)
        return used

    @staticmethod
    def _plan_chunks(request: Request, token_budget: int) -> list[tuple[Sequence, int]]:
        plan = []
        live = request.live_seqs
        if request.beam is not None and sum(s.num_uncomputed for s in live) > token_budget:
            # Beams are ranked together: no beam reaches its sampled token before all can,
            # so a recompute that does not fit this step stops one token short everywhere.
            for seq in live:
                num_tokens = min(seq.num_uncomputed - 1, token_budget)
                if num_tokens > 0:
                    plan.append((seq, num_tokens))
                    token_budget -= num_tokens
            return plan
        for seq in live:
            num_tokens = min(seq.num_uncomputed, token_budget)
            if num_tokens == 0:
                break
            plan.append((seq, num_tokens))
            token_budget -= num_tokens
        return plan

    def _reserve(self, request: Request, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` more computed tokens, preempting the newest requests;
        False when that had to be `request` itself."""
        needed = seq.num_computed + num_tokens - self.kv.num_tokens(seq.seq_id)
        if needed <= 0:
            return True
        while True:
            growth = self.kv.grow(seq.seq_id, needed)
            if growth is not None:
                self._mirror.add_copies(growth.block_copies)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _schedule_waiting(self, token_budget: int) -> None:
        seats = self.config.max_num_seqs - sum(r.num_sequences for r in self.running)
        for request in admission_order(self.waiting, self._step_id, self.config, self.kv):
            if token_budget == 0 or seats < request.num_sequences:
                break
            if waits_for_a_running_prefix(request, self.running, self.kv):
                continue
            if not self._admit(request):
                break
            self.waiting.remove(request)
            self.running.append(request)
            seats -= request.num_sequences
            token_budget -= self._schedule_request(request, token_budget)

    def _admit(self, request: Request) -> bool:
        """Admit every live sequence of the request, or none of them."""
        admitted: list[Sequence] = []
        for seq in request.live_seqs:
            admission = self.kv.admit(seq.seq_id, seq.token_ids, request.salt)
            if admission is None:
                for done in admitted:
                    self.kv.free(done.seq_id)
                    self._mirror.forget(done)
                    done.num_computed = 0
                return False
            admitted.append(seq)
            seq.num_computed = admission.num_cached_tokens
            seq.store_from = 0
            if seq.index == 0 and request.num_prompt_logprobs_missing > 0:
                # Recompute the cached part for its logits; its shared K/V stays as it is.
                seq.store_from = admission.num_cached_tokens
                seq.num_computed = min(seq.num_computed, len(request.prompt_logprobs))
            self._mirror.add_copies(admission.block_copies)
            if not request.admitted:
                request.num_cached_tokens = admission.num_cached_tokens
        request.admitted = True
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request by recompute: its prefixes stay cached for readmission."""
        self.num_preemptions += 1
        self.running.remove(request)
        self._inflight = [entry for entry in self._inflight if entry[0] is not request]
        for seq in request.live_seqs:
            self.kv.free(seq.seq_id, seq.token_ids[: seq.num_computed])
            seq.num_computed = 0
            self._mirror.forget(seq)
        self.waiting.insert(0, request)

    # ------------------------------------------------------------------- chunks and input

    def _add_chunk(self, request: Request, seq: Sequence, num_tokens: int) -> None:
        fanout: list[Sequence] = []
        completes = seq.num_computed + num_tokens == len(seq.token_ids)
        if completes and request.pending_fork:
            fanout = self._fork_streams(request, seq)
        self._inflight.append((request, seq, num_tokens, fanout))

    def _fork_streams(self, request: Request, leader: Sequence) -> list[Sequence]:
        """Parallel sampling: the other streams share every prompt block of the leader."""
        request.forked = True
        children = []
        for index in range(1, request.num_sequences):
            child = self._new_seq(request, index, list(leader.token_ids))
            self.kv.fork(leader.seq_id, child.seq_id)
            request.seqs.append(child)
            children.append(child)
        return children

    # --------------------------------------------------------------------------- update

    def update(self, output: StepOutput) -> None:
        """Apply the worker's samples to the step that `schedule()` built."""
        samples = {s.seq_id: s for s in output.samples}
        prompt_logprobs = {p.seq_id: p for p in output.prompt_logprobs}
        touched: dict[str, Request] = {}
        beam_requests: dict[str, Request] = {}
        for request, seq, num_tokens, fanout in self._inflight:
            if seq.seq_id in prompt_logprobs:
                collect_prompt_logprobs(request, seq.num_computed, prompt_logprobs[seq.seq_id])
            seq.num_computed += num_tokens
            for child in fanout:
                child.num_computed = seq.num_computed
            self._cache_progress(seq, num_tokens)
            for s in (seq, *fanout):
                sample = samples.get(s.seq_id)
                if sample is None:
                    continue
                touched[request.request_id] = request
                if request.beam is not None:
                    beam_requests[request.request_id] = request
                    continue
                s.token_ids.append(sample.token_id)
                s.cumulative_logprob += sample.logprob
                if request.sampling is not None and request.sampling.logprobs is not None:
                    s.logprobs.append(sample.logprob)
                    s.top_logprobs.append(
                        list(zip(sample.top_token_ids, sample.top_logprobs, strict=True))
                    )
                reason = request.stop_reason(s, self.max_model_len)
                if reason is not None:
                    self._finish_seq(request, s, reason)
        for request in beam_requests.values():
            self._advance_beams(request, samples)
        self._inflight = []
        for request in touched.values():
            if not request.live_seqs:
                self._finish_request(request)
            else:
                output_msg = build_output(request, final=False)
                if output_msg is not None:
                    self._outputs.append(output_msg)
        if self._debug:
            self.kv.check_invariants()

    def _cache_progress(self, seq: Sequence, num_tokens: int) -> None:
        """Insert newly completed blocks so other requests can hit them while this one runs."""
        block_size = self.kv.block_size
        if num_tokens > 1 or seq.num_computed % block_size == 0:
            self.kv.cache(seq.seq_id, seq.token_ids[: seq.num_computed])

    def _advance_beams(self, request: Request, samples: dict[int, Sample]) -> None:
        group = request.beam
        assert group is not None
        live = request.live_seqs
        result = group.step([_candidates(i, samples[seq.seq_id]) for i, seq in enumerate(live)])
        chosen: dict[int, int] = {}
        successors: list[tuple[Sequence, int]] = []
        for parent_index, token in result.next_beams:
            parent = live[parent_index]
            if parent_index not in chosen:
                chosen[parent_index] = token
                successors.append((parent, token))
            else:
                child = self._new_seq(request, len(request.seqs), list(parent.token_ids))
                self.kv.fork(parent.seq_id, child.seq_id)
                child.num_computed = parent.num_computed
                request.seqs.append(child)
                successors.append((child, token))
        for index, seq in enumerate(live):
            if index not in chosen:
                self._finish_seq(request, seq, FinishReason.STOP, keep=False)
        for seq, token in successors:
            seq.token_ids.append(token)
        # The group numbers live beams in its own order; keep request.seqs in that order.
        request.seqs = [seq for seq, _ in successors]
        if result.done:
            for seq in request.live_seqs:
                self._finish_seq(request, seq, FinishReason.LENGTH, keep=False)

    def _finish_seq(
        self, request: Request, seq: Sequence, reason: FinishReason, keep: bool = True
    ) -> None:
        seq.finish_reason = reason
        if request.admitted and request in self.running:
            self.kv.free(seq.seq_id, seq.token_ids[: seq.num_computed])
        self._mirror.forget(seq)
        self.seqs.pop(seq.seq_id, None)
        if not keep:
            request.seqs.remove(seq)

    def _finish_request(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.requests.pop(request.request_id, None)
        output_msg = build_output(request, final=True)
        assert output_msg is not None
        self._outputs.append(output_msg)

    # ---------------------------------------------------------------------------- helpers

    def _new_seq(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq_id = SeqId(self._next_seq_id)
        self._next_seq_id += 1
        seq = Sequence(
            seq_id=seq_id,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            spec=request.sampling_spec(index),
        )
        self.seqs[seq_id] = (request, seq)
        return seq

    def stats(self) -> EngineStats:
        kv = self.kv.stats()
        return EngineStats(
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            num_referenced_blocks=kv.num_referenced_blocks,
            kv_waste_tokens=kv.kv_waste_tokens,
            allocated_slots=kv.allocated_slots,
            prefix_queried_tokens=kv.queried_tokens,
            prefix_hit_tokens=kv.hit_tokens,
            num_preemptions=self.num_preemptions,
            evicted_blocks=kv.evicted_blocks,
        )


def _candidates(beam_index: int, sample: Sample) -> BeamCandidates:
    return BeamCandidates(
        beam=beam_index, token_ids=list(sample.top_token_ids), logprobs=list(sample.top_logprobs)
    )
