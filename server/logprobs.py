"""Token logprobs in the two OpenAI formats.

Completions (legacy): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a dict
token -> logprob holding the top alternatives and the chosen token), `text_offset` (the
character where each token starts in the choice's text). Chat: `content`, a list of
`{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.

A token that is not whole UTF-8 on its own (half of a multi-byte character) is spelled
`bytes:\\xe6\\x97` as OpenAI does; its exact bytes are in `bytes`.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from radixkv.output_processor import TextDelta
from radixkv.server.openai_types import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from radixkv.tokenizer import Tokenizer

# JSON has no -inf; a token the sampler ruled out gets this instead.
_FLOOR = -9999.0


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    raw = tokenizer.token_to_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class CompletionLogprobsBuilder:
    """Builds one choice's legacy logprobs piece by piece (streaming sends each piece)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def prompt(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, float] | None]
    ) -> CompletionLogprobs:
        """Echoed prompt tokens; `logprobs[i]` maps token ids to logprobs (the token itself
        and its top alternatives), None for the first token, which nothing predicts."""
        part = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            text = token_text(self._tokenizer, token_id)
            part.tokens.append(text)
            if entry is None:
                part.token_logprobs.append(None)
                part.top_logprobs.append(None)
            else:
                part.token_logprobs.append(finite(entry[token_id]))
                part.top_logprobs.append(
                    {token_text(self._tokenizer, t): finite(lp) for t, lp in entry.items()}
                )
            part.text_offset.append(self._advance(token_id))
        return part

    def generated(self, delta: TextDelta) -> CompletionLogprobs:
        part = CompletionLogprobs()
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        triples = zip(delta.token_ids, delta.logprobs or [], tops, strict=False)
        for token_id, logprob, top in triples:
            text = token_text(self._tokenizer, token_id)
            part.tokens.append(text)
            part.token_logprobs.append(finite(logprob))
            alternatives = {token_text(self._tokenizer, t): finite(lp) for t, lp in top}
            alternatives[text] = finite(logprob)
            part.top_logprobs.append(alternatives)
            part.text_offset.append(self._advance(token_id))
        return part

    def _advance(self, token_id: int) -> int:
        """The offset of this token, then move past the characters it completes."""
        start = self._offset
        self._offset += len(self._utf8.decode(self._tokenizer.token_to_bytes(token_id)))
        return start


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    whole = CompletionLogprobs()
    for part in parts:
        whole.tokens.extend(part.tokens)
        whole.token_logprobs.extend(part.token_logprobs)
        whole.top_logprobs.extend(part.top_logprobs)
        whole.text_offset.extend(part.text_offset)
    return whole


def chat_logprobs(
    tokenizer: Tokenizer, delta: TextDelta, num_top: int
) -> list[ChatTokenLogprob]:
    tops = delta.top_logprobs or [[] for _ in delta.token_ids]
    entries = []
    for token_id, logprob, top in zip(delta.token_ids, delta.logprobs or [], tops, strict=False):
        entries.append(
            ChatTokenLogprob(
                token=token_text(tokenizer, token_id),
                logprob=finite(logprob),
                bytes=list(tokenizer.token_to_bytes(token_id)),
                top_logprobs=[
                    TopLogprob(
                        token=token_text(tokenizer, t),
                        logprob=finite(lp),
                        bytes=list(tokenizer.token_to_bytes(t)),
                    )
                    for t, lp in top[:num_top]
                ],
            )
        )
    return entries
