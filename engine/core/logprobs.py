"""Logprob entries: what a request asking for `logprobs=k` gets per output token.

A row's entry is `{chosen token: its value, top-1: value, ...}` -- the chosen token first, then the
row's top-k in descending order (the chosen one is not repeated). The values are the raw logits or
the processed ones the sampler drew from, as log-softmax or as they are, by the engine's
`logprobs_mode`. They are computed on the device for every row of a forward at once and read back
with the picks (`engine.core.sampler.PickedOnHost`); a row with an allowed set (typed decisions)
ranks only its allowed ids.
"""

from __future__ import annotations

import torch

from engine.core.sampler import within_allowed


def logprob_values(values: torch.Tensor, chosen: torch.Tensor, k: int, mode: str | None,
                   allowed: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(value of each row's chosen token, top-k values, top-k ids), on the values' device.

    `values` are the raw logits (modes raw_*) or the processed logits the sampler drew from (modes
    processed_*); *_logits modes report them as they are, the others their log_softmax. `allowed`
    (rows, their `allowed_mask`): the top-k of those rows ranks only their allowed ids (past a set
    smaller than k the ids come back as -1, which `logprob_entries` drops)."""
    rows = values.float()
    if mode not in ("raw_logits", "processed_logits"):
        rows = rows.log_softmax(-1)
    chosen_v = rows.gather(1, chosen[:, None])[:, 0]
    if k == 0:
        return chosen_v, None, None
    if allowed is None:
        top_v, top_i = rows.topk(k, dim=-1)
        return chosen_v, top_v, top_i
    at, keep = allowed
    ranked = within_allowed(rows, allowed)
    top_v, top_i = ranked.topk(min(k, rows.shape[-1]), dim=-1)
    outside = ~keep.gather(1, top_i.index_select(0, at))  # a set smaller than k: the rest of its top-k
    top_i = top_i.index_copy(0, at, top_i.index_select(0, at).masked_fill(outside, -1))
    return chosen_v, top_v, top_i


def logprob_entries(chosen: list[int], ks: list[int | None], chosen_v: list[float],
                    top_v: list[list[float]] | None, top_i: list[list[int]] | None) -> list[dict[int, float] | None]:
    """Per row: None when not requested, else {chosen: value, top-1: value, ...}, from the lists of
    `logprob_values` computed for every row (top-k with the largest k any row asked for)."""
    out: list[dict[int, float] | None] = [None] * len(chosen)
    for i, k in enumerate(ks):
        if k is None:
            continue
        entry = {chosen[i]: chosen_v[i]}
        if k:
            for v, t in zip(top_v[i][:k], top_i[i][:k]):
                if t >= 0:  # -1: past the row's allowed set
                    entry.setdefault(t, v)
        out[i] = entry
    return out


def token_logprobs(rows: torch.Tensor, indices: list[int], tokens: list[int], k: int | None, mode: str | None
                   ) -> list[dict[int, float] | None]:
    """The logprob entries (as `logprob_entries` makes them) of `tokens[i]` in row `indices[i]` of the
    raw logits `rows`, for a rule that writes tokens other than the sampler's picks. Processed modes
    read the raw rows too: valid for greedy rows without processors, the only ones such a rule has."""
    if k is None or not tokens:
        return [None] * len(tokens)
    chosen = torch.tensor(tokens, device=rows.device)
    chosen_v, top_v, top_i = logprob_values(rows[torch.tensor(indices, device=rows.device)], chosen, k, mode)
    return logprob_entries(tokens, [k] * len(tokens), chosen_v.tolist(),
                           None if top_v is None else top_v.tolist(), None if top_i is None else top_i.tolist())
