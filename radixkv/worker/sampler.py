"""Pick the next token of every sampling row: penalties, greedy or filtered sampling, logprobs.

One call per step, vectorized over rows; Python loops run over rows only (to read the specs
and histories), never over the vocabulary.

    raw logits ──► penalties ──┬─ temperature 0 ───────────────────────────► argmax
      │                        └─ / temperature ─► top-k ─► top-p ─► min-p ─► race
      └─► log_softmax ─► chosen logprob, top logprobs      (always the raw distribution)

Randomness is counter-based: a row's draw depends only on (seed, position) and its filtered
distribution, never on the batch around it nor on torch's global generator (see `race`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.ipc.protocol import SamplingSpec
from radixkv.worker.race import exponential_noise, race, row_key

__all__ = [
    "Sampler",
    "SamplerOutput",
    "apply_filters",
    "apply_penalties",
    "exponential_noise",
    "filtered_weights",
    "race",
    "row_key",
]



@dataclass(frozen=True)
class SamplerOutput:
    """Per row, in the order of the logits rows.

    `logprobs` and `top_logprobs` are under the raw model distribution (log_softmax of the
    logits before penalties, temperature and filters); `top_token_ids[i]` holds the row's
    `num_top_logprobs` best tokens, best first, lower id first on ties.
    """

    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


class Sampler:
    """Samples one token per row of logits; stateless between calls."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = device

    def __call__(
        self,
        logits: torch.Tensor,
        specs: Sequence[SamplingSpec],
        histories: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
    ) -> SamplerOutput:
        """Pick a token for every row of `logits` (num_rows, vocab_size).

        Row i follows `specs[i]`; `histories[i]` is its whole token history (prompt then
        generated tokens, the last computed one included), the first `num_prompt_tokens[i]`
        of which are the prompt. The token drawn sits at position len(histories[i]), which
        keys the row's random draw together with its seed. Raises ValueError on inconsistent
        shapes, out-of-range parameters or history token ids outside the vocabulary.
        """
        num_rows = len(specs)
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits must be (num_rows, {self.vocab_size}), got {tuple(logits.shape)}"
            )
        if not logits.shape[0] == num_rows == len(histories) == len(num_prompt_tokens):
            raise ValueError(
                f"{logits.shape[0]} logits rows, {num_rows} specs, {len(histories)} histories "
                f"and {len(num_prompt_tokens)} prompt lengths must match"
            )
        for spec in specs:
            _check_spec(spec, self.vocab_size)
        if num_rows == 0:
            return SamplerOutput([], [], [], [])
        raw = logits.float()

        penalised = apply_penalties(raw, specs, histories, num_prompt_tokens)
        greedy_rows = [i for i, spec in enumerate(specs) if spec.temperature == 0.0]
        if len(greedy_rows) == num_rows:
            token_ids = penalised.argmax(dim=-1)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.int64, device=raw.device)
            sampled_rows = [i for i, spec in enumerate(specs) if spec.temperature != 0.0]
            if greedy_rows:
                greedy_idx = _index(greedy_rows, raw.device)
                token_ids[greedy_idx] = penalised[greedy_idx].argmax(dim=-1)
            sampled_idx = _index(sampled_rows, raw.device)
            sampled_specs = [specs[i] for i in sampled_rows]
            sampled_logits = penalised[sampled_idx] if greedy_rows else penalised
            weights = filtered_weights(sampled_logits, sampled_specs)
            keys = [row_key(specs[i].seed, len(histories[i])) for i in sampled_rows]
            token_ids[sampled_idx] = race(weights, keys)

        return _with_logprobs(raw, token_ids, specs)


# ------------------------------------------------------------------------------ penalties


