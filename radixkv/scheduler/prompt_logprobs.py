"""Prompt logprobs (`prompt_logprobs=k`): asking the worker for them chunk by chunk, and
collecting what it computed."""

from __future__ import annotations

from typing import Any

from radixkv.ipc.protocol import PromptLogprobs
from radixkv.scheduler.request import Request, Sequence


def prompt_logprob_targets(
    request: Request, seq: Sequence, start: int, num_tokens: int
) -> dict[str, Any]:
    """Chunk fields asking for the logprobs of the prompt tokens after this chunk's
    positions (position p predicts prompt token p + 1)."""
    last_prompt_pos = len(request.prompt_token_ids) - 1
    if seq.index != 0 or request.num_prompt_logprobs_missing == 0 or start >= last_prompt_pos:
        return {}
    end = min(start + num_tokens, last_prompt_pos)
    assert request.sampling is not None and request.sampling.prompt_logprobs is not None
    return {
        "logprob_targets": request.prompt_token_ids[start + 1 : end + 1],
        "num_top_logprobs": request.sampling.prompt_logprobs,
    }


def collect_prompt_logprobs(request: Request, start: int, computed: PromptLogprobs) -> None:
    """Append what a chunk starting at `start` computed, skipping positions already known
    (a readmission may recompute a few)."""
    skip = len(request.prompt_logprobs) - start
    assert skip >= 0, "prompt logprobs must arrive in order"
    request.prompt_logprobs += computed.logprobs[skip:]
    request.prompt_top_logprobs += [
        list(zip(ids, lps, strict=True))
        for ids, lps in zip(computed.top_token_ids[skip:], computed.top_logprobs[skip:],
                            strict=True)
    ]
