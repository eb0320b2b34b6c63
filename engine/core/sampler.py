"""Turning logits rows into tokens, confidences, entropies and logprob entries.

Order of processing (AR and block diffusion alike): logits processors that change what greedy picks
(repetition penalty, stop-id suppression before `min_new_tokens`), then -- only when sampling --
temperature, top-k, top-p and min-p filters. The candidate is drawn from (or is the argmax of) the
processed distribution and its confidence is its probability under that same distribution, so
block-diffusion unmasking ranks exactly what the sampler drew from.

Randomness is drawn on the host: the k-th draw of a request is a uniform number computed from
(its seed, k) by a counter-based generator, and the token is found by inverse-CDF on the device.
So a seeded request samples the same tokens whatever else is in the batch, after preemption, when
a step is re-run to isolate a failing request, and on CPU or GPU where the arithmetic agrees.

The filters always keep the most likely token: a top_p that underflows to 0, or min_p = 1, leaves
greedy decoding rather than an empty distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from configs import GenerationConfig
from ops.layers import row_max

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniforms(seed: int, first: int, count: int) -> list[float]:
    """Draws first .. first+count-1 of the stream named by `seed`: uniform in [0, 1), 53 bits each."""
    key = _splitmix64(seed & _MASK64)
    return [(_splitmix64((key + k) & _MASK64) >> 11) * 2.0**-53 for k in range(first, first + count)]


@dataclass
class RowGroup:
    """Consecutive logits rows that belong to one sequence and share its settings."""

    params: GenerationConfig
    seed: int
    first_draw: int  # index of this group's first random draw in its request's stream
    penalty_ids: list[int]  # tokens the repetition penalty looks at (sorted, unique)
    suppress: list[bool]  # per row: mask the stop ids (min_new_tokens not reached yet)
    stop_ids: frozenset[int]
    want_entropy: bool = False


@dataclass
class Picked:
    """Per row, on the logits' device: the token, its confidence (None when not needed: plain greedy
    AR), the entropy of the distribution (None unless a group asked; NaN for the others), and the
    processed logits the sampler drew from (when asked)."""

    tokens: torch.Tensor
    confidence: torch.Tensor | None
    entropy: torch.Tensor | None
    processed: torch.Tensor | None


def _penalize(logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """Repetition penalty and stop-id suppression, written over `logits` (index lists filtered on the
    host: no data-dependent shapes on the device)."""
    p = group.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0 and group.penalty_ids:
        ids = torch.tensor([i for i in group.penalty_ids if i < vocab], device=logits.device)
        picked = logits[:, ids]
        logits[:, ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    stop_ids = [i for i in group.stop_ids if i < vocab]
    if any(group.suppress) and stop_ids:
        rows = torch.tensor(group.suppress, device=logits.device)
        columns = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        columns[torch.tensor(stop_ids, device=logits.device)] = True
        logits.masked_fill_(rows[:, None] & columns[None, :], float("-inf"))
    return logits


def filter_for_sampling(logits: torch.Tensor, p: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks on [R, V] float logits. The most
    likely token always survives."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p  # keep the smallest prefix reaching top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def draw(probs: torch.Tensor, us: list[float]) -> torch.Tensor:
    """Inverse-CDF sampling: row r takes the first token whose cumulative probability exceeds
    us[r] times the row total (a token of probability 0 is never taken)."""
    cdf = probs.double().cumsum(-1)
    u = torch.tensor(us, dtype=torch.float64, device=probs.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats per row (0 * log 0 = 0)."""
    return torch.special.entr(probs).sum(-1)


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim written over `x` (the same values as `x.softmax(-1)`). Inference mode,
    because the runner's logits are inference tensors."""
    if not hasattr(torch, "_softmax"):
        return x.softmax(-1)
    with torch.inference_mode():
        return torch._softmax(x, -1, False, out=x)


