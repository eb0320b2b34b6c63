"""Turning logits rows into tokens, confidences, entropies and logprob entries.

Order of processing (AR and block diffusion alike): logits processors that change what greedy picks
(repetition penalty, token editing's λ penalty, stop-id suppression before `min_new_tokens`), then
-- only when sampling -- temperature, top-k, top-p and min-p filters. The candidate is drawn from
(or is the argmax of) the processed distribution and its confidence is its probability under that
same distribution, so block-diffusion unmasking ranks exactly what the sampler drew from.

Randomness is drawn on the host: the k-th draw of a request is a uniform number computed from
(its seed, k) by a counter-based generator, and the token is found by inverse-CDF on the device.
So a seeded request samples the same tokens whatever else is in the batch, after preemption, when
a step is re-run to isolate a failing request, and on CPU or GPU where the arithmetic agrees.

The filters always keep the most likely token: a top_p that underflows to 0, or min_p = 1, leaves
greedy decoding rather than an empty distribution.

The batch is processed at once (on the CPU a few rows at a time, for the cache), every setting a
per-row column (greedy rows: temperature 1 and every filter off), with the same per-row arithmetic as
one group at a time: a row's values are identical to what it would get alone. Top-k takes one `topk`
of the batch's largest k, never a sort; top-p sorts only the rows that ask for it.
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


@dataclass(slots=True)
class RowGroup:
    """Consecutive logits rows that belong to one sequence and share its settings."""

    params: GenerationConfig
    seed: int
    first_draw: int  # index of this group's first random draw in its request's stream
    penalty_ids: list[int]  # tokens the repetition penalty looks at (sorted, unique)
    suppress: list[bool]  # per row: mask the stop ids (min_new_tokens not reached yet); empty: no row
    stop_ids: frozenset[int]
    want_entropy: bool = False
    #: token editing's λ penalty: (amount, per row the token whose logit is lowered by it, -1 for none)
    lowered: tuple[float, list[int]] | None = None
    #: the rows' raw logits go back to the strategy beside the picks (a rule that reads them itself)
    want_logits: bool = False
    #: per row the ids it may take (None: any); every other logit is set to -inf before the row is read
    #: (typed decisions' allowed sets); None: no row of the group has a set
    allowed: list[list[int] | None] | None = None
    #: served again at its sequence's later steps (`steady_group` held when it was kept): plain greedy
    steady: bool = False


def steady_group(group: RowGroup, request: GenerationConfig) -> bool:
    """Whether `group` may serve its sequence's later steps as it is: the request's own settings (not a
    step's override of them), greedy rows over the raw logits (no draw, so its stale `first_draw` is
    never read; no penalty, no suppressed row, no λ, no allowed set), whose only per-step inputs were
    the positions, which none of its fields then depends on."""
    p = group.params
    return (p is request and p.is_greedy and p.repetition_penalty == 1.0 and not group.suppress
            and group.lowered is None and group.allowed is None)


@dataclass(slots=True)
class Picked:
    """Per row, on the logits' device: the token, its confidence (None when not needed: plain greedy
    AR), the entropy of the distribution (None unless a group asked; NaN for the others), the
    processed logits the sampler drew from (when asked), and the raw probability mass of the row's
    allowed set (None unless a row has one; NaN for the others)."""

    tokens: torch.Tensor
    confidence: torch.Tensor | None
    entropy: torch.Tensor | None
    processed: torch.Tensor | None
    label_mass: torch.Tensor | None = None


class PickedOnHost:
    """The tokens, confidences and entropies of a `Picked` -- and, when asked, the logprob values of
    `logprob_values` -- on their way to the host. On CUDA the copies are queued behind the sampler's
    kernels (non-blocking, into pinned memory) with an event, so the host can go on while the device
    computes; reading them waits for that event only."""

    def __init__(self, picked: Picked, logprobs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
                 | None = None):
        tensors = (picked.tokens, picked.confidence, picked.entropy, *(logprobs or (None, None, None)),
                   picked.label_mass)
        self._event = None
        if picked.tokens.device.type == "cuda":
            tensors = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in tensors)
            self._event = torch.cuda.Event()
            self._event.record()
        self._tensors = tensors
        self._lists: list[list | None] | None = None

    def _on_host(self) -> list[list | None]:
        """Every tensor as a Python list (None where absent), converted once."""
        if self._lists is None:
            if self._event is not None:
                self._event.synchronize()
            self._lists = [t.tolist() if t is not None else None for t in self._tensors]
        return self._lists

    def lists(self) -> tuple[list[int], list[float], list[float] | None]:
        """(tokens, confidences (empty when not computed), entropies or None), as Python lists."""
        tokens, confidence, ent = self._on_host()[:3]
        return tokens, confidence if confidence is not None else [], ent

    def logprob_lists(self) -> tuple[list[float] | None, list[list[float]] | None, list[list[int]] | None]:
        """(value of each row's chosen token, top-k values, top-k ids) as Python lists; all None when
        no row asked for logprobs."""
        chosen_v, top_v, top_i = self._on_host()[3:6]
        return chosen_v, top_v, top_i

    def label_mass(self) -> list[float] | None:
        """Per row the raw probability mass of its allowed set (NaN for a row without one); None when no
        row has a set."""
        return self._on_host()[6]


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


CPU_CHUNK_ROWS = 8  # rows per batched pass on the CPU


def _is_plain_greedy(g: RowGroup) -> bool:
    return (g.params.is_greedy and g.params.repetition_penalty == 1.0 and True not in g.suppress and g.lowered is None
            and g.allowed is None)


def allowed_mask(rows: list[int], sets: list[list[int]], vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows as a tensor, a [len(rows), vocab] mask True at each row's allowed ids)."""
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool)
    at = [r for r, ids in enumerate(sets) for _ in ids]
    keep[at, [i for ids in sets for i in ids]] = True
    return torch.tensor(rows, dtype=torch.long).to(device), keep.to(device)


