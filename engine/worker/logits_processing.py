"""The processing that turns a raw logits row into the distribution the sampler draws from, written
one group of rows at a time, in the worker layer so the runner can apply it to scored rows without
their logits ever leaving the device (trajectory scoring in processed modes). The sampler
(engine.core.sampler) does the same arithmetic batched over every row at once; its tests check it
row for row against these functions, so scored rows get exactly the values the sampler logged.

Order (as the sampler applies it): repetition penalty and stop-id suppression, then -- only when
sampling -- temperature, top-k, top-p and min-p.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from configs import GenerationConfig


def penalize_(logits: torch.Tensor, repetition_penalty: float, penalty_ids: Sequence[int], suppress: Sequence[bool],
              stop_ids: Collection[int]) -> torch.Tensor:
    """Repetition penalty over `penalty_ids` and, on the rows flagged in `suppress`, the stop ids set
    to -inf; written over `logits` (index lists filtered on the host: no data-dependent shapes on
    the device)."""
    vocab = logits.shape[-1]
    if repetition_penalty != 1.0 and penalty_ids:
        ids = torch.tensor([i for i in penalty_ids if i < vocab], device=logits.device)
        picked = logits[:, ids]
        logits[:, ids] = torch.where(picked > 0, picked / repetition_penalty, picked * repetition_penalty)
    stop = [i for i in stop_ids if i < vocab]
    if any(suppress) and stop:
        rows = torch.tensor(list(suppress), device=logits.device)
        columns = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        columns[torch.tensor(stop, device=logits.device)] = True
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
