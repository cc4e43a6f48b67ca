"""Tokenizer and IncrementalDetokenizer, checked against transformers on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from radixkv.checkpoint import Checkpoint, CheckpointError, resolve_checkpoint
from radixkv.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing ones   ",
    "def f(x):\n    return x * 2\n\n\nclass A:\n\tpass\n",
    "12345 and 2024-11-29, 3.14159, 1,000,000 and x86_64",
    "Ünïcödé, Les élèves étudient à l'école, 日本語のテキスト, Здравствуй мир",
    "emoji 🙂🚀 family 👨‍👩‍👧 flags 🇫🇷 and skin 👍🏽",
    "tabs\t\tand\nnewlines\r\n\n   runs of      spaces",
    "it's, don't, I'll, we've, they'RE",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "text<|endoftext|>more text",
    "<repo_name>radixkv<file_sep>tokenizer.py",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "a\ufffdb replacement character",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer in 日本語 🙂"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another."},
    ],
]


@pytest.fixture(scope="session")
def smollm2() -> Tokenizer:
    return Tokenizer.from_checkpoint(resolve_checkpoint(None))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> Any:
    """transformers' tokenizer built from the same GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


# --- agreement with transformers ---------------------------------------------------------------


def assert_same_tokenizer(ours: Tokenizer, theirs: Any) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), text
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids), text


def assert_same_chat_template(ours: Tokenizer, theirs: Any) -> None:
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert text == theirs.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            ids = theirs.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False,
            )
            assert ours.encode_chat(messages, add_generation_prompt) == list(ids)


def test_smollm2_gguf_tokenizer_agrees_with_transformers(
    smollm2: Tokenizer, hf_smollm2: Any
) -> None:
    assert_same_tokenizer(smollm2, hf_smollm2)


def test_smollm2_chat_template_agrees_with_transformers(
    smollm2: Tokenizer, hf_smollm2: Any
) -> None:
    assert_same_chat_template(smollm2, hf_smollm2)


