"""Tokenizer, chat template and incremental detokenizer. Torch-free: the front process uses it.

A Hugging Face directory brings its own tokenizer.json. A GGUF file only lists tokens, merges and
token types in its metadata, so we build the same byte-level BPE from them, with the
pre-tokenizer that `tokenizer.ggml.pre` names (the regex the vocabulary was trained with).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from radixkv.checkpoint import Checkpoint, CheckpointError, read_gguf


class ChatTemplateError(Exception):
    """The checkpoint has no chat template, or its template refused or failed on the messages."""


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    `encode` adds BOS only when the checkpoint asks for it; special tokens written in the text
    (`<|im_start|>`) encode to their single id. `decode` never cleans up spaces, so incremental
    decoding can reproduce it exactly.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        template_tokens: dict[str, str],
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # bos_token, eos_token, ...: the strings chat templates may write.
        self._template_tokens = template_tokens
        self._byte_level = "ByteLevel" in repr(backend.decoder)
        self._added_tokens = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> Tokenizer:
        """The tokenizer of `ckpt`; CheckpointError if a GGUF describes one we cannot build."""
        if ckpt.kind == "hf":
            return _from_hf_dir(ckpt)
        return _from_gguf(ckpt)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS/EOS where the checkpoint says to.

        Who says: tokenizer.json's post-processor, or the GGUF's tokenizer.ggml.add_bos_token
        and add_eos_token.
        """
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Vocabulary spellings (`Ġworld`); "" for an id outside the vocabulary."""
        return [self._backend.id_to_token(i) or "" for i in token_ids]

    def token_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (for logprobs); b"" for an unknown id."""
        if token_id in self._added_tokens:
            return self._added_tokens[token_id].encode()
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level:
            return _byte_level_bytes(token)
        if token.startswith("<0x") and token.endswith(">") and len(token) == 6:
            return bytes([int(token[3:5], 16)])  # SentencePiece byte fallback
        return token.replace("\u2581", " ").encode()

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token on its own; a partial UTF-8 character shows as U+FFFD."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the checkpoint's template, like transformers does.

        The template sees `messages` (keys whose value is None dropped), `add_generation_prompt`,
        `bos_token`, `eos_token` (and `unk_token`/`pad_token` when known), `tools` and `documents`
        (None unless given) and any `template_kwargs`. Raises ChatTemplateError when there is no
        template, it calls raise_exception(), or it fails to render.
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                "this checkpoint has no chat template; send plain prompts (completions) instead"
            )
        variables: dict[str, Any] = {"tools": None, "documents": None, **self._template_tokens}
        variables.update(template_kwargs)
        variables["messages"] = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return _compile_template(self.chat_template).render(**variables)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render then encode; the template writes its own BOS, so none is added again."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns output tokens, a few at a time, into text deltas.

    Each `add` decodes a short window, not the whole output:

        ids:  ... | prefix window     | new tokens |
                  ^prefix_offset      ^read_offset
        delta = decode(prefix window + new)[len(decode(prefix window)):]

    A delta is held back while the window's text ends in U+FFFD (a UTF-8 character split across
    tokens), so no delta splits a character; `flush` releases a held tail at the end. For
    byte-level tokenizers the deltas (plus flush) concatenate exactly to decode(output ids).
    The window starts in the last prompt tokens so a first token's leading space survives.
    """

    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-self._PROMPT_CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete ("" while a character is split)."""
        self._token_ids.extend(token_ids)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        return self._emit(window_text[len(prefix_text) :])

    def flush(self) -> str:
        """The held-back tail (it may end in a real U+FFFD); call once the output is finished."""
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text):
            return ""
        return self._emit(window_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        window = self._token_ids[self._prefix_offset :]
        prefix = window[: self._read_offset - self._prefix_offset]
        decode = self._tokenizer.decode
        return (
            decode(prefix, skip_special_tokens=self._skip_special_tokens),
            decode(window, skip_special_tokens=self._skip_special_tokens),
        )

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.text += delta
        return delta


# --- building tokenizers ----------------------------------------------------------------------


def _from_hf_dir(ckpt: Checkpoint) -> Tokenizer:
    backend = BackendTokenizer.from_file(str(ckpt.path / "tokenizer.json"))
    config_file = ckpt.path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    tokens = {
        name: content
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (content := _token_content(config.get(name))) is not None
    }
    bos_id = backend.token_to_id(tokens["bos_token"]) if "bos_token" in tokens else None
    eos_id = backend.token_to_id(tokens["eos_token"]) if "eos_token" in tokens else None
    # tokenizer.json's post-processor alone decides whether BOS/EOS are added, as in
    # transformers 5, which ignores tokenizer_config's add_bos_token once tokenizer.json exists.
    model_config = ckpt.model_config
    return Tokenizer(
        backend,
        bos_token_id=bos_id if bos_id is not None else model_config.bos_token_id,
        eos_token_ids=[*model_config.eos_token_ids, *([eos_id] if eos_id is not None else [])],
        chat_template=ckpt.chat_template,
        template_tokens=tokens,
    )


def _from_gguf(ckpt: Checkpoint) -> Tokenizer:
    metadata = read_gguf(ckpt.path).metadata
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"{ckpt.path.name}: GGUF tokenizer model {model!r} is not supported "
            "(only 'gpt2', byte-level BPE)"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    backend = BackendTokenizer(
        models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_PRE_TOKENIZERS)
    )
    if pre in _QWEN2_PRE_TOKENIZERS:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre, ckpt.path)
    backend.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 = control (<|im_start|>), 4 = user-defined; both match whole.
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == 3
    ])
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == 4
    ])

    def token_of(key: str) -> tuple[str, int] | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None or token_id >= len(tokens):
            return None
        return tokens[token_id], token_id

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    backend.post_processor = _special_tokens_processor(
        bos if metadata.get("tokenizer.ggml.add_bos_token", False) else None,
        eos if metadata.get("tokenizer.ggml.add_eos_token", False) else None,
    )
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    template_tokens = {name: found[0] for name, key in names.items() if (found := token_of(key))}
    return Tokenizer(
        backend,
        bos_token_id=bos[1] if bos else None,
        eos_token_ids=ckpt.model_config.eos_token_ids,
        chat_template=ckpt.chat_template,
        template_tokens=template_tokens,
    )


