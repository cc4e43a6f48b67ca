"""Pick the next token of every sampling row: penalties, greedy or filtered sampling, logprobs.

One call per step, vectorized over rows; Python loops run over rows only (to read the specs
and histories), never over the vocabulary.

    raw logits ──► penalties ──┬─ temperature 0 ───────────────────────────► argmax
      │                        └─ / temperature ─► top-k ─► top-p ─► min-p ─► race
      └─► log_softmax ─► chosen logprob, top logprobs      (always the raw distribution)

Randomness is counter-based: a row's draw depends only on (seed, position) and its filtered
distribution, never on the batch around it nor on torch's global generator. The draw is an
exponential race, argmax_i(w_i / E_i) with E_i ~ Exp(1) hashed from (seed, position, token
id), which picks token i with probability w_i / sum(w). It runs in two rounds so that only
O(sqrt(vocab)) noise values are hashed per row instead of one per token:

    weights (vocab) ─► buckets of bucket_size tokens ─► race the bucket masses ─► bucket b
                                                       race the tokens of b   ─► token
    P(token) = mass_b / total * w_token / mass_b = w_token / total
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.ipc.protocol import SamplingSpec

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_BUCKET_STREAM = 1  # noise streams of one row: the bucket round and the token round
_TOKEN_STREAM = 2
_MAX_BUCKET_SIZE = 256  # ~sqrt(vocab) for the vocabularies in use
# Top-p looks for the nucleus among the best 1,024 tokens first and sorts the whole row only
# when the nucleus is larger (a flat distribution).
_TOP_P_CANDIDATES = 1024


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
            filtered = apply_filters(sampled_logits, sampled_specs)
            keys = [row_key(specs[i].seed, len(histories[i])) for i in sampled_rows]
            token_ids[sampled_idx] = race(filtered, keys)

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
    only): logit -= presence * (count > 0) + frequency * count.
    """
    rows = [i for i, spec in enumerate(specs) if _has_penalty(spec)]
    if not rows:
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    lengths = [len(histories[i]) for i in rows]
    flat_ids = torch.tensor(
        list(itertools.chain.from_iterable(histories[i] for i in rows)), dtype=torch.int64
    ).to(device)
    if flat_ids.numel() and not 0 <= int(flat_ids.min()) <= int(flat_ids.max()) < vocab_size:
        raise ValueError(f"history token ids must be in [0, {vocab_size})")
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths_t)
    flat_index = row_of * vocab_size + flat_ids  # (total_len,) into the (rows, vocab) block

    if len(rows) == len(specs):
        out = logits.clone(memory_format=torch.contiguous_format)
    else:
        out = logits[_index(rows, device)]  # (rows, vocab), a contiguous copy
    flat_out = out.view(-1)
    repetition = [specs[i].repetition_penalty for i in rows]
    if any(p != 1.0 for p in repetition):
        penalty = torch.tensor(repetition, device=device)[row_of]
        seen = flat_out[flat_index]  # gathered before any write: once per token, not per use
        flat_out[flat_index] = torch.where(seen < 0, seen * penalty, seen / penalty)

    presence = [specs[i].presence_penalty for i in rows]
    frequency = [specs[i].frequency_penalty for i in rows]
    if any(presence) or any(frequency):
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        pos_in_row = torch.arange(flat_ids.numel(), device=device) - starts[row_of]
        prompt_lens = torch.tensor([num_prompt_tokens[i] for i in rows], device=device)
        generated = flat_index[pos_in_row >= prompt_lens[row_of]]
        counts = torch.zeros(out.numel(), device=device)
        counts.index_add_(0, generated, torch.ones(generated.numel(), device=device))
        counts = counts.view_as(out)  # (rows, vocab)
        presence_t = torch.tensor(presence, device=device)[:, None]
        frequency_t = torch.tensor(frequency, device=device)[:, None]
        out -= presence_t * (counts > 0) + frequency_t * counts

    if len(rows) == len(specs):
        return out
    result = logits.clone()
    result[_index(rows, device)] = out
    return result


def _has_penalty(spec: SamplingSpec) -> bool:
    return (
        spec.repetition_penalty != 1.0
        or spec.presence_penalty != 0.0
        or spec.frequency_penalty != 0.0
    )


# -------------------------------------------------------------------------------- filters