def test_tiny_hf_tokenizer_agrees_with_transformers(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_checkpoint(resolve_checkpoint(tiny_llama_dir))
    theirs = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert_same_tokenizer(ours, theirs)
    assert_same_chat_template(ours, theirs)


def test_gguf_built_tokenizer_equals_the_hf_one(
    tiny_llama_dir: Path, tiny_llama_gguf: Path
) -> None:
    """The same vocabulary stored as GGUF metadata (pre-tokenizer 'gpt2') encodes identically."""
    from_hf = Tokenizer.from_checkpoint(resolve_checkpoint(tiny_llama_dir))
    from_gguf = Tokenizer.from_checkpoint(resolve_checkpoint(tiny_llama_gguf))
    for text in TEXTS:
        assert from_gguf.encode(text) == from_hf.encode(text), text
    messages = CONVERSATIONS[1]
    assert from_gguf.apply_chat_template(messages) == from_hf.apply_chat_template(messages)


# --- SmolLM2 specifics -------------------------------------------------------------------------


def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert (smollm2.vocab_size, smollm2.bos_token_id, smollm2.eos_token_ids) == (49152, 1, (2,))
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    assert smollm2.encode("Hello")[0] != 1  # tokenizer.ggml.add_bos_token is false
    assert smollm2.decode([1, 19556, 2]) == "Hello"
    assert smollm2.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_smollm2_digits_are_split_one_by_one(smollm2: Tokenizer) -> None:
    assert smollm2.convert_ids_to_tokens(smollm2.encode("x 2024")) == ["x", "Ġ", "2", "0", "2", "4"]


def test_token_bytes_and_pieces(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🙂 world")
    assert b"".join(smollm2.token_to_bytes(i) for i in ids) == "🙂 world".encode()
    assert smollm2.token_to_piece(ids[-1]) == " world"
    assert any("\ufffd" in smollm2.token_to_piece(i) for i in ids)  # the emoji spans tokens
    assert smollm2.token_to_bytes(1) == b"<|im_start|>"
    assert smollm2.token_to_bytes(10**6) == b"" and smollm2.convert_ids_to_tokens([10**6]) == [""]


# --- chat templates ----------------------------------------------------------------------------


def tokenizer_with_template(template: str | None, tiny_llama_dir: Path) -> Tokenizer:
    ckpt = resolve_checkpoint(tiny_llama_dir)
    return Tokenizer.from_checkpoint(
        Checkpoint(ckpt.kind, ckpt.path, ckpt.name, ckpt.model_config, template)
    )


def test_generation_prompt_is_appended_only_when_asked(smollm2: Tokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    without = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert smollm2.apply_chat_template(messages, add_generation_prompt=False) == without
    assert smollm2.apply_chat_template(messages) == without + "<|im_start|>assistant\n"


def test_template_sees_special_tokens_and_kwargs(tiny_llama_dir: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{{ tools is none }}{{ extra }}{{ messages[0] | tojson }}"
    )
    tokenizer = tokenizer_with_template(template, tiny_llama_dir)
    messages = [{"role": "user", "content": "é", "name": None}]
    text = tokenizer.apply_chat_template(messages, extra="!")
    assert text == '<|im_start|>é<|im_end|>True!{"role": "user", "content": "é"}'


def test_missing_template_is_a_typed_error(tiny_llama_dir: Path) -> None:
    tokenizer = tokenizer_with_template(None, tiny_llama_dir)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_is_a_typed_error(tiny_llama_dir: Path) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tokenizer = tokenizer_with_template(template, tiny_llama_dir)
    with pytest.raises(ChatTemplateError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_template_syntax_error_is_a_typed_error(tiny_llama_dir: Path) -> None:
    tokenizer = tokenizer_with_template("{% for %}", tiny_llama_dir)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_cannot_escape_the_sandbox(tiny_llama_dir: Path) -> None:
    tokenizer = tokenizer_with_template("{{ ''.__class__.__mro__ }}", tiny_llama_dir)
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


# --- BOS handling ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["tokenizer.json", "tokenizer_config.json"])
def test_hf_bos_agrees_with_transformers(tiny_llama_dir: Path, tmp_path: Path, where: str) -> None:
    """tokenizer.json's post-processor decides; tokenizer_config's add_bos_token is ignored,
    as transformers 5 ignores it whenever tokenizer.json exists."""
    from transformers import AutoTokenizer

    directory = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    data = json.loads((directory / where).read_text())
    if where == "tokenizer.json":
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                "tokens": ["<|im_start|>"]}},
        }
    else:
        data["add_bos_token"] = True
    (directory / where).write_text(json.dumps(data))
    ours = Tokenizer.from_checkpoint(resolve_checkpoint(directory))
    theirs = AutoTokenizer.from_pretrained(directory)
    assert ours.encode("Hello world") == theirs.encode("Hello world")
    adds_bos = where == "tokenizer.json"
    assert (ours.encode("Hello world")[0] == 1) is adds_bos
    assert ours.encode("Hello world", add_special_tokens=False)[0] != 1
    messages = [{"role": "user", "content": "hi"}]
    chat = ours.encode_chat(messages)
    assert chat == list(theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                   return_dict=False))
    assert chat[:2] == [1, ours.encode("user", add_special_tokens=False)[0]]


def gguf_tokenizer_checkpoint(
    write_gguf: Any, path: Path, tiny_llama_gguf: Path, **overrides: Any
) -> Checkpoint:
    """A GGUF holding only the tiny vocabulary's tokenizer metadata, with `overrides`."""
    from radixkv.checkpoint import read_gguf

    metadata = {k: v for k, v in read_gguf(tiny_llama_gguf).metadata.items()
                if k.startswith("tokenizer.")}
    metadata.update(overrides)
    write_gguf(path, "llama", metadata, {})
    template = resolve_checkpoint(tiny_llama_gguf)
    return Checkpoint("gguf", path, path.stem, template.model_config, None)


