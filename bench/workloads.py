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


def make_prompts(t: Traffic, vocab: int, avoid: set[int]) -> tuple[list[list[int]], list[int]]:
    """Random token-id prompts (ids anywhere in the vocabulary) and per-request output budgets."""
    rng = random.Random(t.seed)
    prompts, budgets = [], []
    for _ in range(t.num_requests):
        n = rng.randint(*t.prompt_len)
        prompt = []
        while len(prompt) < n:
            tok = rng.randrange(vocab)
            if tok not in avoid:
                prompt.append(tok)
        prompts.append(prompt)
        budgets.append(rng.randint(*t.max_new_tokens))
    return prompts, budgets


def scoring_inputs(num: int, length: int, vocab: int, avoid: set[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        seq = []
        while len(seq) < length:
            tok = rng.randrange(vocab)
            if tok not in avoid:
                seq.append(tok)
        out.append(seq)
    return out
