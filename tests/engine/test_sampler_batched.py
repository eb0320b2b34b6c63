"""The batched sampler against the per-group loop it replaced, bit for bit.

`pick_tokens` used to process one group of rows (one sequence's settings) at a time; it now
processes the whole batch with per-row settings. `per_group` below is that loop as it was, on the
same logits processors (engine.worker.logits_processing), so every seeded token, confidence, entropy
and processed logit must come out identical -- on random batches mixing greedy rows, penalties,
stop-id suppression and every sampling filter.
"""

from __future__ import annotations

import random

import pytest
import torch

from configs import GenerationConfig
from engine.core.sampler import Picked, RowGroup, entropy, pick_tokens, uniforms
from engine.worker.logits_processing import filter_for_sampling, penalize_

VOCAB = 500


def old_draw(probs: torch.Tensor, us: list[float]) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    u = torch.tensor(us, dtype=torch.float64, device=probs.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


def per_group(logits: torch.Tensor, groups: list[tuple[int, int, RowGroup]]) -> Picked:
    """The sampler's loop before batching (its non-plain-greedy path), verbatim."""
    logits = logits.float()
    want_entropy = any(g.want_entropy for _, _, g in groups)
    tokens, confidence, entropies = [], [], []
    processed = torch.empty_like(logits)
    for first, count, g in groups:
        p = g.params
        rows = penalize_(logits[first : first + count].clone(), p.repetition_penalty, g.penalty_ids, g.suppress,
                         g.stop_ids)
        if not p.is_greedy:
            rows = filter_for_sampling(rows, p)
        processed[first : first + count] = rows
        probs = rows.softmax(-1)
        if p.is_greedy:
            conf, tok = probs.max(-1)
        else:
            tok = old_draw(probs, uniforms(g.seed, g.first_draw, count))
            conf = probs.gather(-1, tok[:, None])[:, 0]
        tokens.append(tok)
        confidence.append(conf)
        entropies.append(entropy(probs) if g.want_entropy else torch.full_like(conf, float("nan")))
    return Picked(torch.cat(tokens), torch.cat(confidence), torch.cat(entropies) if want_entropy else None,
                  processed)


def random_params(rng: random.Random) -> GenerationConfig:
    kind = rng.choice(["greedy", "greedy_penalty", "sampled", "top_k", "top_p", "min_p", "all", "tiny_top_p"])
    penalty = rng.choice([1.0, 1.3, 0.8]) if kind != "greedy" else 1.0
    if kind in ("greedy", "greedy_penalty"):
        return GenerationConfig(repetition_penalty=penalty)
    return GenerationConfig(
        do_sample=True, repetition_penalty=penalty, temperature=rng.choice([1.0, 0.7, 1.3, 0.05]),
        top_k=rng.choice([1, 5, 40, VOCAB + 3]) if kind in ("top_k", "all") else 0,
        top_p=(rng.choice([0.5, 0.9, 0.99]) if kind in ("top_p", "all") else 5e-324 if kind == "tiny_top_p"
               else 1.0),
        min_p=rng.choice([0.01, 0.2, 1.0]) if kind in ("min_p", "all") else 0.0)


def random_batch(seed: int) -> tuple[torch.Tensor, list[tuple[int, int, RowGroup]]]:
    rng = random.Random(seed)
    groups, first = [], 0
    for _ in range(rng.randint(1, 9)):
        count = rng.choice([1, 1, 4, 8])
        penalty_ids = sorted(rng.sample(range(VOCAB + 20), rng.randint(0, 30)))  # a few past the vocabulary
        groups.append((first, count, RowGroup(
            random_params(rng), seed=rng.randrange(1 << 62), first_draw=rng.randrange(1000), penalty_ids=penalty_ids,
            suppress=[rng.random() < 0.5 for _ in range(count)], stop_ids=frozenset(rng.sample(range(VOCAB), 3)),
            want_entropy=rng.random() < 0.5)))
        first += count
    g = torch.Generator().manual_seed(seed)
    return torch.randn(first, VOCAB, generator=g) * rng.choice([1.0, 4.0]), groups


def assert_identical(got: Picked, want: Picked) -> None:
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.confidence, want.confidence)
    assert (got.entropy is None) == (want.entropy is None)
    if want.entropy is not None:
        assert torch.equal(got.entropy.isnan(), want.entropy.isnan())
        assert torch.equal(got.entropy.nan_to_num(), want.entropy.nan_to_num())
    assert torch.equal(got.processed, want.processed)


@pytest.mark.parametrize("seed", range(40))
def test_batched_equals_the_per_group_loop(seed):
    logits, groups = random_batch(seed)
    if all(g.params.is_greedy and g.params.repetition_penalty == 1.0 and not any(g.suppress) for *_, g in groups):
        pytest.skip("plain greedy: the unchanged fast path")
    assert_identical(pick_tokens(logits, groups, keep_processed=True), per_group(logits, groups))


@pytest.mark.parametrize("seed", range(10))
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(seed):
    logits, groups = random_batch(seed)
    together = pick_tokens(logits, groups, keep_processed=True)
    for first, count, g in groups:
        alone = pick_tokens(logits[first : first + count], [(0, count, g)], keep_processed=True)
        if g.params.is_greedy and g.params.repetition_penalty == 1.0 and not any(g.suppress):
            continue  # the fast path for a plain greedy batch skips the processing
        assert torch.equal(alone.tokens, together.tokens[first : first + count])
        assert torch.equal(alone.confidence, together.confidence[first : first + count])


def test_groups_in_any_row_order():
    """Groups need not list the logits rows in order: outputs follow the groups."""
    logits, groups = random_batch(3)
    assert len(groups) > 1
    backwards = list(reversed(groups))
    assert_identical(pick_tokens(logits, backwards, keep_processed=True), per_group(logits, backwards))