def test_gguf_add_bos_token(write_gguf: Any, tmp_path: Path, tiny_llama_gguf: Path) -> None:
    ckpt = gguf_tokenizer_checkpoint(write_gguf, tmp_path / "bos.gguf", tiny_llama_gguf,
                                     **{"tokenizer.ggml.add_bos_token": True})
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    plain = tokenizer.encode("Hello", add_special_tokens=False)
    assert tokenizer.encode("Hello") == [1, *plain]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tokenizer.ggml.pre", "falcon", "GGUF pre-tokenizer 'falcon' is not supported"),
        ("tokenizer.ggml.model", "llama", "GGUF tokenizer model 'llama' is not supported"),
    ],
)
def test_unsupported_gguf_tokenizer(
    write_gguf: Any, tmp_path: Path, tiny_llama_gguf: Path, key: str, value: str, message: str
) -> None:
    ckpt = gguf_tokenizer_checkpoint(write_gguf, tmp_path / "t.gguf", tiny_llama_gguf,
                                     **{key: value})
    with pytest.raises(CheckpointError, match=message):
        Tokenizer.from_checkpoint(ckpt)


# --- incremental detokenizer -------------------------------------------------------------------

DETOKENIZER_TEXTS = [
    "日本語のテキスト 🙂🚀 👨‍👩‍👧 Ünïcödé €100 — ok",
    "emoji at the end 🇫🇷",
    "🦀",
    "<|im_start|>assistant\nSure 👍🏽<|im_end|>\n<|endoftext|>",
    "plain ascii, several words, nothing split",
    "a\ufffdb: the text really has U+FFFD",
]


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    deltas = [detokenizer.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_decode(
    smollm2: Tokenizer, skip_special_tokens: bool, chunk: int
) -> None:
    for text in DETOKENIZER_TEXTS:
        ids = smollm2.encode(text)
        detokenizer = IncrementalDetokenizer(smollm2, skip_special_tokens=skip_special_tokens)
        deltas = stream(detokenizer, ids, chunk)
        full = smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detokenizer.text == full, text
        if "\ufffd" not in text:
            assert not any("\ufffd" in delta for delta in deltas), (text, deltas)


def test_split_character_is_held_back_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🦀")
    assert len(ids) == 3 and "\ufffd" in smollm2.decode(ids[:2])
    detokenizer = IncrementalDetokenizer(smollm2)
    assert [detokenizer.add([i]) for i in ids] == ["", "", "🦀"]


def test_a_real_trailing_replacement_character_comes_out_on_flush(smollm2: Tokenizer) -> None:
    crab = smollm2.encode("🦀")  # three tokens, the first two partial
    ids = smollm2.encode("ok ") + crab[:2]  # ends inside the emoji, for good
    detokenizer = IncrementalDetokenizer(smollm2)
    assert "".join(detokenizer.add([i]) for i in ids) == "ok "
    assert detokenizer.flush() == smollm2.decode(ids)[len("ok ") :]
    assert detokenizer.text == smollm2.decode(ids)


def test_prompt_context_does_not_leak_into_the_output(smollm2: Tokenizer) -> None:
    prompt_ids = smollm2.encode("<|im_start|>user\nSay hi 🙂<|im_end|>\n<|im_start|>assistant\n")
    output_ids = smollm2.encode(" Hi there 👋!")
    detokenizer = IncrementalDetokenizer(smollm2, prompt_ids, skip_special_tokens=False)
    deltas = stream(detokenizer, output_ids, 1)
    expected = smollm2.decode(output_ids, skip_special_tokens=False)
    assert "".join(deltas) == expected == " Hi there 👋!"


def test_each_step_decodes_a_short_window(
    smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = smollm2.encode("word 🦀 " * 200)
    lengths: list[int] = []
    decode = smollm2.decode

    def counting_decode(token_ids: Any, skip_special_tokens: bool = True) -> str:
        lengths.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    detokenizer = IncrementalDetokenizer(smollm2, ids[:50])
    monkeypatch.setattr(smollm2, "decode", counting_decode)
    for token_id in ids:
        detokenizer.add([token_id])
    monkeypatch.undo()
    assert len(ids) > 600 and max(lengths) <= 8
    assert detokenizer.text == smollm2.decode(ids)
