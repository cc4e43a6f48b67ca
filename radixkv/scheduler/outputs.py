"""What the front hears about a request after a step: token deltas, or the final result."""

from __future__ import annotations

from radixkv.ipc.protocol import RequestOutput, SeqOutput
from radixkv.scheduler.request import Request, Sequence


def build_output(request: Request, final: bool) -> RequestOutput | None:
    """Streaming requests report each sequence's new tokens; best_of and beam search
    requests report once, at the end, with their chosen sequences in rank order.
    Returns None when there is nothing new to say."""
    if request.error is not None:
        return _message(request, [], finished=True)
    if request.beam is not None:
        if not final:
            return None
        seqs = [
            SeqOutput(
                index=rank,
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cumulative_logprob,
                finish_reason=hyp.finish_reason,
                score=hyp.score,
            )
            for rank, hyp in enumerate(request.beam.results())
        ] if request.admitted and not _aborted(request) else []
        return _message(request, seqs, finished=True)
    if not request.streams:
        if not final:
            return None
        assert request.sampling is not None
        params = request.sampling
        ranked = sorted(request.seqs, key=lambda s: -s.cumulative_logprob)[: params.n]
        deltas = [
            _delta(seq, rank, 0, params.logprobs is not None) for rank, seq in enumerate(ranked)
        ]
        return _message(request, deltas, finished=True)
    want_logprobs = request.sampling is not None and request.sampling.logprobs is not None
    deltas = [
        _delta(seq, seq.index, seq.num_reported, want_logprobs)
        for seq in request.seqs
        if final or seq.num_output_tokens > seq.num_reported
    ]
    if not deltas and not final:
        return None
    return _message(request, deltas, finished=final)


def _delta(seq: Sequence, index: int, start: int, want_logprobs: bool) -> SeqOutput:
    end = seq.num_output_tokens
    seq.num_reported = end
    return SeqOutput(
        index=index,
        token_ids=seq.output_token_ids[start:end],
        logprobs=seq.logprobs[start:end] if want_logprobs else None,
        top_logprobs=seq.top_logprobs[start:end] if want_logprobs else None,
        cumulative_logprob=seq.cumulative_logprob,
        finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
    )


def _aborted(request: Request) -> bool:
    return any(s.finish_reason is not None and s.finish_reason.value == "abort"
               for s in request.seqs)


def _message(request: Request, seqs: list[SeqOutput], finished: bool) -> RequestOutput:
    prompt_logprobs = prompt_top = None
    wanted = request.sampling is not None and request.sampling.prompt_logprobs is not None
    if wanted and not request.prompt_logprobs_reported and (
        request.num_prompt_logprobs_missing == 0
    ):
        request.prompt_logprobs_reported = True
        prompt_logprobs = request.prompt_logprobs
        prompt_top = request.prompt_top_logprobs
    return RequestOutput(
        request_id=request.request_id,
        seqs=seqs,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=request.num_cached_tokens,
        finished=finished,
        error=request.error,
        prompt_logprobs=prompt_logprobs,
        prompt_top_logprobs=prompt_top,
    )