# The split regexes of the vocabularies llama.cpp names in tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE_TOKENIZERS = frozenset({"default", "gpt2", "gpt-2"})
_LLAMA3_PRE_TOKENIZERS = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe"})
_QWEN2_PRE_TOKENIZERS = frozenset({"qwen2", "deepseek-r1-qwen"})


def _gguf_pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE_TOKENIZERS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM's own tokenizer: each digit alone, then GPT-2's regex.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE_TOKENIZERS else None
    split = _QWEN2_SPLIT if pre in _QWEN2_PRE_TOKENIZERS else split
    if split is None:
        supported = sorted({"smollm", *_GPT2_PRE_TOKENIZERS, *_LLAMA3_PRE_TOKENIZERS,
                            *_QWEN2_PRE_TOKENIZERS})
        raise CheckpointError(
            f"{path.name}: GGUF pre-tokenizer {pre!r} is not supported ({', '.join(supported)})"
        )
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _special_tokens_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """A post-processor adding BOS before / EOS after the text (each when given)."""
    single, special = "$A", []
    if bos is not None:
        single, special = f"{bos[0]} {single}", [bos]
    if eos is not None:
        single, special = f"{single} {eos[0]}", [*special, eos]
    return processors.TemplateProcessing(single=single, special_tokens=special)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: stand-in character -> byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are
    spelled with the characters from U+0100 on, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if byte not in table.values()]
    table.update({chr(256 + i): byte for i, byte in enumerate(others)})
    return table


def _byte_level_bytes(token: str) -> bytes:
    table = _byte_decoder()
    return b"".join(bytes([table[c]]) if c in table else c.encode() for c in token)


@cache
def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox, with the helpers Hugging Face templates call."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template does not parse: {error}") from error
