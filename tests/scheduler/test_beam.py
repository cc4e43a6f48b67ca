"""BeamSearchGroup: exact selections on hand-made candidates, then against transformers' beam
search on a tiny random Llama whose EOS is made frequent so beams really finish early."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from radixkv.sampling_params import BeamSearchParams
from radixkv.scheduler.beam import (
    BeamCandidates,
    BeamChoice,
    BeamHypothesis,
    BeamSearchGroup,
    BeamStep,
)

EOS = 0


def cands(beam: int, pairs: Sequence[tuple[int, float]]) -> BeamCandidates:
    return BeamCandidates(beam, [token for token, _ in pairs], [lp for _, lp in pairs])


def group(
    width: int, max_new_tokens: int = 8, eos: Sequence[int] = (EOS,), **kw: Any
) -> BeamSearchGroup:
    return BeamSearchGroup(BeamSearchParams(width, max_new_tokens, **kw), eos, max_new_tokens)


def summary(hyps: list[BeamHypothesis]) -> list[tuple[list[int], str]]:
    return [(hyp.token_ids, hyp.finish_reason) for hyp in hyps]


# --- hand-made candidates -------------------------------------------------------------------


def test_parent_chosen_twice_and_parent_dropped() -> None:
    g = group(2)
    assert g.num_live_beams == 1 and g.num_candidates == 4
    step = g.step([cands(0, [(5, -0.1), (6, -0.5), (7, -1.0), (8, -2.0)])])
    assert step == BeamStep([BeamChoice(0, 5), BeamChoice(0, 6)], freed_beams=[], done=False)

    # totals: beam 0 -> -0.3, -0.4, -3.1, -4.1; beam 1 (at -0.5) -> -1.5, -2.5, ...
    step = g.step(
        [
            cands(0, [(10, -0.2), (11, -0.3), (12, -3.0), (13, -4.0)]),
            cands(1, [(20, -1.0), (21, -2.0), (22, -3.0), (23, -4.0)]),
        ]
    )
    assert step.next_beams == [(0, 10), (0, 11)]
    assert step.freed_beams == [1]
    assert not step.done and g.num_generated == 2


def test_live_order_follows_cumulative_logprob_not_parent_order() -> None:
    g = group(2)
    g.step([cands(0, [(5, -0.1), (6, -0.5), (7, -1.0), (8, -2.0)])])
    step = g.step(
        [
            cands(0, [(10, -3.0), (11, -3.5), (12, -4.0), (13, -5.0)]),
            cands(1, [(20, -0.1), (21, -0.2), (22, -6.0), (23, -7.0)]),
        ]
    )
    assert step.next_beams == [(1, 20), (1, 21)]
    assert step.freed_beams == [0]


def test_equal_totals_keep_beam_major_order() -> None:
    g = group(2)
    g.step([cands(0, [(5, -1.0), (6, -1.0), (7, -3.0), (8, -3.0)])])
    step = g.step(
        [
            cands(0, [(10, -0.5), (11, -0.5), (12, -9.0), (13, -9.0)]),
            cands(1, [(20, -0.5), (21, -9.0), (22, -9.0), (23, -9.0)]),
        ]
    )
    assert step.next_beams == [(0, 10), (0, 11)]


@pytest.mark.parametrize(
    ("length_penalty", "ends", "best_first"),
    [(1.0, True, True), (0.0, True, False), (2.0, False, None), (-0.5, True, False)],
)
def test_only_eos_in_top_width_finishes_and_heuristic_stops(
    length_penalty: float, ends: bool, best_first: bool | None
) -> None:
    g = group(2, length_penalty=length_penalty)
    # Step 0: EOS ranks 1 of 4 -> hypothesis [EOS] of length 1, score -0.2 whatever the penalty.
    step = g.step([cands(0, [(5, -0.1), (EOS, -0.2), (6, -0.3), (7, -0.4)])])
    assert step.next_beams == [(0, 5), (0, 6)]
    # Step 1: both EOS rank 2 and 3 (outside the top 2): dropped, not kept as hypotheses.
    step = g.step(
        [
            cands(0, [(8, -0.1), (9, -0.2), (EOS, -0.3), (10, -5.0)]),
            cands(1, [(EOS, -0.05), (11, -0.5), (12, -0.6), (13, -1.0)]),
        ]
    )
    assert step.next_beams == [(0, 8), (0, 9)] and step.freed_beams == [1]
    assert not step.done
    # Step 2: beam 0's EOS ranks first -> [5, 8, EOS], cum -0.3, length 3. Two hypotheses are
    # kept; the search ends unless the best live beam [5, 9, 17] (-0.8 / 3 ** penalty) beats
    # the worse of them: only with penalty 2 (-0.089 > -0.2).
    step = g.step(
        [
            cands(0, [(EOS, -0.1), (14, -1.0), (15, -2.0), (16, -3.0)]),
            cands(1, [(17, -0.5), (18, -0.6), (19, -0.7), (20, -0.8)]),
        ]
    )
    assert step.done == ends
    if not ends:
        assert step.next_beams == [(1, 17), (1, 18)] and step.freed_beams == [0]
        return
    assert step.next_beams == [] and step.freed_beams == [0, 1]
    hyps = g.results()
    longer = ([5, 8, EOS], -0.3, -0.3 / 3**length_penalty)
    shorter = ([EOS], -0.2, -0.2)
    expected = [longer, shorter] if best_first else [shorter, longer]
    assert [h.token_ids for h in hyps] == [tokens for tokens, _, _ in expected]
    assert [h.cumulative_logprob for h in hyps] == pytest.approx([cum for _, cum, _ in expected])
    assert [h.score for h in hyps] == pytest.approx([score for _, _, score in expected])
    assert all(h.finish_reason == "stop" for h in hyps)


def two_hypotheses_then_live(g: BeamSearchGroup) -> BeamStep:
    """Kept after step 1: [5, EOS] (-1.2 / 2) and [EOS] (-1.0); live [5, 8] -1.3, [5, 9] -1.4."""
    g.step([cands(0, [(EOS, -1.0), (5, -1.1), (6, -1.2), (7, -3.0)])])
    return g.step(
        [
            cands(0, [(EOS, -0.1), (8, -0.2), (9, -0.3), (10, -0.4)]),
            cands(1, [(11, -0.5), (12, -0.6), (13, -0.7), (14, -0.8)]),
        ]
    )


def test_early_stopping_true_ends_once_width_hypotheses_are_kept() -> None:
    g = group(2, max_new_tokens=3, early_stopping=True)
    step = two_hypotheses_then_live(g)
    assert step.done and step.freed_beams == [0, 1]
    assert summary(g.results()) == [([5, EOS], "stop"), ([EOS], "stop")]
    assert [h.score for h in g.results()] == pytest.approx([-0.6, -1.0])


def test_running_beams_become_hypotheses_at_max_new_tokens() -> None:
    g = group(2, max_new_tokens=3, early_stopping=False)
    step = two_hypotheses_then_live(g)
    # Best live -1.3 / 2 = -0.65 still beats the worst kept -1.0: go on.
    assert not step.done and step.next_beams == [(0, 8), (0, 9)]
    step = g.step(
        [
            cands(0, [(15, -0.1), (16, -0.2), (17, -0.3), (18, -0.4)]),
            cands(1, [(19, -0.05), (EOS, -0.06), (20, -1.0), (21, -2.0)]),
        ]
    )
    # Totals: (0,15) -1.4, (1,19) -1.45, (1,EOS) -1.46 ranks 2: only the top 2 finish.
    assert step.done and step.next_beams == [] and step.freed_beams == [0, 1]
    hyps = g.results()
    assert summary(hyps) == [([5, 8, 15], "length"), ([5, 9, 19], "length")]
    assert [h.score for h in hyps] == pytest.approx([-1.4 / 3, -1.45 / 3])
    assert [h.cumulative_logprob for h in hyps] == pytest.approx([-1.4, -1.45])


def test_max_new_tokens_one_finishes_top_width_at_step_zero() -> None:
    g = group(3, max_new_tokens=1)
    step = g.step([cands(0, [(5, -0.1), (EOS, -0.2), (6, -0.3), (7, -0.4), (8, -0.5), (9, -1)])])
    assert step.done and step.freed_beams == [0]
    assert summary(g.results()) == [([5], "length"), ([EOS], "stop"), ([6], "length")]


def test_ignore_eos_makes_eos_an_ordinary_token() -> None:
    g = group(2, ignore_eos=True)
    assert g.eos_token_ids == frozenset() and g.num_candidates == 4
    step = g.step([cands(0, [(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -0.4)])])
    assert step.next_beams == [(0, EOS), (0, 5)] and not step.done


@pytest.mark.parametrize(
    ("eos", "ignore_eos", "expected"),
    [
        ([0], False, 6),
        ([0, 1], False, 9),
        ([0, 1, 2], False, 12),
        ([], False, 6),
        ([0, 1], True, 6),
    ],
)
def test_num_candidates(eos: list[int], ignore_eos: bool, expected: int) -> None:
    assert group(3, eos=eos, ignore_eos=ignore_eos).num_candidates == expected


def test_width_one_is_greedy_and_ends_at_the_first_eos() -> None:
    g = group(1, early_stopping=False)
    step = g.step([cands(0, [(5, -0.1), (6, -0.2)])])
    assert step.next_beams == [(0, 5)]
    step = g.step([cands(0, [(EOS, -0.5), (7, -0.6)])])
    assert step.done
    assert summary(g.results()) == [([5, EOS], "stop")]
    assert g.results()[0].score == pytest.approx(-0.6 / 2)


def test_misuse_raises() -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        BeamSearchGroup(BeamSearchParams(2, 16), [EOS], max_new_tokens=0)
    g = group(2)
    with pytest.raises(RuntimeError, match="before"):
        g.results()
    with pytest.raises(ValueError, match="1 live beams, got 2"):
        g.step([cands(0, [(5, -0.1)]), cands(1, [(6, -0.1)])])
    with pytest.raises(ValueError, match="is for beam 1"):
        g.step([cands(1, [(5, -0.1)])])
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        g.step([BeamCandidates(0, [5, 6], [-0.1])])
    g = group(2, max_new_tokens=1)
    g.step([cands(0, [(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)])])
    with pytest.raises(RuntimeError, match="done"):
        g.step([])


def test_beam_module_never_imports_torch() -> None:
    code = "import sys, radixkv.scheduler.beam; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# --- against transformers -------------------------------------------------------------------

MAX_NEW_TOKENS = 10
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 384) for _ in range(n)] for n in (5, 9, 14, 3)]
# Raises the EOS logits by about this much on average, so EOS often ranks in the top width.
EOS_BOOST = 4.0


@pytest.fixture(scope="module")
def eos_model(tiny_llama_dir: Path) -> Iterator[tuple[Any, list[int]]]:
    """The tiny Llama with two frequent tokens boosted to serve as EOS ids (first = the EOS)."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add overhead on a shared CPU
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = torch.cat([model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS])
        greedy = model.lm_head(hidden).argmax(-1)  # (num_prompt_tokens,)
        eos_ids = torch.bincount(greedy, minlength=384).topk(2).indices.tolist()
        mean = hidden.mean(0)  # (hidden_size,)
        for eos in eos_ids:
            model.lm_head.weight[eos] += EOS_BOOST * mean / mean.dot(mean)
    yield model, eos_ids
    torch.set_num_threads(threads)