def allowed_rows(logits: torch.Tensor, sets: list[list[int] | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of `logits` with an allowed set (`sets`, one entry per row, None: no set) and their
    `allowed_mask`; None when no row has one."""
    rows = [r for r, ids in enumerate(sets) if ids is not None]
    return allowed_mask(rows, [sets[r] for r in rows], logits.shape[-1], logits.device) if rows else None


def within_allowed(x: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`x` with every id outside each allowed row's set at -inf (`allowed`: the rows and their
    `allowed_mask`; None: `x` as it is). A copy: `x` itself is left alone."""
    if allowed is None:
        return x
    rows, keep = allowed
    return x.index_copy(0, rows, x.index_select(0, rows).masked_fill(~keep, float("-inf")))


def allowed_mass(raw: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per row of raw logits, the temperature-1 probability its allowed set (`keep`) holds."""
    return (raw.float().softmax(-1) * keep).sum(-1)


def pick_tokens(logits: torch.Tensor, groups: list[tuple[int, int, RowGroup]], need_confidence: bool = True,
                overwrite: bool = False, keep_processed: bool = False) -> Picked:
    """Candidates, confidences (and entropies / processed logits on request) for every row, as tensors
    on the logits' device. `groups` = (first row, row count, group).

    With `need_confidence=False` (AR decoding) plain greedy rows skip the softmax: the candidate is
    the argmax of the logits, as in HF `generate()`, and no confidence comes back.
    `overwrite=True` says the caller is done with `logits`: on CPU the softmax is then written over
    them instead of into a fresh rows x vocab tensor (same values, no page faults)."""
    logits = logits.float()
    want_entropy = want_mass = False
    plain = True  # every row greedy over the raw logits: the common case, batched
    for _, _, g in groups:
        want_entropy = want_entropy or g.want_entropy
        want_mass = want_mass or g.allowed is not None
        plain = plain and (g.steady or _is_plain_greedy(g))
    if plain:
        processed = logits if keep_processed else None
        if not need_confidence and not want_entropy:
            return Picked(row_max(logits)[1], None, None, processed)
        in_place = overwrite and not keep_processed and logits.device.type == "cpu"
        probs = softmax_(logits) if in_place else logits.softmax(-1)
        conf, tok = row_max(probs)
        return Picked(tok, conf, entropy(probs) if want_entropy else None, processed)
    tiled, at = True, 0  # groups cover the rows in order, one after the other
    for first, count, _ in groups:
        tiled, at = tiled and first == at, at + count
    if logits.device.type != "cpu" or not tiled or at != logits.shape[0]:
        return _pick_batch(logits, groups, want_entropy, keep_processed, want_mass)
    # On the CPU a few rows at a time: every pass over them stays in cache, where a batch-wide pass
    # would stream rows x vocabulary floats through memory once per op (no launch overhead to save).
    parts, start = [], 0
    while start < len(groups):
        end, rows = start, 0
        while end < len(groups) and (rows == 0 or rows + groups[end][1] <= CPU_CHUNK_ROWS):
            rows += groups[end][1]
            end += 1
        first = groups[start][0]
        parts.append(_pick_batch(logits[first : first + rows], [(f - first, c, g) for f, c, g in groups[start:end]],
                                 want_entropy, keep_processed, want_mass))
        start = end
    fields = ("tokens", "confidence", "entropy", "processed", "label_mass")
    return Picked(*(None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts])
                    for f in fields))


@dataclass
class _BatchSettings:
    """Per-row settings of a batch and its penalty / suppression entries, laid out on the host."""

    rows: list[int]  # logits row of each output row, group after group
    greedy: list[bool]
    temperature: list[float]
    top_k: list[int]  # 0 = off
    top_p: list[float]  # 2.0 = off (a cumulative probability never reaches it)
    min_p: list[float]  # 0.0 = off
    uniforms: list[float]  # the row's random draw (0 for greedy rows)
    want_entropy: list[bool]
    penalty_rows: list[int]  # repetition penalty entries: (output row, token id, penalty)
    penalty_ids: list[int]
    penalty_values: list[float]
    lowered_rows: list[int]  # λ penalty entries: (output row, token id, amount subtracted)
    lowered_ids: list[int]
    lowered_values: list[float]
    suppress_rows: list[int]  # stop ids set to -inf: (output row, token id)
    suppress_ids: list[int]
    allowed_rows: list[int]  # rows with an allowed set (output rows), and their sets
    allowed_sets: list[list[int]]


def _settings(groups: list[tuple[int, int, RowGroup]], vocab: int) -> _BatchSettings:
    b = _BatchSettings([], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [])
    for first, count, g in groups:
        p, out = g.params, len(b.rows)
        b.rows += range(first, first + count)
        b.greedy += [p.is_greedy] * count
        sampled = not p.is_greedy
        b.temperature += [p.temperature if sampled else 1.0] * count
        b.top_k += [p.top_k if sampled and 0 < p.top_k < vocab else 0] * count
        b.top_p += [p.top_p if sampled and p.top_p < 1.0 else 2.0] * count
        b.min_p += [p.min_p if sampled else 0.0] * count
        b.uniforms += uniforms(g.seed, g.first_draw, count) if sampled else [0.0] * count
        b.want_entropy += [g.want_entropy] * count
        if p.repetition_penalty != 1.0 and g.penalty_ids:
            ids = [i for i in g.penalty_ids if i < vocab]
            for r in range(out, out + count):
                b.penalty_rows += [r] * len(ids)
                b.penalty_ids += ids
            b.penalty_values += [p.repetition_penalty] * (len(ids) * count)
        if g.lowered is not None:
            amount, ids = g.lowered
            rows = [(r, i) for r, i in enumerate(ids, start=out) if 0 <= i < vocab]
            b.lowered_rows += [r for r, _ in rows]
            b.lowered_ids += [i for _, i in rows]
            b.lowered_values += [amount] * len(rows)
        stop = [i for i in g.stop_ids if i < vocab]
        for r, suppressed in enumerate(g.suppress, start=out):
            if suppressed and stop:
                b.suppress_rows += [r] * len(stop)
                b.suppress_ids += stop
        if g.allowed is not None:
            for r, ids in enumerate(g.allowed, start=out):
                if ids is not None:
                    b.allowed_rows.append(r)
                    b.allowed_sets.append(ids)
    return b


def _pick_batch(logits: torch.Tensor, groups: list[tuple[int, int, RowGroup]], want_entropy: bool,
                keep_processed: bool, want_mass: bool = False) -> Picked:
    """Every group at once: per-row settings as columns, the same per-row arithmetic as one group at a
    time (penalty, temperature, top-k, top-p, min-p, softmax, greedy max or inverse-CDF draw), so a
    row's results do not depend on what else is in the batch. Filters run on the sampled rows only, the
    top-p sort on the rows asking for it only. The settings travel in two host->device copies
    (integers, floats); no value comes back to the host."""
    device, vocab = logits.device, logits.shape[-1]
    b = _settings(groups, vocab)
    n, n_pen, n_sup, n_low = len(b.rows), len(b.penalty_rows), len(b.suppress_rows), len(b.lowered_rows)
    sampled = [r for r, g in enumerate(b.greedy) if not g]
    n_s = len(sampled)
    top_p_rows = [i for i, r in enumerate(sampled) if b.top_p[r] < 1.0]  # positions among the sampled rows
    ints = torch.tensor([*b.rows, *b.want_entropy, *b.penalty_rows, *b.penalty_ids, *b.suppress_rows,
                         *b.suppress_ids, *sampled, *(b.top_k[r] for r in sampled), *top_p_rows,
                         *b.lowered_rows, *b.lowered_ids], dtype=torch.long).to(device, non_blocking=True)
    rows_i, want_h, pen_r, pen_i, sup_r, sup_i, sampled_i, top_k, top_p_i, low_r, low_i = ints.split(
        [n, n, n_pen, n_pen, n_sup, n_sup, n_s, n_s, len(top_p_rows), n_low, n_low])
    floats = torch.tensor([*b.penalty_values, *b.lowered_values,
                           *(v for r in sampled for v in (b.temperature[r], b.top_p[r], b.min_p[r], b.uniforms[r]))],
                          dtype=torch.float64).to(device, non_blocking=True)
    pen_v, low_v, per_sampled = floats.split([n_pen, n_low, 4 * n_s])
    temperature, top_p, min_p, us = per_sampled.view(n_s, 4).unbind(1)
    in_order = b.rows == list(range(logits.shape[0]))
    x = logits.clone() if in_order else logits.index_select(0, rows_i)
    if n_pen:
        picked = x[pen_r, pen_i]
        penalty = pen_v.float()
        x[pen_r, pen_i] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if n_low:
        x[low_r, low_i] -= low_v.float()
    if n_sup:
        x[sup_r, sup_i] = float("-inf")
    mass = None
    if want_mass:
        mass = torch.full((n,), float("nan"), device=device)
        if b.allowed_rows:  # the set's raw (temperature-1) mass, then every other id of the row to -inf
            rows_a, keep = allowed = allowed_mask(b.allowed_rows, b.allowed_sets, vocab, device)
            raw = logits.index_select(0, rows_a if in_order else rows_i.index_select(0, rows_a))
            mass.index_copy_(0, rows_a, allowed_mass(raw, keep))
            x = within_allowed(x, allowed)
    every_row = n_s == n
    if sampled:
        xs = x if every_row else x.index_select(0, sampled_i)
        xs = _filter_rows(xs, temperature.float()[:, None], [b.top_k[r] for r in sampled], top_k,
                          None if len(top_p_rows) == n_s else top_p_i, top_p.index_select(0, top_p_i),
                          any(b.min_p[r] for r in sampled), min_p)
        x = xs if every_row else x.index_copy_(0, sampled_i, xs)
    probs = x.softmax(-1)
    conf, tok = probs.max(-1)
    if sampled:
        drawn = draw(probs if every_row else probs.index_select(0, sampled_i), us)
        tok = drawn if every_row else tok.index_copy_(0, sampled_i, drawn)
        conf = probs.gather(-1, tok[:, None])[:, 0]
    ent = None
    if want_entropy:
        ent = torch.where(want_h.bool(), entropy(probs), float("nan"))
    processed = None
    if keep_processed:  # laid out like the logits, as the rows they came from
        processed = x if in_order else torch.zeros_like(logits).index_copy_(0, rows_i, x)
    return Picked(tok, conf, ent, processed, mass)


def _filter_rows(x: torch.Tensor, temperature: torch.Tensor, top_k_list: list[int], top_k: torch.Tensor,
                 top_p_rows: torch.Tensor | None, top_p: torch.Tensor, any_min_p: bool,
                 min_p: torch.Tensor) -> torch.Tensor:
    """`filter_for_sampling` on sampled rows, each with its own settings (0 / 2.0 / 0.0 = top-k / top-p /
    min-p off): the k-th largest value from one `topk` of the largest k asked for; top-p sorts only
    `top_p_rows` (None: every row), whose thresholds `top_p` lists."""
    x = x / temperature
    if any(top_k_list):
        kth = torch.topk(x, max(top_k_list), dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        x = x.masked_fill(x < torch.where(top_k[:, None] > 0, kth, float("-inf")), float("-inf"))
    if top_p.numel():
        xp = x if top_p_rows is None else x.index_select(0, top_p_rows)
        sorted_x, order = xp.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p.float()[:, None]
        drop_sorted[:, 0] = False
        xp = xp.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
        x = xp if top_p_rows is None else x.index_copy_(0, top_p_rows, xp)
    if any_min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p.float()[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def draw(probs: torch.Tensor, us: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row r takes the first token whose cumulative probability exceeds
    us[r] (float64, on the probabilities' device) times the row total (a token of probability 0 is
    never taken)."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, us[:, None] * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]
