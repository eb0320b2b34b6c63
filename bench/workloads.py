"""Synthetic traffic: mixed prompt lengths, mixed output budgets, stop ids from the checkpoint."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range
    max_new_tokens: tuple[int, int]
    seed: int = 0


def _random_ids(rng: random.Random, n: int, vocab: int, avoid: set[int]) -> list[int]:
    """n token ids drawn uniformly from the vocabulary, none of them in `avoid`."""
    out: list[int] = []
    while len(out) < n:
        tok = rng.randrange(vocab)
        if tok not in avoid:
            out.append(tok)
    return out


def make_prompts(t: Traffic, vocab: int, avoid: set[int]) -> tuple[list[list[int]], list[int]]:
    """Random token-id prompts (ids anywhere in the vocabulary) and per-request output budgets."""
    rng = random.Random(t.seed)
    prompts, budgets = [], []
    for _ in range(t.num_requests):
        prompts.append(_random_ids(rng, rng.randint(*t.prompt_len), vocab, avoid))
        budgets.append(rng.randint(*t.max_new_tokens))
    return prompts, budgets


def scoring_inputs(num: int, length: int, vocab: int, avoid: set[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [_random_ids(rng, length, vocab, avoid) for _ in range(num)]
