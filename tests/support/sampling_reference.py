"""The sampling distribution written out independently of the engine's sampler, for tests that check
processed logprobs (generation's and trajectory scoring's)."""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, history: set[int], p: dict) -> torch.Tensor:
    """The sampling distribution, written out independently: repetition penalty, temperature, top-k,
    top-p (smallest prefix reaching p, top token always kept), min-p; log-probabilities."""
    x = logits.double().clone()
    ids = torch.tensor(sorted(history))
    x[ids] = torch.where(x[ids] > 0, x[ids] / p["repetition_penalty"], x[ids] * p["repetition_penalty"])
    x = x / p["temperature"]
    kth = torch.sort(x, descending=True).values[p["top_k"] - 1]
    x[x < kth] = float("-inf")
    probs = x.softmax(-1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0) - probs[order]
    drop = order[cum >= p["top_p"]]
    x[drop[drop != order[0]]] = float("-inf")
    probs = x.softmax(-1)
    x[probs < p["min_p"] * probs.max()] = float("-inf")
    return x.log_softmax(-1)
