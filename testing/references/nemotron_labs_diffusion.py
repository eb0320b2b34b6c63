"""Oracle for the release's three decoding loops (`ar`, `diffusion`, `linear_spec`), batch 1.

No KV cache: every forward re-runs transformers' `Ministral3ForCausalLM` (the release's decoder with
`diffusion_head` as its LM head; load it with `testing.tiny.nemotron_labs_diffusion.load_ministral3`)
over the whole sequence at positions 0..T-1 under an additive 4D mask. The tokens before the current
block are always encoded causally -- the release's cache only ever holds causal K/V -- so a full causal
recompute of them is what its cache holds. The block's rows are either causal too (the AR step, a
diffusion block's commit, a LinearSpec verify: row i predicts token i+1) or see every key of the block
(a denoising or draft pass, which writes nothing: row i predicts token i itself).

The loops follow the release step by step:

- `ar`: one token per forward, greedy or one multinomial draw from softmax(logits / T); stops at eos.
- `diffusion`: blocks of B start at the prompt end. A block opens as [seed, MASK x (B-1)], the seed
  drawn from the causal row before it (the prefill's, then each commit's). Each denoising pass picks
  a candidate per position (argmax, or Gumbel-max over softmax(logits / T) with float64 noise) and
  its temperature-1 probability as confidence; the mask id is a legal candidate. Without a threshold
  the most confident `quota` masked positions are revealed (quota: B-1 masks over B steps, so one per
  step); with one, the most confident position plus every other at or above it. A block stops
  denoising when no mask is left or an eos has no mask before it; then a causal commit forward over
  it yields the next seed. The output ends after its first eos.
- `linear_spec`: the seed from the prefill; then per block [seed, MASK x (B-1)] drafted by
  bidirectional passes (threshold 0: one pass fills every mask; else reveal every masked position
  whose draft probability is at or above it, or the single best, until none is left), verified by one
  causal forward. `accepted` = 1 + the leading i in 0..B-2 whose AR token i equals draft token i+1;
  the first `accepted` AR tokens are emitted, the seed and the matched drafts stay in the prefix (the
  release's cache crop), the last emitted token is the next seed. The release may emit past
  `max_new_tokens` in its last iteration; this oracle cuts there.

Random draws use `generator` (torch's global generator when None) in the release's order: per AR
token one multinomial; diffusion: the seed, per denoising pass one float64 uniform tensor [B, V],
per commit one multinomial; LinearSpec: the seed, per draft pass one multinomial over the block's
rows, per verify one multinomial over them.

Step maps follow the engine's counter: it rises on every forward that reveals tokens of the output
(the prefill is step 1) and each token gets the counter at its reveal. `ar`: 1..n. `diffusion`: each
block's seed the forward that drew it (block 0's the prefill, later ones the commit before them),
every other token its denoising pass. `linear_spec`: the seed 1, every token of an iteration its
verify forward. A diffusion position never revealed (still masked when its block was committed, its
candidate having been the mask id) has step 0 and logprob NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel


@dataclass
class LoopResult:
    """Generated tokens (eos kept), the step of each, why the loop ended ("stop" at an eos, else
    "length"), the raw log-probability of each token at its reveal, the forwards the release counts as
    `nfe` and, for `linear_spec`, the number of tokens each verify accepted."""

    token_ids: list[int]
    step_map: list[int]
    finish_reason: str
    logprobs: list[float]
    nfe: int
    acceptance: list[int] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return max(self.step_map, default=0)


def loop_mask(length: int, block_start: int, bidirectional: bool, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, T, T] mask: causal, and with `bidirectional` the rows from `block_start` on also
    see every later key (the block attends to itself in full)."""
    pos = torch.arange(length)
    allowed = pos[None, :] <= pos[:, None]
    if bidirectional:
        allowed |= (pos[:, None] >= block_start) & (pos[None, :] >= block_start)
    mask = torch.zeros(length, length, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def block_logits(model: PreTrainedModel, tokens: list[int], block_start: int, bidirectional: bool) -> torch.Tensor:
    """Float32 logits [T - block_start, vocab] of the rows from `block_start` on, one full forward."""
    ids = torch.tensor([tokens])
    mask = loop_mask(len(tokens), block_start, bidirectional, model.dtype)
    out = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(len(tokens))[None], use_cache=False)
    return out.logits[0, block_start:].float()


def draw(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: the argmax, or one multinomial draw over the rows from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]


def _logprob(logits: torch.Tensor, token: int) -> float:
    return float(torch.log_softmax(logits, -1)[token])


def _cut_at_eos(tokens: list[int], eos_ids: set[int]) -> int | None:
    return next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), None)


def ar_generate(model: PreTrainedModel, prompt: list[int], *, max_new_tokens: int, eos_ids: set[int],
                temperature: float = 0.0, generator: torch.Generator | None = None) -> LoopResult:
    """The release's `ar_generate`."""
    seq, tokens, logprobs = list(prompt), [], []
    while len(tokens) < max_new_tokens:
        row = block_logits(model, seq, len(seq) - 1, bidirectional=False)
        token = int(draw(row, temperature, generator)[0])
        tokens.append(token)
        logprobs.append(_logprob(row[0], token))
        seq.append(token)
        if token in eos_ids:
            break
    n = len(tokens)
    finish = "stop" if tokens and tokens[-1] in eos_ids else "length"
    return LoopResult(tokens, list(range(1, n + 1)), finish, logprobs, n)


