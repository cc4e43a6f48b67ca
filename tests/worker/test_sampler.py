"""The sampler against slow per-row references, transformers, and torch.log_softmax."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import radixkv.worker.race as race_module
import radixkv.worker.sampler as sampler_module
from radixkv.ipc.protocol import SamplingSpec
from radixkv.worker.sampler import (
    Sampler,
    SamplerOutput,
    apply_filters,
    apply_penalties,
    exponential_noise,
    filtered_weights,
    row_key,
)

CPU = torch.device("cpu")
MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    specs: Sequence[SamplingSpec],
    histories: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> SamplerOutput:
    if histories is None:
        histories = [[0]] * len(specs)
    if num_prompt_tokens is None:
        num_prompt_tokens = [len(h) for h in histories]
    return Sampler(logits.shape[1], CPU)(logits, specs, histories, num_prompt_tokens)


def random_logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=gen) * scale


def random_histories(
    num_rows: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    histories = []
    prompts = []
    for _ in range(num_rows):
        # a small alphabet so that tokens repeat, across the prompt and the generated part
        alphabet = rng.sample(range(vocab_size), 12)
        histories.append([rng.choice(alphabet) for _ in range(rng.randint(1, 40))])
        prompts.append(rng.randint(0, len(histories[-1])))
    return histories, prompts


# ------------------------------------------------------------------------------ references


def reference_penalties(
    row: list[float], spec: SamplingSpec, history: Sequence[int], num_prompt_tokens: int
) -> list[float]:
    out = list(row)
    for token in set(history):
        value = out[token]
        penalty = spec.repetition_penalty
        out[token] = value * penalty if value < 0 else value / penalty
    for token, count in Counter(history[num_prompt_tokens:]).items():
        out[token] -= spec.presence_penalty + spec.frequency_penalty * count
    return out


def scaled_logits(row: torch.Tensor, temperature: float) -> list[float]:
    """What the filters work on: (logits - max) / temperature, in float32 as the sampler has it."""
    return ((row - row.max()) / torch.tensor(temperature)).tolist()


def reference_kept(scaled: list[float], spec: SamplingSpec) -> tuple[set[int], float]:
    """The tokens top-k, then top-p, then min-p keep, in float64, and how far the closest
    decision was from its threshold (a float32 implementation must agree beyond that)."""
    vocab_size = len(scaled)
    kept = set(range(vocab_size))
    margin = math.inf
    if 0 < spec.top_k < vocab_size:
        kth = sorted(scaled, reverse=True)[spec.top_k - 1]
        kept = {i for i in kept if scaled[i] >= kth}

    def probs_of(tokens: set[int]) -> dict[int, float]:
        top = max(scaled[i] for i in tokens)
        weights = {i: math.exp(scaled[i] - top) for i in tokens}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    if spec.top_p < 1.0:
        probs = probs_of(kept)
        mass = 0.0
        nucleus = set()
        for i in sorted(kept, key=lambda i: (-probs[i], i)):
            margin = min(margin, abs(mass - spec.top_p))
            if mass >= spec.top_p:
                break
            nucleus.add(i)
            mass += probs[i]
        kept = nucleus
    if spec.min_p > 0.0:
        probs = probs_of(kept)
        top = max(probs.values())
        margin = min(margin, *(abs(p / top - spec.min_p) for p in probs.values()))
        kept = {i for i in kept if probs[i] >= spec.min_p * top}
    return kept, margin


def splitmix64_reference(key: int, stream: int, index: int) -> int:
    z = (key + ((stream << 32) + index) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def chi_square(counts: Counter[int], probs: dict[int, float], num_samples: int) -> float:
    assert set(counts) <= set(probs), "sampled a token outside the distribution"
    return sum((counts[i] - num_samples * p) ** 2 / (num_samples * p) for i, p in probs.items())


# ---------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax() -> None:
    logits = random_logits(32, 1000, seed=0).round()  # rounding makes ties for the maximum
    out = sample(logits, [SamplingSpec()] * 32)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1).gather(1, logits.argmax(dim=-1)[:, None])
    assert out.logprobs == expected.squeeze(1).tolist()
    assert out.top_token_ids == [[]] * 32 and out.top_logprobs == [[]] * 32


def test_greedy_ties_take_the_first_index() -> None:
    out = sample(torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0]]), [SamplingSpec()] * 2)
    assert out.token_ids == [1, 0]


def test_greedy_ignores_filters_and_seed() -> None:
    logits = random_logits(8, 300, seed=1)
    specs = [SamplingSpec(top_k=5, top_p=0.1, min_p=0.9, seed=s) for s in range(8)]
    assert sample(logits, specs).token_ids == logits.argmax(dim=-1).tolist()


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(4, 200, seed=2)
    before = logits.clone()
    specs = [
        SamplingSpec(repetition_penalty=1.5, presence_penalty=1.0),
        SamplingSpec(temperature=0.5, top_k=3, top_p=0.5, min_p=0.2, seed=1),
        SamplingSpec(num_top_logprobs=4),
        SamplingSpec(temperature=1.0, frequency_penalty=0.5),
    ]
    sample(logits, specs, [[1, 2, 2], [3], [4, 4], [5, 6]], [1, 1, 1, 1])
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------- penalties


def test_penalties_pinned_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 3.0]])
    spec = SamplingSpec(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [0, 1], generated [2, 2, 3]: repetition on 0..3, presence/frequency on 2 and 3
    out = apply_penalties(logits, [spec], [[0, 1, 2, 2, 3]], [2])
    assert out.tolist() == [[1.0, -4.0, 0.5 - 0.5 - 0.5, 0.25 - 0.5 - 0.25, -1.0, 3.0]]


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(6, 500, seed=3)
    histories, _ = random_histories(6, 500, seed=3)
    penalties = [1.3, 0.7, 2.0, 1.05, 0.5, 1.3]
    specs = [SamplingSpec(repetition_penalty=p) for p in penalties]
    out = apply_penalties(logits, specs, histories, [0] * 6)
    for i, (penalty, history) in enumerate(zip(penalties, histories, strict=True)):
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        expected = processor(torch.tensor([history]), logits[i : i + 1].clone())
        assert torch.equal(out[i : i + 1], expected), f"row {i}"


def test_all_penalties_match_reference_per_row() -> None:
    num_rows, vocab_size = 10, 400
    logits = random_logits(num_rows, vocab_size, seed=4)
    histories, prompts = random_histories(num_rows, vocab_size, seed=4)
    specs = [
        SamplingSpec(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingSpec(),  # untouched, in the middle of penalised rows
        SamplingSpec(presence_penalty=-1.0),
        SamplingSpec(frequency_penalty=2.0),
        SamplingSpec(repetition_penalty=0.8),
        SamplingSpec(temperature=0.7, presence_penalty=1.5, frequency_penalty=-0.5),
        SamplingSpec(repetition_penalty=1.7, frequency_penalty=0.1),
        SamplingSpec(),
        SamplingSpec(presence_penalty=2.0, frequency_penalty=2.0),
        SamplingSpec(repetition_penalty=1.1, presence_penalty=0.2),
    ]
    out = apply_penalties(logits, specs, histories, prompts)
    expected = [
        reference_penalties(logits[i].tolist(), specs[i], histories[i], prompts[i])
        for i in range(num_rows)
    ]
    assert torch.allclose(out, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[7], logits[7])


def test_presence_and_frequency_skip_the_prompt() -> None:
    logits = torch.zeros(1, 5)
    spec = SamplingSpec(presence_penalty=1.0, frequency_penalty=1.0)
    out = apply_penalties(logits, [spec], [[0, 0, 1, 4, 4, 4]], [3])
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0, -4.0]]


def test_no_penalty_returns_the_same_tensor() -> None:
    logits = random_logits(3, 50, seed=5)
    assert apply_penalties(logits, [SamplingSpec()] * 3, [[1, 2]] * 3, [1] * 3) is logits


def test_fast_path_matches_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    num_rows, vocab_size = 12, 700
    logits = random_logits(num_rows, vocab_size, seed=6)
    histories, prompts = random_histories(num_rows, vocab_size, seed=6)
    specs = [
        SamplingSpec(
            temperature=[0.0, 0.8, 1.3][i % 3],
            top_k=[0, 20][i % 2],
            top_p=[1.0, 0.9, 0.5, 1.0][i % 4],
            seed=i,
            num_top_logprobs=i % 3,
        )
        for i in range(num_rows)
    ]
    fast = sample(logits, specs, histories, prompts)
    monkeypatch.setattr(sampler_module, "_has_penalty", lambda spec: True)
    assert apply_penalties(logits, specs, histories, prompts) is not logits
    general = sample(logits, specs, histories, prompts)
    assert general == fast
    assert torch.equal(apply_penalties(logits, specs, histories, prompts), logits)


def test_history_tokens_outside_the_vocabulary_raise() -> None:
    spec = SamplingSpec(repetition_penalty=1.5)
    with pytest.raises(ValueError, match="history token ids"):
        sample(torch.zeros(1, 10), [spec], [[3, 10]], [1])
    with pytest.raises(ValueError, match="history token ids"):
        sample(torch.zeros(1, 10), [spec], [[-1]], [1])


# --------------------------------------------------------------------------------- filters


FILTER_SPECS = [
    SamplingSpec(temperature=1.0, top_k=1),
    SamplingSpec(temperature=0.7, top_k=40),
    SamplingSpec(temperature=1.0, top_p=0.9),
    SamplingSpec(temperature=1.4, top_p=0.6),
    SamplingSpec(temperature=1.0, min_p=0.05),
    SamplingSpec(temperature=0.5, min_p=0.3),
    SamplingSpec(temperature=1.0, top_k=50, top_p=0.8),
    SamplingSpec(temperature=0.9, top_k=200, top_p=0.95, min_p=0.01),
    SamplingSpec(temperature=1.0, top_p=0.3, min_p=0.5),
    SamplingSpec(temperature=2.0),
    SamplingSpec(temperature=1.0, top_k=3000),  # >= vocab: off
    SamplingSpec(temperature=1.0, top_p=0.985),
]


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])
def test_filters_keep_exactly_the_reference_set(scale: float) -> None:
    vocab_size = 3000
    logits = random_logits(len(FILTER_SPECS), vocab_size, seed=7, scale=scale)
    filtered = apply_filters(logits, FILTER_SPECS)
    for i, spec in enumerate(FILTER_SPECS):
        scaled = scaled_logits(logits[i], spec.temperature)
        expected, margin = reference_kept(scaled, spec)
        assert margin > 1e-5, f"row {i}: a decision too close to call; change the data"
        kept = set(torch.isfinite(filtered[i]).nonzero().squeeze(1).tolist())
        assert kept == expected, f"row {i}"
        assert torch.equal(filtered[i][sorted(kept)], torch.tensor(scaled)[sorted(kept)])


def test_filtered_weights_are_exp_of_the_filtered_logits() -> None:
    logits = random_logits(len(FILTER_SPECS), 3000, seed=7, scale=2.0)
    filtered = apply_filters(logits, FILTER_SPECS)
    weights = filtered_weights(logits, FILTER_SPECS)
    assert torch.equal(weights > 0, torch.isfinite(filtered))
    assert torch.equal(weights, filtered.exp())


def test_negligible_weights_are_zero_and_never_drawn() -> None:
    # scaled logits 0, -79, -80, -81, -1e4, -inf: exp(-80) and below count as 0
    logits = torch.tensor([[0.0, -79.0, -80.0, -81.0, -1e4, -math.inf]])
    spec = SamplingSpec(temperature=1.0)
    weights = filtered_weights(logits, [spec])
    expected = torch.tensor([[1.0, math.exp(-79.0), 0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(weights, expected, rtol=1e-6, atol=0)
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in range(100)]
    out = sample(logits.expand(100, -1), specs)
    assert set(out.token_ids) == {0}
    assert out.logprobs[0] == 0.0


def test_top_p_looks_past_the_first_candidates_when_the_nucleus_is_large() -> None:
    # flat rows: the nucleus holds ~2,500 of 3,000 tokens, beyond the first 1,024 candidates
    logits = random_logits(3, 3000, seed=8, scale=0.2)
    specs = [SamplingSpec(temperature=1.0, top_p=p) for p in (0.85, 0.2, 0.97)]
    filtered = apply_filters(logits, specs)
    sizes = []
    for i, spec in enumerate(specs):
        expected, margin = reference_kept(scaled_logits(logits[i], 1.0), spec)
        assert margin > 1e-5
        assert set(torch.isfinite(filtered[i]).nonzero().squeeze(1).tolist()) == expected
        sizes.append(len(expected))
    assert sizes[0] > 1024 and sizes[1] < 1024 and sizes[2] > 1024


def test_ties_at_the_top_k_boundary_all_stay() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    filtered = apply_filters(logits, [SamplingSpec(temperature=1.0, top_k=2)])
    assert torch.isfinite(filtered).tolist() == [[False, True, True, True, False, True]]


def test_ties_at_the_top_p_boundary_keep_the_lower_ids() -> None:
    uniform = torch.zeros(2, 2000)  # every token 1/2000: the nucleus is the lowest ids
    specs = [SamplingSpec(temperature=1.0, top_p=p) for p in (0.3001, 0.6001)]
    kept = torch.isfinite(apply_filters(uniform, specs))
    assert kept[0].nonzero().squeeze(1).tolist() == list(range(601))  # within the candidates
    assert kept[1].nonzero().squeeze(1).tolist() == list(range(1201))  # past the candidates
    small = apply_filters(torch.zeros(1, 4), [SamplingSpec(temperature=1.0, top_p=0.6)])
    assert torch.isfinite(small).tolist() == [[True, True, True, False]]


def test_min_p_pinned() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625: min_p 0.2 keeps p >= 0.1
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]).log()
    filtered = apply_filters(logits, [SamplingSpec(temperature=1.0, min_p=0.2)])
    assert torch.isfinite(filtered).tolist() == [[True, True, True, False, False]]


def test_sampled_tokens_stay_inside_the_kept_set() -> None:
    vocab_size = 3000
    num_seeds = 100
    logits = random_logits(len(FILTER_SPECS), vocab_size, seed=9, scale=2.0)
    kept_sets = [
        reference_kept(scaled_logits(logits[i], spec.temperature), spec)[0]
        for i, spec in enumerate(FILTER_SPECS)
    ]
    rows = [i for i in range(len(FILTER_SPECS)) for _ in range(num_seeds)]
    specs = [
        SamplingSpec(**{**FILTER_SPECS[i].__dict__, "seed": n})
        for i in range(len(FILTER_SPECS))
        for n in range(num_seeds)
    ]
    out = sample(logits[rows], specs)
    for row, token in zip(rows, out.token_ids, strict=True):
        assert token in kept_sets[row]


# ---------------------------------------------------------------------------------- random


def test_noise_is_splitmix64_of_key_stream_and_id() -> None:
    keys = [0, 1, 0x9E3779B97F4A7C15, (1 << 63), MASK64, row_key(-5, 123)]
    ids = [0, 1, 2, 255, 49151, (1 << 32) - 1]
    key_t = torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys])[:, None]
    noise = exponential_noise(key_t, 2, torch.tensor(ids)[None, :])
    expected = [
        [-math.log(((splitmix64_reference(k, 2, i) >> 12) + 0.5) * 2.0**-52) for i in ids]
        for k in keys
    ]
    assert torch.allclose(noise, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)


def test_noise_is_exponential() -> None:
    keys = torch.tensor([row_key(seed, 7) >> 1 for seed in range(64)])[:, None]
    noise = exponential_noise(keys, 1, torch.arange(4096)[None, :])  # 262,144 draws of Exp(1)
    assert noise.min().item() > 0.0 and noise.max().item() <= 37.0
    assert abs(noise.mean().item() - 1.0) < 0.01  # standard error 0.002
    assert abs(noise.var().item() - 1.0) < 0.03  # standard error ~0.006
    assert abs((noise > 1.0).double().mean().item() - math.exp(-1.0)) < 0.005


def test_row_key_reduces_seeds_to_64_bits() -> None:
    assert row_key(5, 10) == row_key(5 + (1 << 64), 10) == row_key(5 - (1 << 64), 10)
    assert row_key(-1, 10) == row_key(MASK64, 10)
    assert len({row_key(s, p) for s in range(20) for p in range(20)}) == 400


def test_pinned_draws() -> None:
    # Changing the generator changes every seeded user's outputs: this pins it.
    logits = torch.zeros(6, 1000)
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in (0, 1, 2, -7, 1 << 70, 2**64 - 1)]
    assert sample(logits, specs).token_ids == PINNED_UNIFORM_DRAWS


PINNED_UNIFORM_DRAWS = [45, 607, 221, 704, 45, 804]  # seeds 1 << 70 and 0 are equal


def mixed_specs() -> list[SamplingSpec]:
    return [
        SamplingSpec(temperature=1.0, seed=11),
        SamplingSpec(temperature=0.0, num_top_logprobs=3),
        SamplingSpec(temperature=0.8, top_k=10, seed=12, num_top_logprobs=2),
        SamplingSpec(temperature=1.2, top_p=0.7, seed=13),
        SamplingSpec(temperature=1.0, min_p=0.1, seed=14, repetition_penalty=1.3),
        SamplingSpec(temperature=0.6, top_k=30, top_p=0.9, min_p=0.02, seed=15),
        SamplingSpec(temperature=1.0, seed=11, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingSpec(temperature=0.0, repetition_penalty=1.5, num_top_logprobs=5),
        SamplingSpec(temperature=1.5, seed=-99),
        SamplingSpec(temperature=1.0, seed=11),  # same seed as row 0, longer history below
    ]


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    vocab_size = 1500
    specs = mixed_specs()
    logits = random_logits(len(specs), vocab_size, seed=10, scale=1.5)
    histories, prompts = random_histories(len(specs), vocab_size, seed=10)
    full = sample(logits, specs, histories, prompts)
    alone = [
        sample(logits[i : i + 1], specs[i : i + 1], histories[i : i + 1], prompts[i : i + 1])
        for i in range(len(specs))
    ]
    assert full.token_ids == [o.token_ids[0] for o in alone]
    assert full.logprobs == [o.logprobs[0] for o in alone]
    assert full.top_token_ids == [o.top_token_ids[0] for o in alone]

    order = list(range(len(specs)))
    random.Random(0).shuffle(order)
    shuffled = sample(
        logits[order],
        [specs[i] for i in order],
        [histories[i] for i in order],
        [prompts[i] for i in order],
    )
    assert shuffled.token_ids == [full.token_ids[i] for i in order]
    assert shuffled.top_logprobs == [full.top_logprobs[i] for i in order]

    # the same rows again, between other rows
    extra = random_logits(5, vocab_size, seed=11)
    padded = sample(
        torch.cat([extra[:2], logits, extra[2:]]),
        [SamplingSpec(temperature=0.9, seed=1)] * 2 + specs + [SamplingSpec()] * 3,
        [[1]] * 2 + histories + [[2]] * 3,
        [1] * 2 + prompts + [1] * 3,
    )
    assert padded.token_ids[2:-3] == full.token_ids


def test_draws_do_not_touch_the_global_generator() -> None:
    logits = random_logits(4, 500, seed=12)
    specs = [SamplingSpec(temperature=1.0, top_p=0.9, seed=s) for s in range(4)]
    torch.manual_seed(0)
    first = sample(logits, specs)
    state = torch.get_rng_state()
    torch.manual_seed(1)
    second = sample(logits, specs)
    torch.manual_seed(0)
    third = sample(logits, specs)
    assert first == second == third
    assert torch.equal(torch.get_rng_state(), state)


def test_position_and_seed_both_change_the_draw() -> None:
    logits = torch.zeros(1, 1000)
    spec = SamplingSpec(temperature=1.0, seed=3)
    by_position = {sample(logits, [spec], [[0] * n]).token_ids[0] for n in range(1, 101)}
    by_seed = {
        sample(logits, [SamplingSpec(temperature=1.0, seed=s)]).token_ids[0] for s in range(100)
    }
    # 100 uniform draws over 1,000 tokens: ~95 distinct values expected
    assert len(by_position) > 85 and len(by_seed) > 85


def test_empirical_distribution_matches_softmax() -> None:
    num_samples = 10000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    temperature = 0.7
    specs = [SamplingSpec(temperature=temperature, seed=s) for s in range(num_samples)]
    out = sample(logits.expand(num_samples, -1), specs)
    probs = torch.softmax(logits[0].double() / temperature, dim=-1).tolist()
    statistic = chi_square(Counter(out.token_ids), dict(enumerate(probs)), num_samples)
    assert statistic < 24.32  # chi-square, 7 degrees of freedom, p = 0.001


def test_empirical_distribution_across_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    # 14 tokens in buckets of 4: the race picks a bucket, then a token of the bucket; the
    # last bucket is half padding
    monkeypatch.setattr(race_module, "_MAX_BUCKET_SIZE", 4)
    num_samples = 10000
    logits = torch.tensor(
        [[0.5, -1.0, 1.0, 0.0, -2.0, -3.0, -1.5, -0.5, 2.0, -4.0, 0.3, 1.2, -1.0, 0.8]]
    )
    specs = [SamplingSpec(temperature=1.0, seed=s) for s in range(num_samples)]
    out = sample(logits.expand(num_samples, -1), specs, [[0] * 7] * num_samples)
    probs = torch.softmax(logits[0].double(), dim=-1).tolist()
    statistic = chi_square(Counter(out.token_ids), dict(enumerate(probs)), num_samples)
    assert statistic < 34.53  # 13 degrees of freedom, p = 0.001


def test_empirical_distribution_of_a_filtered_row() -> None:
    num_samples = 10000
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    # top_k drops 6 and 7, top_p drops 5, min_p drops 4
    spec = SamplingSpec(temperature=1.3, top_k=6, top_p=0.9, min_p=0.25)
    scaled = scaled_logits(logits[0], 1.3)
    kept, _ = reference_kept(scaled, spec)
    weights = {i: math.exp(scaled[i]) for i in kept}
    total = sum(weights.values())
    specs = [SamplingSpec(**{**spec.__dict__, "seed": s}) for s in range(num_samples)]
    out = sample(logits.expand(num_samples, -1), specs)
    probs = {i: w / total for i, w in weights.items()}
    statistic = chi_square(Counter(out.token_ids), probs, num_samples)
    assert kept == {0, 1, 2, 3}
    assert statistic < 16.27  # 3 degrees of freedom, p = 0.001


# -------------------------------------------------------------------------------- logprobs


def test_logprobs_are_under_the_raw_distribution() -> None:
    num_rows, vocab_size = 8, 800
    logits = random_logits(num_rows, vocab_size, seed=13)
    histories, prompts = random_histories(num_rows, vocab_size, seed=13)
    specs = [
        SamplingSpec(
            temperature=0.5 + 0.2 * i,
            top_k=5 * i,
            repetition_penalty=1.5,
            seed=i,
            num_top_logprobs=i,
        )
        for i in range(num_rows)
    ]
    out = sample(logits, specs, histories, prompts)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == [raw[i, t].item() for i, t in enumerate(out.token_ids)]
    for i in range(num_rows):
        values, ids = raw[i].topk(i)
        assert out.top_token_ids[i] == ids.tolist()
        assert out.top_logprobs[i] == values.tolist()


def test_top_logprobs_break_ties_by_lower_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for k, ids_0, ids_1 in [
        (2, [1, 2], [0, 1]),
        (4, [1, 2, 4, 3], [0, 1, 2, 3]),
        (6, [1, 2, 4, 3, 5, 0], [0, 1, 2, 3, 4, 5]),
    ]:
        out = sample(logits, [SamplingSpec(num_top_logprobs=k)] * 2)
        assert out.top_token_ids == [ids_0, ids_1]
        raw = torch.log_softmax(logits, dim=-1)
        assert out.top_logprobs[0] == raw[0, ids_0].tolist()


def test_top_logprobs_ties_beyond_the_boundary() -> None:
    # 300 tied tokens compete for the last 4 places: the lowest ids take them
    logits = torch.zeros(1, 300)
    logits[0, 250] = 1.0
    out = sample(logits, [SamplingSpec(num_top_logprobs=5)])
    assert out.top_token_ids == [[250, 0, 1, 2, 3]]


# ----------------------------------------------------------------------------- mixed batch


def test_mixed_batch_pinned_against_references() -> None:
    vocab_size = 1500
    specs = mixed_specs()
    logits = random_logits(len(specs), vocab_size, seed=14, scale=1.5)
    histories, prompts = random_histories(len(specs), vocab_size, seed=14)
    histories[9] = histories[0] + [5]  # row 9: row 0's seed one position later
    prompts[9] = prompts[0]
    histories[7].append(int(logits[7].argmax()))  # row 7's penalty moves its argmax
    out = sample(logits, specs, histories, prompts)

    penalised = apply_penalties(logits, specs, histories, prompts)
    for i in (1, 7):  # greedy rows: argmax of the penalised logits
        assert out.token_ids[i] == penalised[i].argmax().item()
    assert penalised[7].argmax() != logits[7].argmax()  # the penalty mattered
    for i in (2, 3, 4, 5):
        scaled = scaled_logits(penalised[i], specs[i].temperature)
        assert out.token_ids[i] in reference_kept(scaled, specs[i])[0]
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == [raw[i, t].item() for i, t in enumerate(out.token_ids)]
    assert [len(ids) for ids in out.top_token_ids] == [s.num_top_logprobs for s in specs]
    assert out.top_token_ids[7] == raw[7].topk(5).indices.tolist()
    assert out.token_ids == PINNED_MIXED_DRAWS


PINNED_MIXED_DRAWS = [502, 1359, 572, 1356, 282, 970, 1201, 121, 300, 697]


# ------------------------------------------------------------------------------ validation


def test_empty_batch() -> None:
    assert sample(torch.zeros(0, 10), []) == SamplerOutput([], [], [], [])


@pytest.mark.parametrize(
    "spec",
    [
        SamplingSpec(temperature=-1.0),
        SamplingSpec(top_k=-1),
        SamplingSpec(top_p=0.0),
        SamplingSpec(top_p=1.5),
        SamplingSpec(min_p=1.5),
        SamplingSpec(repetition_penalty=0.0),
        SamplingSpec(num_top_logprobs=11),
    ],
)
def test_bad_specs_raise(spec: SamplingSpec) -> None:
    with pytest.raises(ValueError, match="bad SamplingSpec"):
        sample(torch.zeros(1, 10), [spec])


def test_shape_mismatches_raise() -> None:
    sampler = Sampler(10, CPU)
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.zeros(2, 11), [SamplingSpec()] * 2, [[1]] * 2, [1] * 2)
    with pytest.raises(ValueError, match="must match"):
        sampler(torch.zeros(2, 10), [SamplingSpec()] * 2, [[1]], [1] * 2)
