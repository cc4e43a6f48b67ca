"""Beam search over one prompt: which beams live on, which finish, what is returned. Torch-free.

The rules are those of transformers' `generate(num_beams=beam_width, do_sample=False)` for
one prompt, so both return the same sequences, in the same order, with the same scores (up
to float rounding: sums here are in float64, transformers' in float32).

One step, for live beams b0, b1 (beam_width 2, one EOS id, so 2 x 2 = 4 candidates kept):

    candidates by cumulative logprob   b0+7   b1+EOS   b0+3   b1+9  | b0+EOS  ...
    rank                               0      1        2      3     | not kept
    finishing, in the top 2:                  finished
    first 2 not finishing:             live            live
    next live beams [(0, 7), (0, 3)]: beam 0 is forked, beam 1 is freed

- A candidate finishes when its token is an EOS id (unless ignore_eos) or when it is the
  max_new_tokens-th token. Only finished candidates ranked among the top beam_width may
  become hypotheses; the rest are dropped.
- A hypothesis of n generated tokens (its EOS included) scores
  cumulative_logprob / n ** length_penalty. The best beam_width hypotheses are kept.
- The search ends at max_new_tokens, or once beam_width hypotheses are kept and either
  early_stopping is set or the best live beam, scored at its current length, cannot beat the
  worst kept hypothesis (transformers' heuristic for early_stopping=False).

beam_width 1 is greedy decoding, which is what transformers runs for num_beams=1: the search
ends at the first hypothesis, whatever early_stopping says.

transformers starts from beam_width copies of the prompt, all but the first at -1e9; their
candidates never reach the kept ones (as long as the vocabulary holds num_candidates tokens),
so starting from the single prompt beam is the same search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from radixkv.sampling_params import BeamSearchParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class BeamCandidates:
    """One live beam's best next tokens: `token_ids[i]` has raw logprob `logprobs[i]`.

    `beam` is the beam's index among the live beams. Logprobs are the log_softmax of the
    model's logits, nothing else applied. The lists are as long as each other, best first,
    and hold at least the beam's top `BeamSearchGroup.num_candidates` tokens (all of them if
    the vocabulary is smaller; more change nothing). Equal cumulative logprobs rank by beam,
    then by position in these lists.
    """

    beam: int
    token_ids: Sequence[int]
    logprobs: Sequence[float]


class BeamChoice(NamedTuple):
    """A next live beam: live beam `parent` extended by `token_id`."""

    parent: int
    token_id: int


@dataclass(frozen=True)
class BeamStep:
    """What the engine does after a step.

    `next_beams` are the next live beams, in their new live order. `freed_beams` are the
    current live beams no next beam descends from (ascending). When `done`, `next_beams` is
    empty, every live beam is freed and `BeamSearchGroup.results()` is ready.
    """

    next_beams: list[BeamChoice]
    freed_beams: list[int]
    done: bool


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished sequence: generated tokens only, its EOS included when it ended on one."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


@dataclass(frozen=True)
class _Candidate:
    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class _LiveBeam:
    token_ids: list[int]
    cumulative_logprob: float


class BeamSearchGroup:
    """The beam search of one prompt, driven step by step by the engine.

    Holds every live beam's generated tokens and cumulative logprob, and the kept
    hypotheses. It never sees blocks: the engine forks and frees sequences as each
    `BeamStep` says.
    """

    def __init__(
        self, params: BeamSearchParams, eos_token_ids: Sequence[int], max_new_tokens: int
    ) -> None:
        """Start with one live beam: the prompt, with no generated token.

        `max_new_tokens` is params.max_tokens capped by what the context length allows.
        `eos_token_ids` are ignored when params.ignore_eos is set. Raises ValueError if
        max_new_tokens < 1.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be >= 1, got {max_new_tokens}: the prompt leaves no room "
                "in the context for a generated token"
            )
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids: frozenset[int] = (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self._live: list[_LiveBeam] = [_LiveBeam([], 0.0)]
        self._hypotheses: list[BeamHypothesis] = []  # best first, at most beam_width
        self._num_generated = 0
        self._done = False

    @property
    def num_candidates(self) -> int:
        """How many next tokens each live beam must propose: (number of EOS ids + 1) x
        beam_width, at least 2 x beam_width, as transformers keeps."""
        return max(2, len(self.eos_token_ids) + 1) * self.params.beam_width

    @property
    def num_live_beams(self) -> int:
        """How many beams the next `step` expects candidates for (0 once done)."""
        return len(self._live)

    @property
    def num_generated(self) -> int:
        """Tokens generated by each live beam so far (every live beam has as many)."""
        return self._num_generated

    @property
    def done(self) -> bool:
        return self._done

    def step(self, candidates: Sequence[BeamCandidates]) -> BeamStep:
        """Extend the live beams by one token each and return what to fork and free.

        `candidates` holds one entry per live beam, in live-beam order. Mutates the live
        beams and the kept hypotheses; after a step with done=True the group accepts no
        more steps. Raises RuntimeError if the search is already done and ValueError if
        `candidates` does not match the live beams.
        """
        if self._done:
            raise RuntimeError("step() called on a beam search that is done")
        self._check_candidates(candidates)
        width = self.params.beam_width
        new_len = self._num_generated + 1
        at_max_len = new_len == self.max_new_tokens
        ranked = self._rank(candidates)[: self.num_candidates]

        next_live: list[_LiveBeam] = []
        next_beams: list[BeamChoice] = []
        new_hypotheses: list[BeamHypothesis] = []
        for rank, cand in enumerate(ranked):
            stops = cand.token_id in self.eos_token_ids
            if stops or at_max_len:
                # Finished candidates below the top beam_width only ever served as spares.
                if rank < width:
                    reason: FinishReason = "stop" if stops else "length"
                    score = cand.cumulative_logprob / new_len**self.params.length_penalty
                    tokens = self._extend(cand)
                    new_hypotheses.append(
                        BeamHypothesis(tokens, cand.cumulative_logprob, score, reason)
                    )
            elif len(next_live) < width:
                next_live.append(_LiveBeam(self._extend(cand), cand.cumulative_logprob))
                next_beams.append(BeamChoice(cand.parent, cand.token_id))
        self._keep_best(new_hypotheses)
        self._num_generated = new_len

        if at_max_len or not next_live or self._can_stop_early(next_live[0], new_len):
            freed = list(range(len(self._live)))
            self._live = []
            self._done = True
            return BeamStep(next_beams=[], freed_beams=freed, done=True)
        chosen = {choice.parent for choice in next_beams}
        freed = [beam for beam in range(len(self._live)) if beam not in chosen]
        self._live = next_live
        return BeamStep(next_beams=next_beams, freed_beams=freed, done=False)

    def results(self) -> list[BeamHypothesis]:
        """The kept hypotheses, best score first: beam_width of them (fewer only when the
        vocabulary has fewer than num_candidates tokens). Raises RuntimeError before done."""
        if not self._done:
            raise RuntimeError("results() called before the beam search is done")
        return list(self._hypotheses)

    def _check_candidates(self, candidates: Sequence[BeamCandidates]) -> None:
        if len(candidates) != len(self._live):
            raise ValueError(
                f"expected candidates for {len(self._live)} live beams, got {len(candidates)}"
            )
        for index, entry in enumerate(candidates):
            if entry.beam != index:
                raise ValueError(f"candidates[{index}] is for beam {entry.beam}, expected {index}")
            if len(entry.token_ids) != len(entry.logprobs):
                raise ValueError(
                    f"beam {index}: {len(entry.token_ids)} token ids but "
                    f"{len(entry.logprobs)} logprobs"
                )
            if not entry.token_ids:
                raise ValueError(f"beam {index}: no candidate tokens")

    def _rank(self, candidates: Sequence[BeamCandidates]) -> list[_Candidate]:
        """Every candidate by cumulative logprob, best first; ties keep beam-major order."""
        flat = [
            _Candidate(entry.beam, token_id, self._live[entry.beam].cumulative_logprob + logprob)
            for entry in candidates
            for token_id, logprob in zip(entry.token_ids, entry.logprobs, strict=True)
        ]
        return sorted(flat, key=lambda cand: -cand.cumulative_logprob)

    def _extend(self, cand: _Candidate) -> list[int]:
        return [*self._live[cand.parent].token_ids, cand.token_id]

    def _keep_best(self, new_hypotheses: list[BeamHypothesis]) -> None:
        # Stable: on equal scores an older hypothesis stays ahead, then the better-ranked one.
        merged = sorted([*self._hypotheses, *new_hypotheses], key=lambda hyp: -hyp.score)
        self._hypotheses = merged[: self.params.beam_width]

    def _can_stop_early(self, best_live: _LiveBeam, new_len: int) -> bool:
        if len(self._hypotheses) < self.params.beam_width:
            return False
        if self.params.early_stopping or self.params.beam_width == 1:
            return True
        best_possible = best_live.cumulative_logprob / new_len**self.params.length_penalty
        return best_possible <= self._hypotheses[-1].score
