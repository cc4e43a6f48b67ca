"""Serving workloads, deterministic given a seed, shared by the benchmark tools.

A workload is a list of *chains*: requests that run in order, each sent once the previous one
has finished (the turns of a conversation, the steps of an agent). Single requests are chains
of one. Every request carries its chat messages and the token ids the model's chat template
gives them, so the HTTP client, the transformers baseline and the KV accounting all see the
same prompts.

    a  chat: G system prompts of L tokens picked with Zipf popularity, a Q-token question each
    b  multi-turn: conversations of T turns; each turn resends the history (earlier questions
       and O-token assistant answers) plus a new Q-token question
    c  agent: one few-shot preamble of about P tokens, a Q-token task, S steps; each step
       resends the previous steps (an O-token action and a Q-token observation)
    d  parallel sampling: unique P-token prompts, n samples each (temperature 1, seeded)
    e  beam search: unique P-token prompts, beam width n (the `use_beam_search` extension)

Lengths are measured with the served model's tokenizer: each piece of text is built from
random words until it has enough tokens, then cut at exactly that many and decoded, so it
re-encodes to the requested length give or take a token at the cut. Answers are always O
tokens: the client asks servers to ignore EOS. The assistant answers resent in (b) and (c) are
synthetic (the workload does not depend on what a server generated), so the history after
each answer is a miss for every system alike.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

WORKLOADS = ("a", "b", "c", "d", "e")
WORKLOAD_NAMES = {
    "a": "shared system prompts",
    "b": "multi-turn chat",
    "c": "agent loop",
    "d": "parallel sampling",
    "e": "beam search",
}

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship "
    "town road arm difference value building action model season society tax director "
    "position player record paper space ground form event official matter center couple site "
    "project activity star table need court oil situation cost industry figure street image "
    "phone data picture practice piece land product doctor wall patient worker news test "
    "movie north love support technology step baby computer type attention film tree source "
    "organization hair window evidence population truth song energy period course bank "
    "cache block prefix token memory engine kernel batch share fork evict page request "
    "clear quick small large early late young important public able bad sure free human "
    "local major political real national best better certain full special easy strong "
    "make take give find tell ask seem feel leave call keep begin show hear play run move "
    "live believe bring happen write provide sit stand lose pay meet include continue set "
    "learn lead understand watch follow stop create speak read allow add spend grow open walk"
)
_WORDS = tuple(_WORD_TEXT.split())


class TextTokenizer(Protocol):
    """What the workloads need of a tokenizer (radixkv.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadConfig:
    """Every workload parameter; each kind reads the ones its docstring line names.

    Defaults are the issue's goal configuration for (a): 8 system prompts of 1,000 tokens,
    64-token questions and answers.
    """

    kind: str = "a"
    num_requests: int = 64
    seed: int = 0
    output_tokens: int = 64  # O
    question_tokens: int = 64  # Q
    num_system_prompts: int = 8  # G (a)
    system_tokens: int = 1000  # L (a)
    zipf_s: float = 1.0  # (a): popularity of prompt k is proportional to 1 / k**s
    turns: int = 4  # T (b)
    preamble_tokens: int = 1500  # P (c)
    agent_steps: int = 3  # S (c)
    prompt_tokens: int = 256  # P (d, e)
    n: int = 4  # samples (d) or beam width (e)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        for name in ("num_requests", "output_tokens", "question_tokens", "num_system_prompts",
                     "system_tokens", "turns", "preamble_tokens", "agent_steps",
                     "prompt_tokens", "n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchRequest:
    """One request: chat messages, the prompt's token ids and how to sample."""

    messages: tuple[dict[str, str], ...]
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1
    use_beam_search: bool = False
    temperature: float = 0.0
    seed: int | None = None

    @property
    def num_sequences(self) -> int:
        return self.n


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    chains: tuple[tuple[BenchRequest, ...], ...]
    # Token counts of the shared pieces as the tokenizer measured them (for the report).
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> list[BenchRequest]:
        return [request for chain in self.chains for request in chain]

    def describe(self) -> dict[str, Any]:
        """Sizes for the report: prompt lengths and the best hit rate any cache could reach."""
        requests = self.requests
        lens = [len(r.prompt_token_ids) for r in requests]
        return {
            "name": WORKLOAD_NAMES[self.config.kind],
            "num_requests": len(requests),
            "num_chains": len(self.chains),
            "num_sequences": sum(r.num_sequences for r in requests),
            "prompt_tokens_mean": sum(lens) / len(lens),
            "prompt_tokens_min": min(lens),
            "prompt_tokens_max": max(lens),
            "ideal_hit_rate": ideal_hit_rate(requests),
            **self.measured,
        }


def build_workload(config: WorkloadConfig, tokenizer: TextTokenizer) -> Workload:
    """The workload `config` describes; the same config and tokenizer give the same ids."""
    builder = {"a": _shared_system_prompts, "b": _multi_turn, "c": _agent_loop,
               "d": _parallel_sampling, "e": _beam_search}[config.kind]
    return builder(config, _Texts(tokenizer, random.Random(config.seed)))


def ideal_hit_rate(requests: Sequence[BenchRequest]) -> float:
    """Share of prompt tokens an unbounded prefix cache could serve, requests arriving in
    order: each prompt's longest common prefix with any earlier prompt, at most its length
    minus one (the last token is always computed), over all prompt tokens."""
    seen: list[tuple[int, ...]] = []
    hit = total = 0
    for request in requests:
        ids = request.prompt_token_ids
        best = max((_common_prefix_len(ids, other) for other in seen), default=0)
        hit += min(best, len(ids) - 1)
        total += len(ids)
        seen.append(ids)
    return hit / total if total else 0.0


def zipf_choices(rng: random.Random, num_items: int, count: int, s: float) -> list[int]:
    """`count` indices in [0, num_items), index k drawn with weight 1 / (k + 1) ** s."""
    weights = [1.0 / (k + 1) ** s for k in range(num_items)]
    return rng.choices(range(num_items), weights=weights, k=count)


# --------------------------------------------------------------------------------- builders


def _shared_system_prompts(config: WorkloadConfig, texts: _Texts) -> Workload:
    systems = [texts.make(config.system_tokens, f"You are assistant number {g}.")
               for g in range(config.num_system_prompts)]
    picks = zipf_choices(texts.rng, config.num_system_prompts, config.num_requests,
                         config.zipf_s)
    chains = []
    for i, g in enumerate(picks):
        question = texts.make(config.question_tokens, f"Question {i}:")
        messages = ({"role": "system", "content": systems[g]},
                    {"role": "user", "content": question})
        chains.append((texts.request(messages, config),))
    measured = {
        "system_prompt_tokens": [texts.count(s) for s in systems],
        "system_prompt_picks": [picks.count(g) for g in range(config.num_system_prompts)],
    }
    return Workload(config, tuple(chains), measured)


def _multi_turn(config: WorkloadConfig, texts: _Texts) -> Workload:
    num_conversations = math.ceil(config.num_requests / config.turns)
    chains = []
    left = config.num_requests
    for c in range(num_conversations):
        history: list[dict[str, str]] = []
        chain = []
        for t in range(min(config.turns, left)):
            history.append({"role": "user",
                            "content": texts.make(config.question_tokens, f"Chat {c} turn {t}:")})
            chain.append(texts.request(tuple(history), config))
            history.append({"role": "assistant", "content": texts.make(config.output_tokens)})
        left -= len(chain)
        chains.append(tuple(chain))
    return Workload(config, tuple(chains))


def _agent_loop(config: WorkloadConfig, texts: _Texts) -> Workload:
    preamble = _few_shot_preamble(config.preamble_tokens, texts)
    num_tasks = math.ceil(config.num_requests / config.agent_steps)
    chains = []
    left = config.num_requests
    for task in range(num_tasks):
        messages = list(preamble)
        messages.append({"role": "user",
                         "content": texts.make(config.question_tokens, f"Task {task}:")})
        chain = []
        for step in range(min(config.agent_steps, left)):
            chain.append(texts.request(tuple(messages), config))
            messages.append({"role": "assistant",
                             "content": texts.make(config.output_tokens, "Action:")})
            messages.append({"role": "user", "content": texts.make(
                config.question_tokens, f"Observation {step}:")})
        left -= len(chain)
        chains.append(tuple(chain))
    measured = {"preamble_tokens": len(texts.tokenizer.encode_chat(
        list(preamble), add_generation_prompt=False))}
    return Workload(config, tuple(chains), measured)


def _few_shot_preamble(num_tokens: int, texts: _Texts) -> list[dict[str, str]]:
    """Instructions (40% of the tokens) and three worked examples (20% each, half task, half
    answer)."""
    messages = [{"role": "system", "content": texts.make(
        max(1, num_tokens * 2 // 5), "You are an agent. Think, then act with one tool.")}]
    example = max(1, num_tokens // 10)
    for k in range(3):
        messages.append({"role": "user", "content": texts.make(example, f"Example task {k}:")})
        messages.append({"role": "assistant", "content": texts.make(example, "Action:")})
    return messages


def _parallel_sampling(config: WorkloadConfig, texts: _Texts) -> Workload:
    chains = []
    for i in range(config.num_requests):
        messages = ({"role": "user", "content": texts.make(config.prompt_tokens, f"Prompt {i}:")},)
        request = texts.request(messages, config)
        chains.append((replace(request, n=config.n, temperature=1.0,
                               seed=config.seed * 1_000_003 + i),))
    return Workload(config, tuple(chains))


def _beam_search(config: WorkloadConfig, texts: _Texts) -> Workload:
    chains = []
    for i in range(config.num_requests):
        # Not the prompts of (d): a server warm from (d) would serve them from its cache.
        messages = ({"role": "user",
                     "content": texts.make(config.prompt_tokens, f"Beam prompt {i}:")},)
        request = texts.request(messages, config)
        chains.append((replace(request, n=config.n, use_beam_search=True),))
    return Workload(config, tuple(chains))


# ------------------------------------------------------------------------------------ text


class _Texts:
    """Random-word text cut to a token count, and requests from messages."""

    def __init__(self, tokenizer: TextTokenizer, rng: random.Random):
        self.tokenizer = tokenizer
        self.rng = rng

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, num_tokens: int, header: str = "") -> str:
        """Text of about `num_tokens` tokens: `header`, then random words and sentences."""
        words = [header] if header else []
        ids: list[int] = []
        while len(ids) < num_tokens:
            for _ in range(num_tokens + 8):
                word = self.rng.choice(_WORDS)
                words.append(word + ("." if self.rng.random() < 0.08 else ""))
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens]).strip()

    def request(self, messages: tuple[dict[str, str], ...], config: WorkloadConfig) -> BenchRequest:
        ids = self.tokenizer.encode_chat([dict(m) for m in messages])
        return BenchRequest(messages=messages, prompt_token_ids=tuple(ids),
                            max_tokens=config.output_tokens)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    i = 0
    step = 64
    while i + step <= limit and a[i : i + step] == b[i : i + step]:
        i += step
    while i < limit and a[i] == b[i]:
        i += 1
    return i
