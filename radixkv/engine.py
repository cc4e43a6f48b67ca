"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, like vLLM.

The LLM object lives in the user's process; it tokenizes, starts the scheduler process (which
starts the worker), streams requests in and folds outputs back into text. It never imports
torch.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from radixkv.checkpoint import resolve_checkpoint
from radixkv.config import EngineConfig
from radixkv.engine_handle import EngineError, EngineHandle
from radixkv.ipc.protocol import (
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineStats,
    StatsRequest,
    StepOutputs,
)
from radixkv.output_processor import RequestTracker
from radixkv.outputs import RequestResult
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]
Job = tuple[str | None, list[int], SamplingParams | None]  # prompt text, token ids, params

_request_counter = itertools.count()


class LLM:
    """An engine in background processes, driven synchronously from this one."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        """`engine_options` are those of `EngineConfig.from_options` (block_size,
        kv_cache_tokens, enable_prefix_caching, max_num_seqs, ...), with its defaults."""
        self.checkpoint = resolve_checkpoint(model)
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint)
        self.config = EngineConfig.from_options(str(self.checkpoint.path), **engine_options)
        eos = set(self.checkpoint.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self._engine: EngineHandle | None = EngineHandle(self.config)
        self.max_model_len = self._engine.ready.max_model_len
        self.num_blocks = self._engine.ready.num_blocks

    # ----------------------------------------------------------------------------- API

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestResult]:
        """Complete each prompt (text or token ids); results come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list))
        jobs: list[Job] = [
            (*self._tokenize(prompt), params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        return self._run(jobs, None, use_tqdm, cache_salt)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestResult]:
        """One conversation (a list of messages) or several, through the chat template."""
        conversations: list[list[Message]]
        if messages and isinstance(messages[0], dict):
            conversations = [list(messages)]  # type: ignore[arg-type]
        else:
            conversations = [list(c) for c in messages]  # type: ignore[arg-type]
        params_list = _broadcast(sampling_params or SamplingParams(), len(conversations))
        jobs: list[Job] = []
        for conversation, params in zip(conversations, params_list, strict=True):
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
            jobs.append((text, self.tokenizer.encode_chat(conversation), params))
        return self._run(jobs, None, use_tqdm, cache_salt)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestResult]:
        """Beam search inside the engine; each result holds `beam_width` outputs, best first."""
        jobs: list[Job] = [(*self._tokenize(p), None) for p in _as_prompt_list(prompts)]
        return self._run(jobs, params, use_tqdm, cache_salt)

    def stats(self, timeout_s: float = 10.0) -> EngineStats:
        """A fresh snapshot of the scheduler and KV cache counters."""
        engine = self._require_engine()
        token = next(_request_counter)
        engine.send(StatsRequest(token=token))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = engine.recv(0.1)
            if isinstance(message, EngineFailure):
                raise EngineError(message.message)
            if isinstance(message, StepOutputs) and message.stats_token == token:
                assert message.stats is not None
                return message.stats
        raise EngineError("the engine did not answer a stats request")

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    # ------------------------------------------------------------------------ internals

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, _check_token_ids(prompt, self.checkpoint.model_config.vocab_size)

    def _require_engine(self) -> EngineHandle:
        if self._engine is None:
            raise EngineError("this LLM has been shut down")
        return self._engine

    def _run(
        self,
        jobs: list[Job],
        beam: BeamSearchParams | None,
        use_tqdm: bool,
        salt: str | None,
    ) -> list[RequestResult]:
        engine = self._require_engine()
        trackers: dict[str, RequestTracker] = {}
        order: list[str] = []
        for prompt_text, token_ids, params in jobs:
            max_tokens = beam.max_tokens if beam is not None else params.max_tokens  # type: ignore[union-attr]
            if len(token_ids) + max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt of {len(token_ids)} tokens plus max_tokens={max_tokens} exceeds "
                    f"the context length of {self.max_model_len}"
                )
            request_id = f"offline-{next(_request_counter)}"
            trackers[request_id] = RequestTracker(
                request_id, self.tokenizer, token_ids, params, self.eos_token_ids, prompt_text
            )
            order.append(request_id)
        for request_id, (_, token_ids, params) in zip(order, jobs, strict=True):
            engine.send(
                AddRequest(
                    request_id=request_id, prompt_token_ids=token_ids, sampling=params,
                    beam=beam, salt=salt, eos_token_ids=self.eos_token_ids,
                )
            )
        pending = set(order)
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm or len(order) < 2)
        try:
            while pending:
                message = engine.recv(0.5)
                if message is None:
                    continue
                if isinstance(message, EngineFailure):
                    raise EngineError(message.message)
                if not isinstance(message, StepOutputs):
                    continue
                for out in message.outputs:
                    tracker = trackers.get(out.request_id)
                    if tracker is None or out.request_id not in pending:
                        continue
                    tracker.apply(out)
                    if tracker.error is not None:
                        if tracker.error_rejected:  # the request cannot run on this engine
                            raise ValueError(tracker.error)
                        raise EngineError(f"request failed: {tracker.error}")
                    if tracker.needs_abort:
                        engine.send(AbortRequest(out.request_id))
                        tracker.finished = True
                    if tracker.finished:
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            # Best effort: the engine may be going down, and the error that got us here
            # is the one to report.
            with contextlib.suppress(EngineError):
                for request_id in pending:
                    engine.send(AbortRequest(request_id))
            raise
        finally:
            bar.close()
        return [trackers[request_id].result() for request_id in order]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _broadcast(params: Any, count: int) -> list[Any]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _check_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    if not token_ids:
        raise ValueError("a prompt must have at least one token")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"token id {token!r} is outside the vocabulary (0..{vocab_size - 1})")
    return list(token_ids)