def _is_plain_greedy(g: RowGroup) -> bool:
    return g.params.is_greedy and g.params.repetition_penalty == 1.0 and not any(g.suppress)


def pick_tokens(logits: torch.Tensor, groups: list[tuple[int, int, RowGroup]], need_confidence: bool = True,
                overwrite: bool = False, keep_processed: bool = False) -> Picked:
    """Candidates, confidences (and entropies / processed logits on request) for every row, as tensors
    on the logits' device. `groups` = (first row, row count, group).

    With `need_confidence=False` (AR decoding) plain greedy rows skip the softmax: the candidate is
    the argmax of the logits, as in HF `generate()`, and no confidence comes back.
    `overwrite=True` says the caller is done with `logits`: on CPU the softmax is then written over
    them instead of into a fresh rows x vocab tensor (same values, no page faults)."""
    logits = logits.float()
    want_entropy = any(g.want_entropy for _, _, g in groups)
    if all(_is_plain_greedy(g) for _, _, g in groups):  # the common case, batched
        processed = logits if keep_processed else None
        if not need_confidence and not want_entropy:
            return Picked(row_max(logits)[1], None, None, processed)
        in_place = overwrite and not keep_processed and logits.device.type == "cpu"
        probs = softmax_(logits) if in_place else logits.softmax(-1)
        conf, tok = row_max(probs)
        return Picked(tok, conf, entropy(probs) if want_entropy else None, processed)
    tokens, confidence, entropies = [], [], []
    processed = torch.empty_like(logits) if keep_processed else None
    for first, count, g in groups:
        rows = _penalize(logits[first : first + count].clone(), g)
        if not g.params.is_greedy:
            rows = filter_for_sampling(rows, g.params)
        if processed is not None:
            processed[first : first + count] = rows
        probs = rows.softmax(-1)
        if g.params.is_greedy:
            conf, tok = probs.max(-1)
        else:
            tok = draw(probs, uniforms(g.seed, g.first_draw, count))
            conf = probs.gather(-1, tok[:, None])[:, 0]
        tokens.append(tok)
        confidence.append(conf)
        entropies.append(entropy(probs) if g.want_entropy else torch.full_like(conf, float("nan")))
    return Picked(torch.cat(tokens), torch.cat(confidence), torch.cat(entropies) if want_entropy else None,
                  processed)


def logprob_values(values: torch.Tensor, chosen: torch.Tensor, k: int, mode: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(value of each row's chosen token, top-k values, top-k ids), on the values' device.

    `values` are the raw logits (modes raw_*) or the processed logits the sampler drew from (modes
    processed_*); *_logits modes report them as they are, the others their log_softmax."""
    rows = values.float()
    if mode not in ("raw_logits", "processed_logits"):
        rows = rows.log_softmax(-1)
    chosen_v = rows.gather(1, chosen[:, None])[:, 0]
    if k == 0:
        return chosen_v, None, None
    top_v, top_i = rows.topk(k, dim=-1)
    return chosen_v, top_v, top_i


def logprob_entries(values: torch.Tensor, chosen: list[int], ks: list[int | None], mode: str | None
                    ) -> list[dict[int, float] | None]:
    """Per row: None when not requested, else {chosen: value, top-1: value, ...}."""
    wanted = [i for i, k in enumerate(ks) if k is not None]
    out: list[dict[int, float] | None] = [None] * len(chosen)
    if not wanted:
        return out
    index = torch.tensor(wanted, device=values.device)
    picked = torch.tensor([chosen[i] for i in wanted], device=values.device)
    kmax = max(ks[i] for i in wanted)
    chosen_v, top_v, top_i = logprob_values(values[index], picked, kmax, mode)
    chosen_v = chosen_v.tolist()
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    for j, i in enumerate(wanted):
        entry = {chosen[i]: chosen_v[j]}
        k = ks[i]
        if k:
            for v, t in zip(top_v[j][:k], top_i[j][:k]):
                entry.setdefault(t, v)
        out[i] = entry
    return out
