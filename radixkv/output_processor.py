"""Front-side output processing: token ids -> text deltas, stop strings, final results.

The scheduler stops sequences on EOS, stop token ids and lengths; stop *strings* live in text,
so the front checks them here and asks the scheduler to abort once every stream has stopped.
While streaming, the last (longest stop string - 1) characters are held back so a client
never sees the beginning of a stop string that is later cut. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixkv.ipc.protocol import RequestOutput, SeqOutput
from radixkv.outputs import CompletionOutput, RequestResult
from radixkv.sampling_params import SamplingParams
from radixkv.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextDelta:
    """What one stream gained from one message: new text, tokens and logprobs."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None


@dataclass
class _Stream:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    raw_text: str = ""
    text: str = ""
    num_emitted: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    score: float | None = None


class RequestTracker:
    """Follows one request's outputs on the front."""

    def __init__(
        self,
        request_id: str,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        eos_token_ids: tuple[int, ...],
        prompt: str | None = None,
    ):
        self.request_id = request_id
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stop_strings = params.stop if params is not None else ()
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        self._silent_ids = frozenset(eos_token_ids) | frozenset(
            params.stop_token_ids if params is not None else ()
        )
        self._skip_special = params.skip_special_tokens if params is not None else True
        self.streams: dict[int, _Stream] = {}
        self.num_cached_tokens = 0
        self.finished = False
        self.error: str | None = None
        self.error_rejected = False
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.aborted_by_stop_string = False

    def apply(self, out: RequestOutput) -> list[TextDelta]:
        """Fold one RequestOutput in; returns the text deltas to stream."""
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_top_logprobs = out.prompt_top_logprobs or []
        if out.error is not None:
            self.error = out.error
            self.error_rejected = out.error_kind == "rejected"
        deltas = [self._apply_seq(seq) for seq in out.seqs]
        if out.finished:
            self.finished = True
        return [d for d in deltas if d is not None]

    @property
    def needs_abort(self) -> bool:
        """Every stream stopped on a stop string while the scheduler may still be running it."""
        return (
            not self.finished
            and bool(self.streams)
            and len(self.streams) == self._num_streams
            and all(s.finish_reason is not None for s in self.streams.values())
        )

    @property
    def _num_streams(self) -> int:
        return self.params.n if self.params is not None else len(self.streams)

    def _apply_seq(self, seq: SeqOutput) -> TextDelta | None:
        stream = self.streams.get(seq.index)
        if stream is None:
            stream = _Stream(
                seq.index,
                IncrementalDetokenizer(
                    self.tokenizer, self.prompt_token_ids, skip_special_tokens=self._skip_special
                ),
            )
            self.streams[seq.index] = stream
        if stream.finish_reason is not None and stream.num_emitted >= len(stream.text):
            return None  # stopped on a stop string: later tokens are not the user's
        start = len(stream.token_ids)
        stream.token_ids.extend(seq.token_ids)
        if seq.logprobs is not None:
            stream.logprobs.extend(seq.logprobs)
        if seq.top_logprobs is not None:
            stream.top_logprobs.extend(
                [[(int(t), float(lp)) for t, lp in entry] for entry in seq.top_logprobs]
            )
        stream.cumulative_logprob = seq.cumulative_logprob
        stream.score = seq.score
        visible = seq.token_ids
        if seq.finish_reason == "stop" and visible and visible[-1] in self._silent_ids:
            visible = visible[:-1]
        stream.raw_text += stream.detokenizer.add(visible)
        if seq.finish_reason is not None:
            stream.raw_text += stream.detokenizer.flush()  # bytes of a cut-off character
        if stream.finish_reason is None:
            self._check_stop_strings(stream, seq.finish_reason)
        return self._emit(stream, start)

    def _check_stop_strings(self, stream: _Stream, finish_reason: str | None) -> None:
        text = stream.raw_text
        if self.stop_strings:
            search_from = max(0, len(stream.text) - self._max_stop_len)
            hits = [
                (pos, stop) for stop in self.stop_strings
                if (pos := text.find(stop, search_from)) != -1
            ]
            if hits:
                pos, stop = min(hits)
                include = self.params is not None and self.params.include_stop_str_in_output
                keep = pos + len(stop) if include else pos
                stream.text = text[:keep]
                stream.finish_reason = "stop"
                return
        stream.text = text
        stream.finish_reason = finish_reason

    def _emit(self, stream: _Stream, token_start: int) -> TextDelta:
        if stream.finish_reason is None:
            upto = max(stream.num_emitted, len(stream.text) - max(self._max_stop_len - 1, 0))
        else:
            upto = len(stream.text)
        new_text = stream.text[stream.num_emitted : upto]
        stream.num_emitted = upto
        want = self.params is not None and self.params.logprobs is not None
        return TextDelta(
            index=stream.index,
            text=new_text,
            token_ids=stream.token_ids[token_start:],
            logprobs=stream.logprobs[token_start:] if want else None,
            top_logprobs=stream.top_logprobs[token_start:] if want else None,
            finish_reason=stream.finish_reason,
        )

    def result(self) -> RequestResult:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                finish_reason=s.finish_reason,
                logprobs=_as_dicts(s) if self.params and self.params.logprobs is not None else None,
                score=s.score,
            )
            for s in sorted(self.streams.values(), key=lambda s: s.index)
        ]
        return RequestResult(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            num_cached_tokens=self.num_cached_tokens,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self._prompt_logprob_dicts(),
        )

    def _prompt_logprob_dicts(self) -> list[dict[int, float] | None] | None:
        if self.prompt_logprobs is None:
            return None
        entries: list[dict[int, float] | None] = [None]
        for i, logprob in enumerate(self.prompt_logprobs):
            entry = {int(t): float(lp) for t, lp in self.prompt_top_logprobs[i]} if (
                i < len(self.prompt_top_logprobs)) else {}
            entry[self.prompt_token_ids[i + 1]] = logprob
            entries.append(entry)
        return entries


def _as_dicts(stream: _Stream) -> list[dict[int, float]]:
    result = []
    for i, token_id in enumerate(stream.token_ids[: len(stream.logprobs)]):
        entry = dict(stream.top_logprobs[i]) if stream.top_logprobs else {}
        entry[token_id] = stream.logprobs[i]
        result.append(entry)
    return result