@dataclass
class Driven:
    """A finished group, plus how many EOS candidates ranked in the top width before the last
    step (each became a hypothesis, whether or not it survived to the results)."""

    group: BeamSearchGroup
    num_early_eos: int


def run_group(
    model: Any, prompt: list[int], params: BeamSearchParams, eos_ids: list[int]
) -> Driven:
    """Drive a group with exact next-token logprobs: a full forward of prompt + each live beam."""
    import torch

    g = BeamSearchGroup(params, eos_ids, params.max_tokens)
    live: list[tuple[list[int], float]] = [([], 0.0)]  # (tokens, cumulative logprob)
    num_early_eos = 0
    while True:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens for tokens, _ in live])).logits[:, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (num_live, vocab)
        top = logprobs.topk(g.num_candidates, dim=-1)
        totals = sorted(
            (
                (cum + lp, token)
                for (_, cum), lps, tokens in zip(live, top.values, top.indices, strict=True)
                for lp, token in zip(lps.tolist(), tokens.tolist(), strict=True)
            ),
            reverse=True,
        )
        if g.num_generated + 1 < params.max_tokens and not params.ignore_eos:
            num_early_eos += sum(token in eos_ids for _, token in totals[: params.beam_width])
        step = g.step(
            [
                BeamCandidates(i, top.indices[i].tolist(), top.values[i].tolist())
                for i in range(len(live))
            ]
        )
        chosen = {choice.parent for choice in step.next_beams}
        assert step.freed_beams == [b for b in range(len(live)) if b not in chosen]
        if step.done:
            assert step.next_beams == [] and step.freed_beams == list(range(len(live)))
            return Driven(g, num_early_eos)
        live = [
            (live[parent][0] + [token], live[parent][1] + logprobs[parent, token].item())
            for parent, token in step.next_beams
        ]


def run_transformers(
    model: Any, prompt: list[int], params: BeamSearchParams, eos_ids: list[int]
) -> list[tuple[list[int], float]]:
    """(generated tokens, score) per returned sequence, best first."""
    import torch

    kwargs: dict[str, Any] = dict(
        do_sample=False,
        max_new_tokens=params.max_tokens,
        eos_token_id=None if params.ignore_eos else eos_ids,
        output_scores=True,
        return_dict_in_generate=True,
    )
    width = params.beam_width
    if width > 1:
        kwargs.update(
            num_beams=width,
            num_return_sequences=width,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), **kwargs)
    if width == 1:  # transformers runs greedy search, which reports no sequence score
        tokens = out.sequences[0, len(prompt) :].tolist()
        steps = zip(out.scores, tokens, strict=True)
        cum = sum(torch.log_softmax(s[0].float(), -1)[t].item() for s, t in steps)
        return [(tokens, cum / len(tokens) ** params.length_penalty)]
    lengths = (out.beam_indices != -1).sum(-1).tolist()
    return [
        (out.sequences[i, len(prompt) : len(prompt) + n].tolist(), out.sequences_scores[i].item())
        for i, n in enumerate(lengths)
    ]