def apply_filters(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """Temperature-scaled logits with every token a row's filters drop set to -inf.

    In order, each on what the previous one kept: top_k keeps the tokens whose logit is at
    least the k-th largest (ties at the boundary all stay, as in transformers); top_p keeps
    the shortest run of tokens, best first (lower id first on ties), whose probability reaches
    top_p, so always the top token; min_p drops tokens whose probability is below min_p times
    the top token's. All rows must have temperature > 0.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = torch.tensor([spec.temperature for spec in specs], device=device)
    x = logits / temperature[:, None]  # (rows, vocab), a new tensor filtered in place

    top_k = [spec.top_k if 0 < spec.top_k < vocab_size else 0 for spec in specs]
    if any(top_k):
        rows = _index([i for i, k in enumerate(top_k) if k], device)
        ks = torch.tensor([k for k in top_k if k], device=device)
        kth = x[rows].topk(int(ks.max()), dim=-1).values.gather(1, ks[:, None] - 1)
        threshold = torch.full((len(specs), 1), -math.inf, device=device)
        threshold[rows] = kth
        x.masked_fill_(x < threshold, -math.inf)

    top_p = [spec.top_p for spec in specs]
    if any(p < 1.0 for p in top_p):
        rows = _index([i for i, p in enumerate(top_p) if p < 1.0], device)
        sub = x[rows]
        keep = _nucleus_mask(sub, torch.tensor([p for p in top_p if p < 1.0], device=device))
        x[rows] = sub.masked_fill_(~keep, -math.inf)

    min_p = [spec.min_p for spec in specs]
    if any(min_p):
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p)
        log_min_p = torch.tensor([math.log(p) if p else -math.inf for p in min_p], device=device)
        too_unlikely = x - x.amax(dim=-1, keepdim=True) < log_min_p[:, None]
        x.masked_fill_(too_unlikely, -math.inf)
    return x


def _nucleus_mask(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask of each row's nucleus: the best tokens until their probability reaches top_p.

    The nucleus is first looked for among the row's best `_TOP_P_CANDIDATES` tokens; rows
    whose candidates hold less than top_p are redone with the whole row.
    """
    num_rows, vocab_size = x.shape
    row_max = x.amax(dim=-1, keepdim=True)
    log_total = (x - row_max).exp_().sum(dim=-1, keepdim=True).log_() + row_max  # (rows, 1)
    num_kept = torch.zeros(num_rows, dtype=torch.int64, device=x.device)
    nth_value = torch.zeros(num_rows, 1, device=x.device)
    pending = torch.arange(num_rows, device=x.device)
    for num_candidates in (min(_TOP_P_CANDIDATES, vocab_size), vocab_size):
        values = x[pending].topk(num_candidates, dim=-1).values  # (pending, candidates), best first
        probs = (values - log_total[pending]).exp_()
        mass = probs.cumsum(dim=-1)
        mass_before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)
        kept = ((mass_before < top_p[pending, None]) & (values > -math.inf)).sum(dim=-1)
        found = (kept < num_candidates) | (mass[:, -1] >= top_p[pending])
        if num_candidates == vocab_size:
            found = torch.ones_like(found)
        done = pending[found]
        num_kept[done] = kept[found]
        nth_value[done] = values[found].gather(1, kept[found, None] - 1)
        pending = pending[~found]
        if pending.numel() == 0:
            break
    return _best_n_mask(x, num_kept, nth_value)


def _best_n_mask(x: torch.Tensor, n: torch.Tensor, nth_value: torch.Tensor) -> torch.Tensor:
    """Mask of each row's n best entries ordered by (value desc, index asc); nth_value (rows, 1)
    is the value of the n-th of them."""
    above = x > nth_value
    tied = x == nth_value
    num_tied_kept = n - above.sum(dim=-1)  # >= 1
    crowded = (tied.sum(dim=-1) > num_tied_kept).nonzero().squeeze(1)
    if crowded.numel():  # more ties than room: the lowest indices win
        rank = tied[crowded].cumsum(dim=-1)
        tied[crowded] &= rank <= num_tied_kept[crowded, None]
    return above | tied


# --------------------------------------------------------------------------------- random


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of one row's draw; any Python int seed is reduced to 64 bits first."""
    state = (_mix64_int(seed & _MASK64) + position * _GOLDEN) & _MASK64
    return _mix64_int(state)


def exponential_noise(keys: torch.Tensor, stream: int, ids: torch.Tensor) -> torch.Tensor:
    """E ~ Exp(1), float64, one per (key, id): splitmix64 of key + (stream << 32 | id) * golden.

    keys: (rows, 1) int64 (the 64-bit keys as two's complement); ids: (rows or 1, n) int64 in
    [0, 2**32). Every value lies in (0, 37], never 0 or infinite.
    """
    counter = ids + (stream << 32)
    uniform_bits = _mix64(keys + counter * _signed64(_GOLDEN))
    mantissa = _shift_right(uniform_bits, 12)  # 52 bits
    uniform = (mantissa.double() + 0.5) * 2.0**-52  # (2m + 1) / 2**53: exact, inside (0, 1)
    return uniform.log_().neg_()


def race(logits: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """Draw one token per row from softmax(logits) (-inf = never): an exponential race keyed
    by `keys` (see row_key), bucket masses first, then the tokens of the winning bucket."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    bucket_size = min(vocab_size, _MAX_BUCKET_SIZE)
    num_buckets = -(-vocab_size // bucket_size)
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()  # top token = 1
    padding = num_buckets * bucket_size - vocab_size
    if padding:
        weights = torch.nn.functional.pad(weights, (0, padding))
    buckets = weights.view(num_rows, num_buckets, bucket_size)
    key_t = torch.tensor([_signed64(k) for k in keys], dtype=torch.int64, device=device)[:, None]

    bucket_ids = torch.arange(num_buckets, device=device)[None, :]
    mass = buckets.sum(dim=-1)  # (rows, buckets)
    bucket = (mass / exponential_noise(key_t, _BUCKET_STREAM, bucket_ids)).argmax(dim=-1)

    members = buckets[torch.arange(num_rows, device=device), bucket]  # (rows, bucket_size)
    token_ids = bucket[:, None] * bucket_size + torch.arange(bucket_size, device=device)
    winner = (members / exponential_noise(key_t, _TOKEN_STREAM, token_ids)).argmax(dim=-1)
    return bucket * bucket_size + winner


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic wraps like uint64; only the right shifts need the sign bits masked off
    z = (z ^ _shift_right(z, 30)) * _signed64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed64(_MIX2)
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# ------------------------------------------------------------------------------- logprobs


def _with_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, specs: Sequence[SamplingSpec]
) -> SamplerOutput:
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
    values, ids = x.topk(k, dim=-1)
    kth = values[:, -1:]
    crowded = ((x == kth).sum(dim=-1) > (values == kth).sum(dim=-1)).nonzero().squeeze(1)
    if crowded.numel():
        n = torch.full((crowded.numel(),), k, dtype=torch.int64, device=x.device)
        mask = _best_n_mask(x[crowded], n, kth[crowded])
        ids[crowded] = mask.nonzero()[:, 1].view(-1, k)
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
