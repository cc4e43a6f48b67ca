"""The two logprobs formats, on the tiny tokenizer (byte-level BPE)."""

from __future__ import annotations

from pathlib import Path

from radixkv.checkpoint import resolve_checkpoint
from radixkv.output_processor import TextDelta
from radixkv.server.logprobs import CompletionLogprobsBuilder, chat_logprobs, token_text
from radixkv.tokenizer import Tokenizer


def delta(token_ids: list[int]) -> TextDelta:
    return TextDelta(
        index=0, text="", token_ids=token_ids,
        logprobs=[-1.0 - i for i in range(len(token_ids))],
        top_logprobs=[[(t, -0.5), (0, float("-inf"))] for t in token_ids],
        finish_reason=None,
    )


def test_offsets_count_characters_across_split_bytes(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_checkpoint(resolve_checkpoint(tiny_llama_dir))
    text = "ab 🙂 c"
    ids = tokenizer.encode(text)
    builder = CompletionLogprobsBuilder(tokenizer)
    part = builder.generated(delta(ids))
    # The emoji's four bytes are split over tokens no single one of which is UTF-8.
    assert any(t.startswith("bytes:\\x") for t in part.tokens)
    ends = [*part.text_offset[1:], len(text)]
    pieces = [text[start:end] for start, end in zip(part.text_offset, ends, strict=True)]
    assert "".join(pieces) == text
    assert part.token_logprobs == [-1.0 - i for i in range(len(ids))]
    clamped = [lp for top in part.top_logprobs if top for lp in top.values() if lp < -1000]
    assert clamped and set(clamped) == {-9999.0}  # -inf is clamped for JSON
    # Echoed prompt tokens: the first has null logprobs (nothing predicts it), the others
    # carry their own logprob and top alternatives; a later piece continues the offsets.
    echo = CompletionLogprobsBuilder(tokenizer)
    entries = [None] + [{t: -2.0, 0: -3.0} for t in ids[1:]]
    prompt = echo.prompt(ids, entries)
    assert prompt.token_logprobs == [None] + [-2.0] * (len(ids) - 1)
    assert prompt.top_logprobs[0] is None
    assert len(prompt.top_logprobs[1]) == (1 if ids[1] == 0 else 2)  # the token and id 0
    assert prompt.text_offset == part.text_offset
    assert echo.generated(delta(ids[:1])).text_offset == [len(text)]


def test_chat_entries_carry_bytes_and_top_n(tiny_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_checkpoint(resolve_checkpoint(tiny_llama_dir))
    ids = tokenizer.encode("Hello")
    entries = chat_logprobs(tokenizer, delta(ids), num_top=1)
    assert [e.token for e in entries] == [token_text(tokenizer, t) for t in ids]
    assert b"".join(bytes(e.bytes or []) for e in entries) == b"Hello"
    assert all(len(e.top_logprobs) == 1 for e in entries)