def sequence_logprob(model: Any, prompt: list[int], tokens: list[int]) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (len(tokens), vocab)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum().item()


def check_against_transformers(
    model: Any, params: BeamSearchParams, eos_ids: list[int]
) -> list[Driven]:
    """Run every prompt both ways, assert equal results; return ours per prompt."""
    runs = []
    for prompt in PROMPTS:
        run = run_group(model, prompt, params, eos_ids)
        hyps = run.group.results()
        expected = run_transformers(model, prompt, params, eos_ids)
        assert [h.token_ids for h in hyps] == [tokens for tokens, _ in expected], prompt
        assert [h.score for h in hyps] == pytest.approx([s for _, s in expected], abs=1e-4)
        stops = set() if params.ignore_eos else set(eos_ids)
        for h in hyps:
            assert h.cumulative_logprob == pytest.approx(
                sequence_logprob(model, prompt, h.token_ids), abs=1e-4
            )
            assert not stops.intersection(h.token_ids[:-1])
            if h.finish_reason == "stop":
                assert h.token_ids[-1] in stops
            else:
                assert len(h.token_ids) == params.max_tokens
                assert h.token_ids[-1] not in stops
        runs.append(run)
    return runs


def num_early_eos_results(runs: list[Driven]) -> int:
    return sum(
        h.finish_reason == "stop" and len(h.token_ids) < MAX_NEW_TOKENS
        for run in runs
        for h in run.group.results()
    )


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -0.5])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_matches_transformers(
    eos_model: tuple[Any, list[int]], width: int, length_penalty: float, early_stopping: bool
) -> None:
    model, eos_ids = eos_model
    params = BeamSearchParams(width, MAX_NEW_TOKENS, length_penalty, early_stopping)
    runs = check_against_transformers(model, params, eos_ids[:1])
    assert sum(run.num_early_eos for run in runs) > 0
    if length_penalty < 2.0:  # a strong penalty favours the long beams that reach the limit
        assert num_early_eos_results(runs) > 0
    if early_stopping:
        assert any(run.group.num_generated < MAX_NEW_TOKENS for run in runs)