def apply_penalties(
    logits: torch.Tensor,
    specs: Sequence[SamplingSpec],
    histories: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """Return `logits` with each row's penalties applied (a new tensor; `logits` itself when
    no row has a penalty).

    Repetition (over the whole history, prompt included, once per distinct token, like
    transformers' RepetitionPenaltyLogitsProcessor): positive logits divided by the penalty,
    negative ones multiplied. Then presence and frequency (OpenAI, over the generated tokens
    only): logit -= presence * (count > 0) + frequency * count. Work is O(history), not
    O(vocab), past one copy of `logits`.
    """
    rows = [i for i, spec in enumerate(specs) if _has_penalty(spec)]
    if not rows:
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    lengths = torch.tensor([len(histories[i]) for i in rows], dtype=torch.int64, device=device)
    token_ids = torch.tensor(
        list(itertools.chain.from_iterable(histories[i] for i in rows)), dtype=torch.int64
    ).to(device)
    if token_ids.numel() and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < vocab_size:
        raise ValueError(f"history token ids must be in [0, {vocab_size})")
    row_of = torch.repeat_interleave(_index(rows, device), lengths)  # (total_len,) logits row
    cells = row_of * vocab_size + token_ids  # (total_len,) into the flattened logits

    out = logits.clone(memory_format=torch.contiguous_format)
    flat_out = out.view(-1)
    if any(specs[i].repetition_penalty != 1.0 for i in rows):
        penalty = torch.tensor([spec.repetition_penalty for spec in specs], device=device)[row_of]
        seen = flat_out[cells]  # gathered before any write: once per token, not per use
        flat_out[cells] = torch.where(seen < 0, seen * penalty, seen / penalty)

    if any(specs[i].presence_penalty or specs[i].frequency_penalty for i in rows):
        starts = torch.cumsum(lengths, 0) - lengths
        local = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
        position = torch.arange(token_ids.numel(), device=device) - starts[local]
        prompt_lens = torch.tensor([num_prompt_tokens[i] for i in rows], device=device)
        generated, counts = torch.unique(cells[position >= prompt_lens[local]], return_counts=True)
        presence = torch.tensor([spec.presence_penalty for spec in specs], device=device)
        frequency = torch.tensor([spec.frequency_penalty for spec in specs], device=device)
        row = generated // vocab_size
        # count >= 1 on every cell here, so presence * (count > 0) is presence
        flat_out[generated] -= presence[row] + frequency[row] * counts
    return out


def _has_penalty(spec: SamplingSpec) -> bool:
    return (
        spec.repetition_penalty != 1.0
        or spec.presence_penalty != 0.0
        or spec.frequency_penalty != 0.0
    )


# -------------------------------------------------------------------------------- filters

# Top-p looks for the nucleus among each row's best 64 tokens, then 1,024, then all of them
# (a flat distribution), each stage only for the rows the previous one did not settle.
_NUCLEUS_STAGES = (64, 1024)
# exp() of a float32 below about -87 is subnormal, which runs tens of times slower on x86.
# Scaled logits are floored at _EXP_FLOOR before exp(), and weights up to twice exp(floor)
# count as zero: a token e^79 times less likely than the top one is never drawn.
_EXP_FLOOR = -80.0
_NEGLIGIBLE_WEIGHT = 2 * math.exp(_EXP_FLOOR)


def apply_filters(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """(logits - row max) / temperature, with every token the row's filters drop at -inf.

    The shift leaves softmax unchanged and puts the top token at 0. In order, each filter on
    what the previous one kept: top_k keeps the tokens whose logit is at least the k-th
    largest (ties at the boundary all stay, as in transformers); top_p keeps the shortest run
    of tokens, best first (lower id first on ties), whose probability reaches top_p, so
    always the top token; min_p drops tokens whose probability is below min_p times the top
    token's. All rows must have temperature > 0.
    """
    kept = _filter(logits, specs)
    z = kept.scaled.masked_fill_(kept.scaled < kept.limit[:, None], -math.inf)
    if kept.crowded_rows.numel():
        rows = kept.crowded_rows
        z[rows] = z[rows].masked_fill_(~kept.crowded_keep, -math.inf)
    return z


def filtered_weights(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """exp(apply_filters(logits, specs)): each row's filtered distribution scaled so that its
    top token weighs 1, with weights below 2 * exp(_EXP_FLOOR) set to 0."""
    kept = _filter(logits, specs)
    z = kept.scaled
    if bool((kept.limit <= _EXP_FLOOR).all()):
        z = z.clamp_(min=_EXP_FLOOR)
    else:
        z = torch.where(z >= kept.limit.clamp(min=_EXP_FLOOR)[:, None], z, _EXP_FLOOR)
    weights = torch.nn.functional.threshold(z.exp_(), _NEGLIGIBLE_WEIGHT, 0.0, inplace=True)
    if kept.crowded_rows.numel():
        rows = kept.crowded_rows
        weights[rows] = weights[rows].masked_fill_(~kept.crowded_keep, 0.0)
    return weights


@dataclass(frozen=True)
class _Kept:
    """What the filters keep of each row: every token whose scaled logit is >= limit, and in
    `crowded_rows` (top-p ties cut in the middle) only the tokens of `crowded_keep` as well."""

    scaled: torch.Tensor  # (rows, vocab): (logits - row max) / temperature
    limit: torch.Tensor  # (rows,)
    crowded_rows: torch.Tensor  # (num_crowded,) int64
    crowded_keep: torch.Tensor  # (num_crowded, vocab) bool


def _filter(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> _Kept:
    num_rows, vocab_size = logits.shape
    device = logits.device
    temperature = torch.tensor([spec.temperature for spec in specs], device=device)
    z = logits - logits.amax(dim=-1, keepdim=True)
    z /= temperature[:, None]  # (rows, vocab), <= 0
    limit = torch.full((num_rows,), -math.inf, device=device)
    crowded_rows = torch.zeros(0, dtype=torch.int64, device=device)
    crowded_keep = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    top_k = [spec.top_k if 0 < spec.top_k < vocab_size else 0 for spec in specs]
    ranked = [i for i in range(num_rows) if top_k[i] or specs[i].top_p < 1.0]
    if ranked:
        # one topk serves both: the k-th value for top_k, the first candidates for top_p
        ranked_t = _index(ranked, device)
        num_candidates = min(vocab_size, max(_NUCLEUS_STAGES[0], *top_k))
        candidates = z[ranked_t].topk(num_candidates, dim=-1).values  # (ranked, candidates)
        kth = torch.full((len(ranked),), -math.inf, device=device)
        if any(top_k):
            ks = torch.tensor([top_k[i] for i in ranked], device=device)
            kth = candidates.gather(1, (ks - 1).clamp(min=0)[:, None]).squeeze(1)
            kth[ks == 0] = -math.inf
            candidates.masked_fill_(candidates < kth[:, None], -math.inf)
            limit[ranked_t] = kth
        nucleus = [j for j, i in enumerate(ranked) if specs[i].top_p < 1.0]
        if nucleus:
            nucleus_t = _index(nucleus, device)
            top_p = torch.tensor([specs[ranked[j]].top_p for j in nucleus], device=device)
            boundary, crowded, crowded_keep = _nucleus(
                z, ranked_t[nucleus_t], candidates[nucleus_t], kth[nucleus_t], top_p
            )
            limit[ranked_t[nucleus_t]] = boundary  # >= kth
            crowded_rows = ranked_t[nucleus_t][crowded]

    if any(spec.min_p for spec in specs):
        # p_i < min_p * p_max  <=>  z_i < log(min_p), as z_max = 0
        log_min_p = [math.log(spec.min_p) if spec.min_p else -math.inf for spec in specs]
        limit = torch.maximum(limit, torch.tensor(log_min_p, device=device))
    return _Kept(z, limit, crowded_rows, crowded_keep)


def _nucleus(
    z: torch.Tensor,
    rows: torch.Tensor,
    candidates: torch.Tensor,
    kth: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The nucleus of z[rows] after top-k (kth: the rows' top-k limits, -inf if none), given
    the rows' best `candidates` (best first, top-k applied).

    Returns per row the scaled logit of its last kept token, whether ties at that value must
    be cut (more of them than room), and for those rows the exact mask of kept tokens.
    """
    vocab_size = z.shape[1]
    # the normaliser: from the candidates when they hold every top-k survivor, else the row
    total = candidates.clamp(min=_EXP_FLOOR).exp_().sum(dim=-1)
    partial = (candidates[:, -1] > -math.inf).nonzero().squeeze(1)
    if partial.numel():
        z_rows = z[rows[partial]]
        floor = kth[partial].clamp(min=_EXP_FLOOR)[:, None]
        total[partial] = torch.where(z_rows >= floor, z_rows, _EXP_FLOOR).exp_().sum(dim=-1)

    num_kept = torch.zeros(len(rows), dtype=torch.int64, device=z.device)
    boundary = torch.zeros(len(rows), device=z.device)
    crowded = torch.zeros(len(rows), dtype=torch.bool, device=z.device)
    pending = torch.arange(len(rows), device=z.device)
    while True:
        num_candidates = candidates.shape[1]
        probs = candidates.clamp(min=_EXP_FLOOR).exp_() / total[pending, None]
        mass = probs.cumsum(dim=-1)
        mass_before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)
        kept = ((mass_before < top_p[pending, None]) & (candidates > -math.inf)).sum(dim=-1)
        settled = (kept < num_candidates) | (mass[:, -1] >= top_p[pending])
        if num_candidates == vocab_size:
            settled[:] = True
        done = pending[settled]
        num_kept[done] = kept[settled]
        last = candidates[settled].gather(1, kept[settled, None] - 1)  # (done, 1)
        boundary[done] = last.squeeze(1)
        # more tokens tied with the last kept one than room left (or maybe past the candidates)
        tied = (candidates[settled] == last).sum(dim=-1)
        above = (candidates[settled] > last).sum(dim=-1)
        reaches_end = (candidates[settled, -1] == last.squeeze(1)) & (num_candidates < vocab_size)
        crowded[done] = (tied > kept[settled] - above) | reaches_end
        pending = pending[~settled]
        if pending.numel() == 0:
            break
        next_stage = min(k for k in (*_NUCLEUS_STAGES, vocab_size) if k > num_candidates)
        candidates = z[rows[pending]].topk(min(next_stage, vocab_size), dim=-1).values
        candidates.masked_fill_(candidates < kth[pending, None], -math.inf)

    keep = _best_n_mask(z[rows[crowded]], num_kept[crowded], boundary[crowded, None])
    return boundary, crowded, keep


def _best_n_mask(x: torch.Tensor, n: torch.Tensor, nth_value: torch.Tensor) -> torch.Tensor:
    """Mask of each row's n best entries ordered by (value desc, index asc); nth_value (rows, 1)
    is the value of the n-th of them."""
    above = x > nth_value
    tied = x == nth_value
    rank = tied.cumsum(dim=-1)
    return above | (tied & (rank <= (n - above.sum(dim=-1))[:, None]))


# ------------------------------------------------------------------------------- logprobs


def _with_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, specs: Sequence[SamplingSpec]
) -> SamplerOutput:
    # One fused kernel, which on CPU costs less than logsumexp (amax, sub, exp, sum) alone.
    logprobs = torch.log_softmax(raw, dim=-1)  # (rows, vocab)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    num_top = [spec.num_top_logprobs for spec in specs]
    top_ids: list[list[int]] = [[] for _ in specs]
    top_values: list[list[float]] = [[] for _ in specs]
    if any(num_top):
        rows = [i for i, k in enumerate(num_top) if k]
        ids, values = _top_entries(logprobs[_index(rows, raw.device)], max(num_top))
        for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            top_ids[i] = row_ids[: num_top[i]]
            top_values[i] = row_values[: num_top[i]]
    return SamplerOutput(token_ids.tolist(), chosen.tolist(), top_ids, top_values)


def _top_entries(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest entries as (indices, values), largest first, lower index first
    on ties (torch.topk alone promises neither which tied entries it takes nor their order)."""
    vocab_size = x.shape[1]
    values, ids = x.topk(min(k + 1, vocab_size), dim=-1)
    kth = values[:, k - 1 : k]
    if k < vocab_size:
        # the (k+1)-th equal to the k-th: ties straddle the cut, so topk's pick is arbitrary
        crowded = (values[:, k] == kth[:, 0]).nonzero().squeeze(1)
        values, ids = values[:, :k], ids[:, :k]
        if crowded.numel():
            n = torch.full((crowded.numel(),), k, dtype=torch.int64, device=x.device)
            keep = _best_n_mask(x[crowded], n, kth[crowded])
            ids[crowded] = keep.nonzero()[:, 1].view(-1, k)
    ids = ids.sort(dim=-1).values
    values, order = x.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return ids.gather(1, order), values


# ---------------------------------------------------------------------------------- misc


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _check_spec(spec: SamplingSpec, vocab_size: int) -> None:
    problem = None
    if not spec.temperature >= 0.0:
        problem = f"temperature must be >= 0, got {spec.temperature}"
    elif spec.top_k < 0:
        problem = f"top_k must be >= 0, got {spec.top_k}"
    elif not 0.0 < spec.top_p <= 1.0:
        problem = f"top_p must be in (0, 1], got {spec.top_p}"
    elif not 0.0 <= spec.min_p <= 1.0:
        problem = f"min_p must be in [0, 1], got {spec.min_p}"
    elif not spec.repetition_penalty > 0.0:
        problem = f"repetition_penalty must be > 0, got {spec.repetition_penalty}"
    elif not 0 <= spec.num_top_logprobs <= vocab_size:
        problem = f"num_top_logprobs must be in [0, {vocab_size}], got {spec.num_top_logprobs}"
    if problem is not None:
        raise ValueError(f"bad SamplingSpec: {problem}")
