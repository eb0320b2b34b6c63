"""Turning logits rows into tokens, confidences and logprob entries.

Order of processing (both AR and DLLM): logits processors that change what greedy picks
(repetition penalty, stop-id suppression before `min_new_tokens`), then -- only when sampling --
temperature, top-k, top-p and min-p filters. The candidate is drawn from (or is the argmax of) the
processed distribution and its confidence is its probability under that same distribution, so
DLLM unmasking ranks exactly what the sampler drew from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from configs import GenerationConfig
from ops.layers import row_max


@dataclass
class RowGroup:
    """Consecutive logits rows that belong to one sequence and share its settings."""

    params: GenerationConfig
    generator: torch.Generator
    history: list[int]  # tokens the repetition penalty looks at
    suppress: list[bool]  # per row: mask the stop ids (min_new_tokens not reached yet)
    stop_ids: frozenset[int]


def _penalize(logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
    p = group.params
    if p.repetition_penalty != 1.0 and group.history:
        ids = torch.tensor(sorted(set(group.history)), device=logits.device)
        ids = ids[ids < logits.shape[-1]]
        picked = logits[:, ids]
        logits[:, ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if any(group.suppress) and group.stop_ids:
        rows = torch.tensor(group.suppress, device=logits.device)
        ids = torch.tensor(sorted(i for i in group.stop_ids if i < logits.shape[-1]), device=logits.device)
        logits[rows.nonzero()[:, 0][:, None], ids[None, :]] = float("-inf")
    return logits


def filter_for_sampling(logits: torch.Tensor, p: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks on [R, V] float logits."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim written over `x` (the same values as `x.softmax(-1)`). Inference mode,
    because the runner's logits are inference tensors."""
    if not hasattr(torch, "_softmax"):
        return x.softmax(-1)
    with torch.inference_mode():
        return torch._softmax(x, -1, False, out=x)


def pick_tokens(logits: torch.Tensor, groups: list[tuple[int, int, RowGroup]],
                need_confidence: bool = True, overwrite: bool = False) -> tuple[list[int], list[float]]:
    """Candidates and confidences for every row. `groups` = (first row, row count, group).

    With `need_confidence=False` (AR decoding) plain greedy rows skip the softmax: the candidate is
    the argmax of the logits, as in HF `generate()`, and the confidence list comes back empty.
    `overwrite=True` says the caller is done with `logits`: on CPU the softmax is then written over
    them instead of into a fresh rows x vocab tensor (same values, no page faults)."""
    logits = logits.float()
    plain_greedy = all(
        g.params.is_greedy and g.params.repetition_penalty == 1.0 and not any(g.suppress)
        for _, _, g in groups
    )
    if plain_greedy and not need_confidence:
        return row_max(logits)[1].tolist(), []
    if plain_greedy:  # the common case, one batched op
        probs = softmax_(logits) if overwrite and logits.device.type == "cpu" else logits.softmax(-1)
        conf, tok = row_max(probs)
        return tok.tolist(), conf.tolist()
    tokens: list[int] = []
    confidence: list[float] = []
    for first, count, g in groups:
        rows = _penalize(logits[first : first + count].clone(), g)
        if g.params.is_greedy:
            conf, tok = rows.softmax(-1).max(-1)
            tokens += tok.tolist()
            confidence += conf.tolist()
            continue
        probs = filter_for_sampling(rows, g.params).softmax(-1)
        for r in range(count):
            t = int(torch.multinomial(probs[r], 1, generator=g.generator))
            tokens.append(t)
            confidence.append(float(probs[r, t]))
    return tokens, confidence


def logprob_entries(
    raw_logits: torch.Tensor, chosen: list[int], ks: list[int | None], mode: str | None
) -> list[dict[int, float] | None]:
    """Per row: None when not requested, else {chosen: value, top-1: value, ...} (CONTRACT.md §2).

    mode `raw_logits` reports raw logits; `raw_logprobs` (and None) log_softmax of raw logits.
    """
    wanted = [i for i, k in enumerate(ks) if k is not None]
    out: list[dict[int, float] | None] = [None] * len(chosen)
    if not wanted:
        return out
    values = raw_logits[wanted].float()
    if mode != "raw_logits":
        values = values.log_softmax(-1)
    kmax = max(ks[i] for i in wanted)
    top_v, top_i = (values.topk(kmax, dim=-1) if kmax > 0 else (None, None))
    chosen_v = values.gather(1, torch.tensor([chosen[i] for i in wanted])[:, None])[:, 0].tolist()
    for j, i in enumerate(wanted):
        entry = {chosen[i]: chosen_v[j]}
        k = ks[i]
        if k:
            for v, t in zip(top_v[j, :k].tolist(), top_i[j, :k].tolist()):
                entry.setdefault(t, v)
        out[i] = entry
    return out
