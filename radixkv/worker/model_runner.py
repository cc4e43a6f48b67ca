"""StepInput -> tensors -> logits -> samples. Mirrors each running sequence on the worker side.

The scheduler sends a sequence once (`NewSeq`), then only diffs: block-table updates, block
copies, the tokens to compute. The runner keeps each sequence's block table and token history
(the penalties need it) and never decides anything the scheduler owns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from radixkv.checkpoint import Checkpoint
from radixkv.config import CacheConfig, WorkerConfig
from radixkv.ipc.protocol import (
    Chunk,
    NewSeq,
    PromptLogprobs,
    Sample,
    SamplingSpec,
    StepInput,
    StepOutput,
)
from radixkv.worker.attention import AttentionBackend, select_backend
from radixkv.worker.batch import SeqChunk, build_model_inputs
from radixkv.worker.kv_pool import KVPool, num_blocks_for
from radixkv.worker.loader import load_weights
from radixkv.worker.models.llama import LlamaForCausalLM
from radixkv.worker.sampler import Sampler

PROMPT_LOGPROB_ROWS = 256
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class SeqState:
    block_table: list[int]
    history: list[int]
    num_prompt_tokens: int
    spec: SamplingSpec


class ModelRunner:
    """Owns the model, the KV pool and the sampler of one worker."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
    ):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.sampler = Sampler(model.config.vocab_size, device)
        self.seqs: dict[int, SeqState] = {}
        self.load_seconds = 0.0

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, cache_config: CacheConfig, worker_config: WorkerConfig
    ) -> ModelRunner:
        """Load weights, then size the pool from what memory is left."""
        started = time.perf_counter()
        if worker_config.num_threads is not None:
            torch.set_num_threads(worker_config.num_threads)
        torch.manual_seed(worker_config.seed)
        device = torch.device(worker_config.device)
        dtype = DTYPES[worker_config.dtype]
        backend = select_backend(device)
        model = load_model(checkpoint, backend, dtype, device)
        num_blocks = num_blocks_for(checkpoint.model_config, cache_config, dtype, device)
        pool = KVPool(
            checkpoint.model_config, num_blocks, cache_config.block_size, dtype, device
        )
        runner = cls(model, pool, backend, device)
        runner.load_seconds = time.perf_counter() - started
        return runner

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        for seq_id in step.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new_seq in step.new_seqs:
            self._add_seq(new_seq)
        for update in step.block_updates:
            table = self.seqs[update.seq_id].block_table
            table[update.start : update.start + len(update.block_ids)] = update.block_ids
        self.pool.copy_blocks(self.backend, [(int(s), int(d)) for s, d in step.block_copies])
        if not step.chunks:
            return StepOutput(step_id=step.step_id, samples=[])

        seq_chunks = []
        for chunk in step.chunks:
            state = self.seqs[chunk.seq_id]
            assert chunk.start_pos == len(state.history), (
                f"seq {chunk.seq_id}: chunk starts at {chunk.start_pos}, "
                f"worker history has {len(state.history)} tokens"
            )
            state.history.extend(chunk.token_ids)
            store_from = chunk.start_pos if chunk.store_from is None else chunk.store_from
            seq_chunks.append(
                SeqChunk(chunk.token_ids, chunk.start_pos, state.block_table, store_from)
            )
        inputs = build_model_inputs(
            seq_chunks, self.pool.block_size, self.device, self.pool.scratch_block
        )
        hidden = self.model(inputs.input_ids, inputs.positions, self.pool.kv_cache, inputs.meta)
        prompt_logprobs = [
            self._prompt_logprobs(chunk, hidden, int(inputs.last_token_rows[i]))
            for i, chunk in enumerate(step.chunks)
            if chunk.logprob_targets
        ]

        # (chunk index, seq id) per sampled row; fanout streams reuse their leader's row.
        sampled: list[tuple[int, int]] = []
        for i, chunk in enumerate(step.chunks):
            if chunk.sample:
                sampled.append((i, chunk.seq_id))
                sampled.extend((i, seq_id) for seq_id in chunk.fanout_seq_ids)
        if not sampled:
            return StepOutput(step_id=step.step_id, samples=[], prompt_logprobs=prompt_logprobs)
        rows = inputs.last_token_rows[[i for i, _ in sampled]]
        logits = self.model.compute_logits(hidden[rows])
        states = [self.seqs[seq_id] for _, seq_id in sampled]
        out = self.sampler(
            logits,
            [s.spec for s in states],
            [s.history for s in states],
            [s.num_prompt_tokens for s in states],
        )
        samples = [
            Sample(
                seq_id=seq_id,
                token_id=out.token_ids[row],
                logprob=out.logprobs[row],
                top_token_ids=out.top_token_ids[row],
                top_logprobs=out.top_logprobs[row],
            )
            for row, (_, seq_id) in enumerate(sampled)
        ]
        return StepOutput(step_id=step.step_id, samples=samples, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, chunk: Chunk, hidden: torch.Tensor, last_row: int) -> PromptLogprobs:
        """Logprobs of the next prompt tokens at the chunk's first positions, in slices so
        a long prompt never holds (prompt_len, vocab) logits at once."""
        first_row = last_row - len(chunk.token_ids) + 1
        targets = torch.tensor(chunk.logprob_targets, dtype=torch.int64, device=self.device)
        k = chunk.num_top_logprobs
        logprobs: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            rows = slice(first_row + start, first_row + min(start + PROMPT_LOGPROB_ROWS,
                                                             len(targets)))
            lp = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            chosen = targets[start : start + lp.shape[0]]
            logprobs += lp.gather(1, chosen[:, None]).squeeze(1).tolist()
            if k > 0:
                values, ids = lp.topk(k, dim=-1)
                top_ids += ids.tolist()
                top_lps += values.tolist()
            else:
                top_ids += [[] for _ in range(lp.shape[0])]
                top_lps += [[] for _ in range(lp.shape[0])]
        return PromptLogprobs(chunk.seq_id, logprobs, top_ids, top_lps)

    def _add_seq(self, new_seq: NewSeq) -> None:
        assert new_seq.seq_id not in self.seqs, f"seq {new_seq.seq_id} sent twice"
        self.seqs[new_seq.seq_id] = SeqState(
            block_table=list(new_seq.block_ids),
            history=list(new_seq.token_ids),
            num_prompt_tokens=new_seq.num_prompt_tokens,
            spec=new_seq.spec,
        )


def load_model(
    checkpoint: Checkpoint, backend: AttentionBackend, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    model = LlamaForCausalLM.empty(checkpoint.model_config, backend, device)
    model.load_weights(
        ((name, t.to(device)) for name, t in load_weights(checkpoint, dtype)), dtype
    )
    return model.eval()