def transfer_quota(masked: int, steps: int) -> list[int]:
    """Positions to reveal per step without a threshold: `masked` spread over `steps`, the remainder
    one each to the first steps."""
    return [masked // steps + (1 if i < masked % steps else 0) for i in range(steps)]


def _candidates(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Argmax of the logits with Gumbel noise `exp(l) / (-ln u)^T` in float64 (the logits at T = 0)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.double()
    noise = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
    return (logits.exp() / (-torch.log(noise)) ** temperature).argmax(-1)


def _masked_to(logits: torch.Tensor, sets: list[list[int] | None]) -> torch.Tensor:
    """`logits` rows with -inf outside each row's allowed set (None: the row as it is)."""
    if not any(ids is not None for ids in sets):
        return logits
    out = logits.clone()
    for row, ids in enumerate(sets):
        if ids is not None:
            keep = torch.full_like(out[row], -torch.inf)
            keep[ids] = logits[row, ids]
            out[row] = keep
    return out


def diffusion_generate(model: PreTrainedModel, prompt: list[int], *, max_new_tokens: int, block_length: int,
                       mask_id: int, eos_ids: set[int], threshold: float | None = None, temperature: float = 0.0,
                       generator: torch.Generator | None = None, template: list[int | None] | None = None,
                       allowed: list[int] | dict[int, list[int]] | None = None, read_steps: int | None = None,
                       label_mass: dict[int, float] | None = None) -> LoopResult:
    """The release's `generate` (`causal_context` on, no think budget).

    Typed decisions: `template[g]` pins generated index g to an id (None: a slot). A block opens with
    its pinned positions written -- the seed too, after its draw -- and they are never candidates; the
    pass quota spreads the block's masks only. `allowed` (one list for every slot, or per generated index;
    without a template every position is a slot) sets every other logit of a slot's row to -inf before
    its candidate and confidence are read (the seed's draw too); logprobs stay the raw row's, and
    `label_mass` (filled when given) gets each slot's raw probability on its set. `read_steps` k: a read
    of the template -- in the block holding its last slot, the k-th pass reveals every slot still masked
    and the output is the template's positions (finish "read"); eos ends nothing."""
    if max_new_tokens % block_length and read_steps is None:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be a multiple of block_length={block_length}")
    tmpl = [None if t in (None, -1, mask_id) else t for t in (template or [])]
    if read_steps is not None and not template:
        tmpl = [None] * max_new_tokens

    def set_of(g: int) -> list[int] | None:
        if tmpl and not (g < len(tmpl) and tmpl[g] is None):
            return None
        return allowed.get(g) if isinstance(allowed, dict) else allowed

    def mass(raw: torch.Tensor, g: int) -> None:
        if label_mass is not None and set_of(g) is not None:
            label_mass[g] = float(torch.softmax(raw, -1)[set_of(g)].sum())

    seq, b, n = list(prompt), block_length, len(prompt)
    last_slot = max((g for g, t in enumerate(tmpl) if t is None), default=None)
    row = block_logits(model, seq, len(seq) - 1, bidirectional=False)
    seed = int(draw(_masked_to(row, [set_of(0)]), temperature, generator)[0])
    mass(row[0], 0)
    step, nfe = 1, 0
    steps: dict[int, int] = {len(seq): 1}
    logprob_of: dict[int, float] = {len(seq): _logprob(row[0], seed)}
    for block_index in range(-(-max_new_tokens // b)):
        start, block = len(seq), [seed] + [mask_id] * (b - 1)
        for j in range(b):
            pinned = tmpl[start + j - n] if start + j - n < len(tmpl) else None
            if pinned is not None:
                block[j] = pinned
                steps[start + j], logprob_of[start + j] = 0, 0.0
                if label_mass is not None:
                    label_mass.pop(start + j - n, None)
        quota = transfer_quota(sum(t == mask_id for t in block), b)
        read_here = read_steps is not None and start <= n + last_slot < start + b
        for i in range(b):
            masked = torch.tensor([t == mask_id for t in block])
            if read_here and not any(masked[j] for j in range(b) if start + j - n < len(tmpl)):
                return _read_result(seq + block, n, tmpl, steps, logprob_of, nfe)
            if not masked.any():
                break
            nfe += 1
            raw = block_logits(model, seq + block, start, bidirectional=True)
            logits = _masked_to(raw, [set_of(start + j - n) if masked[j] else None for j in range(b)])
            x0 = torch.where(masked, _candidates(logits, temperature, generator), torch.tensor(block))
            probs = torch.softmax(logits, -1)
            confidence = torch.where(masked, probs.gather(-1, x0[:, None])[:, 0], -torch.inf)
            if threshold is None:
                chosen = torch.topk(confidence, quota[i]).indices.tolist()
            else:
                ranked = torch.topk(confidence, int(masked.sum())).indices.tolist()
                chosen = ranked[:1] + [j for j in ranked[1:] if confidence[j] >= threshold]
            last = read_here and i + 1 == read_steps
            if last:  # the read's last pass: every slot of the template it still masks
                chosen = sorted(set(chosen) | {j for j in range(b) if masked[j] and start + j - n < len(tmpl)})
            step += 1
            for j in chosen:
                block[j] = int(x0[j])
                if masked[j] and (block[j] != mask_id or last):  # a mask id written back reveals nothing
                    steps[start + j], logprob_of[start + j] = step, _logprob(raw[j], block[j])
                    mass(raw[j], start + j - n)
            if last:
                return _read_result(seq + block, n, tmpl, steps, logprob_of, nfe)
            if read_steps is None and any(t in eos_ids and mask_id not in block[:j] for j, t in enumerate(block)):
                break
        seq += block
        nfe += 1
        row = block_logits(model, seq, len(seq) - 1, bidirectional=False)  # the commit
        g = len(seq) - n
        seed = int(draw(_masked_to(row, [set_of(g)]), temperature, generator)[0])
        generated = seq[n:]
        if read_steps is None and (cut := _cut_at_eos(generated, eos_ids)) is not None:
            return _result(seq, n, cut, "stop", steps, logprob_of, nfe)
        if block_index + 1 < -(-max_new_tokens // b):
            step += 1
            steps[len(seq)], logprob_of[len(seq)] = step, _logprob(row[0], seed)
            mass(row[0], g)
    return _result(seq, n, max_new_tokens, "length", steps, logprob_of, nfe)


def _read_result(tokens: list[int], prompt_len: int, template: list[int | None], steps: dict[int, int],
                 logprob_of: dict[int, float], nfe: int) -> LoopResult:
    """A read's output: the template's positions -- the tokens so far and the pinned rest after them."""
    out = list(tokens)
    for g in range(len(out) - prompt_len, len(template)):
        out.append(template[g])
        steps[prompt_len + g], logprob_of[prompt_len + g] = 0, 0.0
    return _result(out, prompt_len, len(template), "read", steps, logprob_of, nfe)


def _result(seq: list[int], prompt_len: int, length: int, finish_reason: str, steps: dict[int, int],
            logprob_of: dict[int, float], nfe: int) -> LoopResult:
    positions = range(prompt_len, prompt_len + length)
    return LoopResult([seq[i] for i in positions], [steps.get(i, 0) for i in positions], finish_reason,
                      [logprob_of.get(i, math.nan) for i in positions], nfe)


def _draft(model: PreTrainedModel, prefix: list[int], block: list[int], mask_id: int, threshold: float,
           temperature: float, generator: torch.Generator | None) -> int:
    """Fill `block`'s masks in place by bidirectional passes; the number of passes."""
    passes = 0
    while mask_id in block:
        passes += 1
        logits = block_logits(model, prefix + block, len(prefix), bidirectional=True)
        probs = torch.softmax(logits / temperature if temperature else logits, -1)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0] if temperature else logits.argmax(-1)
        masked = [j for j, t in enumerate(block) if t == mask_id]
        if threshold > 0:
            confidence = {j: float(probs[j, tokens[j]]) for j in masked}
            masked = [j for j in masked if confidence[j] >= threshold] or [max(masked, key=confidence.get)]
        for j in masked:
            block[j] = int(tokens[j])
        if threshold <= 0:
            break
    return passes


def linear_spec_generate(model: PreTrainedModel, prompt: list[int], *, max_new_tokens: int, block_length: int,
                         mask_id: int, eos_ids: set[int], threshold: float = 0.0, temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> LoopResult:
    """The release's `linear_spec_generate` (no draft adapter, no think budget), cut at `max_new_tokens`."""
    prefix = list(prompt)  # the tokens whose K/V the release's cache holds
    row = block_logits(model, prefix, len(prefix) - 1, bidirectional=False)
    seed = int(draw(row, temperature, generator)[0])
    tokens, steps, logprobs, acceptance, nfe = [seed], [1], [_logprob(row[0], seed)], [], 1
    while seed not in eos_ids and len(tokens) < max_new_tokens:
        block = [seed] + [mask_id] * (block_length - 1)
        nfe += _draft(model, prefix, block, mask_id, threshold, temperature, generator)
        logits = block_logits(model, prefix + block, len(prefix), bidirectional=False)  # the verify
        nfe += 1
        ar = draw(logits, temperature, generator).tolist()
        accepted = 1
        while accepted < block_length and ar[accepted - 1] == block[accepted]:
            accepted += 1
        acceptance.append(accepted)
        emitted = ar[:_cut_at_eos(ar[:accepted], eos_ids) or accepted]
        tokens += emitted
        steps += [steps[-1] + 1] * len(emitted)
        logprobs += [_logprob(logits[i], t) for i, t in enumerate(emitted)]
        prefix += block[:accepted]
        seed = emitted[-1]
    n = min(len(tokens), max_new_tokens)
    return LoopResult(tokens[:n], steps[:n], "stop" if tokens[n - 1] in eos_ids else "length", logprobs[:n], nfe,
                      acceptance)
