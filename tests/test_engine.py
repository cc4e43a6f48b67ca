"""The offline LLM through real processes: SmolLM2 against transformers, cache hits through
the API, errors that keep the engine serving, and process lifetime (worker death, parent
death)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv import LLM, BeamSearchParams, SamplingParams
from radixkv.engine_handle import EngineError
from tests.worker.test_llama import _oracle_greedy

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 12 times 12?",
    "Say hello in Spanish.",
    "Name a planet in the solar system.",
    "What does a cat say?",
    "Give me one word that rhymes with tree.",
]
SYSTEM = (
    "You are a concise assistant for a company that builds inference engines. You answer in "
    "one sentence, never use lists, and always mention that the KV cache is shared between "
    "requests when it is relevant."
)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LLM]:
    with LLM(kv_cache_tokens=16384, max_num_seqs=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


def _assert_released(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_referenced_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    assert stats.num_running_requests == 0 and stats.num_waiting_requests == 0


def test_greedy_chat_equals_transformers(smollm2: LLM, hf_smollm2: Any) -> None:
    conversations = [[{"role": "user", "content": text}] for text in CHATS]
    results = smollm2.chat(conversations, SamplingParams(temperature=0.0, max_tokens=32))
    for conversation, result in zip(conversations, results, strict=True):
        prompt = smollm2.tokenizer.encode_chat(conversation)
        assert result.prompt_token_ids == prompt
        ours = result.outputs[0].token_ids
        expected, margins = _oracle_greedy(hf_smollm2, prompt, len(ours))
        if ours != expected:
            step = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b)
            assert margins[step] < 1e-3, f"diverged at {step}: {ours} vs {expected}"
        if result.outputs[0].finish_reason == "stop":
            assert ours[-1] in smollm2.eos_token_ids
        else:
            assert len(ours) == 32
        assert result.outputs[0].text == smollm2.tokenizer.decode(ours)
    assert "Paris" in results[0].outputs[0].text
    _assert_released(smollm2)


def test_shared_system_prompt_is_a_cache_hit_and_changes_nothing(smollm2: LLM) -> None:
    def chat(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    params = SamplingParams(temperature=0.0, max_tokens=12)
    first = smollm2.chat(chat("What is paging?"), params)[0]
    second = smollm2.chat(chat("What is a radix tree?"), params)[0]
    system_len = len(smollm2.tokenizer.encode_chat(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    assert second.num_cached_tokens >= system_len
    again = smollm2.chat(chat("What is paging?"), params, cache_salt="tenant-b")[0]
    assert again.num_cached_tokens == 0, "another salt never hits"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    repeat = smollm2.chat(chat("What is paging?"), params)[0]
    assert repeat.num_cached_tokens == len(repeat.prompt_token_ids) - 1
    assert repeat.outputs[0].token_ids == first.outputs[0].token_ids
    _assert_released(smollm2)


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"), [(2, 1.0, True), (4, 0.7, False)]
)
def test_beam_search_equals_transformers(
    smollm2: LLM, hf_smollm2: Any, width: int, length_penalty: float, early_stopping: bool
) -> None:
    conversation = [{"role": "user", "content": "Describe the moon in a few words."}]
    prompt = smollm2.tokenizer.encode_chat(conversation)
    params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    result = smollm2.beam_search([prompt], params)[0]
    with torch.no_grad():
        expected = hf_smollm2.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=12,
            length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=2,
            pad_token_id=2, output_scores=True, return_dict_in_generate=True,
        )
    want = []
    for row in expected.sequences:
        tokens = row[len(prompt):].tolist()
        want.append(tokens[: tokens.index(2) + 1] if 2 in tokens else tokens)
    assert [o.token_ids for o in result.outputs] == want
    torch.testing.assert_close(
        torch.tensor([o.score for o in result.outputs], dtype=torch.float32),
        expected.sequences_scores.float(), atol=1e-3, rtol=1e-4,
    )
    _assert_released(smollm2)


def test_bad_requests_raise_and_the_engine_keeps_serving(smollm2: LLM) -> None:
    with pytest.raises(ValueError, match="context length"):
        smollm2.generate([1] * 8190, SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm2.generate([[1, 2, 10**6]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="at most 16 sequences"):
        smollm2.generate("Hi", SamplingParams(n=17, max_tokens=2))
    result = smollm2.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4))
    assert len(result[0].outputs[0].token_ids) == 4


def test_stop_strings_cut_the_text_and_end_the_request(smollm2: LLM) -> None:
    free = smollm2.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=16))[0]
    text = free.outputs[0].text
    assert " 6" in text
    stopped = smollm2.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=16, stop=[" 6"])
    )[0]
    assert stopped.outputs[0].text == text[: text.index(" 6")]
    assert stopped.outputs[0].finish_reason == "stop"
    _assert_released(smollm2)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def test_the_scheduler_process_does_not_load_torch(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), kv_cache_tokens=1024) as llm:
        assert llm._engine is not None
        scheduler_pid = llm._engine.proc.pid
        maps = Path(f"/proc/{scheduler_pid}/maps").read_text()
        assert "libtorch" not in maps
        (worker_pid,) = _children(scheduler_pid)
        assert "libtorch" in Path(f"/proc/{worker_pid}/maps").read_text()
    assert "torch" not in _front_modules()


def _front_modules() -> str:
    """Modules the front process needs: importing the offline API must not import torch."""
    code = "import sys, radixkv.engine; print(' '.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout


def test_a_dead_worker_fails_generate_quickly(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), kv_cache_tokens=4096)
    try:
        assert llm._engine is not None
        (worker_pid,) = _children(llm._engine.proc.pid)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        killer = subprocess.Popen(
            [sys.executable, "-c", f"import os, time; time.sleep(1.0); os.kill({worker_pid}, 9)"]
        )
        started = time.monotonic()
        with pytest.raises(EngineError, match="worker"):
            llm.generate(["hello"] * 64, params, use_tqdm=False)
            llm.generate(["hello"] * 64, params, use_tqdm=False)  # in case the first finished
        assert time.monotonic() - started < 12
        killer.wait()
        with pytest.raises(EngineError):
            llm.generate("again", SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def test_no_engine_process_outlives_its_parent(tiny_llama_dir: Path) -> None:
    code = (
        "import sys, time\n"
        "from radixkv import LLM\n"
        f"llm = LLM({str(tiny_llama_dir)!r}, kv_cache_tokens=1024)\n"
        "print(llm._engine.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert front.stdout is not None
    scheduler_pid = int(front.stdout.readline())
    (worker_pid,) = _children(scheduler_pid)
    os.kill(front.pid, signal.SIGKILL)
    front.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_alive(scheduler_pid) or _alive(worker_pid)):
        time.sleep(0.1)
    assert not _alive(scheduler_pid) and not _alive(worker_pid)


def test_prompt_logprobs_equal_transformers_cached_or_not(smollm2: LLM, hf_smollm2: Any) -> None:
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Which tokens are cached?"}]
    prompt = smollm2.tokenizer.encode_chat(conversation)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_smollm2(torch.tensor([prompt])).logits[0].float(), -1)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    for attempt in range(2):  # the second run finds the whole prompt cached
        result = smollm2.generate([prompt], params)[0]
        if attempt == 1:
            assert result.num_cached_tokens == len(prompt) - 1
        entries = result.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            assert entry is not None
            token = prompt[position]
            expected = float(logprobs[position - 1, token])
            assert abs(entry[token] - expected) < 2e-3
            top2 = logprobs[position - 1].topk(2).values.tolist()
            ours = sorted(entry.values(), reverse=True)[:2]
            assert all(abs(a - b) < 2e-3 for a, b in zip(ours, top2, strict=True))
    _assert_released(smollm2)


@pytest.mark.parametrize("chat", [False, True])
def test_the_generate_command_prints_only_the_engines_text(smollm2: LLM, chat: bool) -> None:
    """`radixkv generate` with the default model: stdout is the greedy completion the offline
    API gives for the same prompt, and nothing else."""
    prompt = "The capital of France is"
    command = [sys.executable, "-m", "radixkv.cli", "generate", "--prompt", prompt,
               "--max-tokens", "8", "--kv-cache-tokens", "4096"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    if chat:
        command.append("--chat")
        expected = smollm2.chat([{"role": "user", "content": prompt}], params)
    else:
        expected = smollm2.generate(prompt, params)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == expected[0].outputs[0].text + "\n"
    assert expected[0].outputs[0].text.strip()  # something was generated