@pytest.mark.parametrize(("width", "early_stopping"), [(2, False), (4, False), (4, True)])
def test_matches_transformers_with_two_eos_ids(
    eos_model: tuple[Any, list[int]], width: int, early_stopping: bool
) -> None:
    model, eos_ids = eos_model
    params = BeamSearchParams(width, MAX_NEW_TOKENS, early_stopping=early_stopping)
    runs = check_against_transformers(model, params, eos_ids)
    results = [run.group.results() for run in runs]
    assert {h.token_ids[-1] for hyps in results for h in hyps if h.finish_reason == "stop"} == set(
        eos_ids
    )


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (2, 1.0), (4, 2.0)])
def test_matches_transformers_ignoring_eos(
    eos_model: tuple[Any, list[int]], width: int, length_penalty: float
) -> None:
    model, eos_ids = eos_model
    params = BeamSearchParams(width, MAX_NEW_TOKENS, length_penalty, ignore_eos=True)
    runs = check_against_transformers(model, params, eos_ids[:1])
    results = [run.group.results() for run in runs]
    assert all(h.finish_reason == "length" for hyps in results for h in hyps)
    assert any(eos_ids[0] in h.token_ids for hyps in results for h in hyps)


def test_matches_transformers_with_one_new_token(eos_model: tuple[Any, list[int]]) -> None:
    model, eos_ids = eos_model
    check_against_transformers(model, BeamSearchParams(4, 1), eos_ids[:1])


def test_both_stopping_rules_end_searches_early_and_differ(
    eos_model: tuple[Any, list[int]],
) -> None:
    """The heuristic (False) ends some searches before max_new_tokens too, and the two rules
    return different beams for some prompt (both checked against transformers above)."""
    model, eos_ids = eos_model
    num_differ = 0
    num_heuristic_ends = 0
    for prompt in PROMPTS:
        heuristic, eager = (
            run_group(model, prompt, BeamSearchParams(4, MAX_NEW_TOKENS, 1.0, es), eos_ids[:1])
            for es in (False, True)
        )
        num_differ += summary(heuristic.group.results()) != summary(eager.group.results())
        num_heuristic_ends += heuristic.group.num_generated < MAX_NEW_TOKENS
    assert num_differ > 0 and num_heuristic_ends > 0
