"""A worker without a model, for scheduler tests: it mirrors sequences exactly as the real
ModelRunner does (NewSeq once, then diffs) and 'samples' a token that is a pure function of
the sequence's whole history, so outputs depend only on what was computed, never on batching,
caching or preemption. It also checks the scheduler's messages: every chunk starts where the
worker's history ends, block tables cover the chunk, and no block is written that another
live sequence still reads."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from radixkv.ipc.protocol import Chunk, PromptLogprobs, Sample, StepInput, StepOutput

VOCAB = 100


def next_token(history: list[int], seed: int | None = None) -> int:
    """Greedy is a function of the history; sampling (seed given) of the history and seed."""
    key = repr(history) if seed is None else f"{seed}:{history!r}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def fake_logprobs(
    history: list[int], k: int, seed: int | None = None
) -> tuple[list[int], list[float]]:
    """A deterministic top-k: distinct tokens with strictly decreasing logprobs."""
    first = next_token(history, seed)
    tokens = [(first + 7 * i) % VOCAB for i in range(k)]
    seed = int.from_bytes(hashlib.blake2b(repr(history).encode(), digest_size=4).digest(), "little")
    logprobs = [-0.1 - i * (0.3 + (seed % 97) / 400.0) for i in range(k)]
    return tokens, logprobs


def prompt_logprob(prefix: list[int], target: int) -> float:
    """The fake model's logprob of `target` after `prefix`."""
    return -1.0 - next_token(prefix + [target]) / 10.0


@dataclass
class FakeSeq:
    table: list[int]
    history: list[int]
    num_top: int
    seed: int | None


@dataclass
class FakeWorker:
    block_size: int
    seqs: dict[int, FakeSeq] = field(default_factory=dict)
    steps: list[StepInput] = field(default_factory=list)
    # Which tokens each physical block holds: block -> {offset: (token position, token)}.
    blocks: dict[int, dict[int, int]] = field(default_factory=dict)

    def execute(self, step: StepInput) -> StepOutput:
        self.steps.append(step)
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            assert new.seq_id not in self.seqs, f"seq {new.seq_id} sent twice"
            seed = new.spec.seed if new.spec.temperature > 0 else None
            self.seqs[new.seq_id] = FakeSeq(
                list(new.block_ids), list(new.token_ids), new.spec.num_top_logprobs, seed
            )
        for update in step.block_updates:
            table = self.seqs[update.seq_id].table
            table[update.start : update.start + len(update.block_ids)] = update.block_ids
        dsts = [d for _, d in step.block_copies]
        assert len(dsts) == len(set(dsts)), f"a block is copied into twice: {step.block_copies}"
        for src, dst in step.block_copies:
            self.blocks[dst] = dict(self.blocks.get(src, {}))
        samples = []
        prompt_logprobs = []
        for chunk in step.chunks:
            seq = self.seqs[chunk.seq_id]
            assert chunk.start_pos == len(seq.history), "chunk does not continue the history"
            store_from = chunk.start_pos if chunk.store_from is None else chunk.store_from
            for i, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                block = seq.table[pos // self.block_size]
                if pos < store_from:  # recomputed for logits: the pool must already hold it
                    held = self.blocks.get(block, {}).get(pos % self.block_size)
                    assert held == token, f"position {pos} is not cached as claimed"
                    continue
                self.blocks.setdefault(block, {})[pos % self.block_size] = token
            if chunk.logprob_targets:
                prompt_logprobs.append(self._prompt_logprobs(seq, chunk))
            seq.history.extend(chunk.token_ids)
            self._check_table(seq)
            if chunk.sample:
                for seq_id in [chunk.seq_id, *chunk.fanout_seq_ids]:
                    samples.append(self._sample(seq_id, self.seqs[seq_id]))
        return StepOutput(step_id=step.step_id, samples=samples, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(seq: FakeSeq, chunk: Chunk) -> PromptLogprobs:
        """A pure function of the history up to each position and the target."""
        history = list(seq.history)
        logprobs, top_ids, top_lps = [], [], []
        for i, target in enumerate(chunk.logprob_targets):
            history.append(chunk.token_ids[i])
            logprobs.append(prompt_logprob(history, target))
            ids, lps = fake_logprobs(history, chunk.num_top_logprobs)
            top_ids.append(ids)
            top_lps.append(lps)
        return PromptLogprobs(seq_id=chunk.seq_id, logprobs=logprobs,
                              top_token_ids=top_ids, top_logprobs=top_lps)

    def _check_table(self, seq: FakeSeq) -> None:
        """Every position of the history is what its block holds (no clobbered shared block)."""
        for pos, token in enumerate(seq.history):
            held = self.blocks.get(seq.table[pos // self.block_size], {}).get(pos % self.block_size)
            assert held == token, f"position {pos} holds {held}, expected {token}"

    def _sample(self, seq_id: int, seq: FakeSeq) -> Sample:
        tokens, logprobs = fake_logprobs(seq.history, max(seq.num_top, 1), seq.seed)
        return Sample(
            seq_id=seq_id,
            token_id=tokens[0],
            logprob=logprobs[0],
            top_token_ids=tokens[: seq.num_top],
            top_logprobs=logprobs[: seq.num_top],
        )
