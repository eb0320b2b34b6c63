"""Oracle for Fast-dLLM v2 decoding (token shift, sub-blocks), the documented rule implemented literally.

No KV cache, no batching: every forward re-runs Hugging Face `Qwen2ForCausalLM` over the sequence so far
under a block-causal 4D mask (`testing.references.sdar.block_causal_logits`), and reads row i-1 for
position i (the token shift). Greedy: candidate = argmax, confidence = its softmax probability.

Per block [kB, (k+1)B), after the previous block is complete:
- if kB is a generated position (kB >= P), its token is the argmax of row kB-1 of the forward over
  x[:kB] (for the first block that is the prompt itself: P % B == 0), one step;
- then each sub-block [kB + sS, kB + (s+1)S) in turn: while it holds an unrevealed generated
  position, one step = a forward over x[:(k+1)B] (unrevealed positions fed as the mask), revealing
  every unrevealed position of the sub-block whose confidence is strictly above the threshold, else
  the single most confident (ties: the lower position).
The step counter rises by one per step; the output is cut at the first stop id or at
`max_new_tokens` after whole blocks are decoded. `forwards` counts the forwards a cache-based
implementation needs: one per step.

Typed decisions (`TypedDecisions`): a block opens with its pinned ids already revealed, so a pinned
first position takes no inherited step, and sub-blocks without an unrevealed position take none
either. The allowed set of position i confines row i-1. A read (`read_steps` = k) decodes the blocks
before the one holding the template's last slot as usual; in that block its k-th sub-block step (the
inherited step does not count) reveals, from the same forward's rows, every template position of the
block still unrevealed, and the read ends there, or after the first step leaving the block's template
positions all revealed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from testing.references.sdar import TypedDecisions, block_causal_logits, stop_cut


@dataclass
class FastDllmResult:
    token_ids: list[int]
    step_map: list[int]
    finish_reason: str
    logprobs: list[float]  # raw log_softmax of each token at the row that revealed it (0.0: pinned)
    forwards: int
    label_mass: dict[int, float] = field(default_factory=dict)  # output index -> its set's raw mass


def reference_fast_dllm_generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    *,
    block_length: int,
    sub_block_length: int,
    mask_id: int,
    max_new_tokens: int,
    stop_ids: set[int],
    threshold: float,
    template: list[int | None] | None = None,
    allowed: list[int] | dict[int, list[int]] | None = None,
    read_steps: int | None = None,
) -> FastDllmResult:
    """Greedy Fast-dLLM v2 decoding of one prompt (the module's rule), optionally under a template,
    allowed sets and a read; a read ignores `stop_ids` and `max_new_tokens`."""
    b, s = block_length, sub_block_length
    decided = TypedDecisions.of(template, allowed, read_steps, mask_id, max_new_tokens)
    prompt_len = len(prompt_ids)
    read_block = None
    if decided.is_read:
        max_new_tokens, stop_ids = decided.length, set()
        read_block = (prompt_len + decided.last_slot) // b
    seq = list(prompt_ids)
    step_of: dict[int, int] = {}
    logprob_of: dict[int, float] = {}
    mass_of: dict[int, float] = {}
    counter = 0

    def reveal(rows: torch.Tensor, positions: list[int], chosen: list[int]) -> None:
        nonlocal counter
        counter += 1
        logprobs = torch.log_softmax(rows, dim=-1)
        tokens = decided.restrict(rows, [i - prompt_len for i in positions]).argmax(dim=-1).tolist()
        for j in chosen:
            seq[positions[j]] = tokens[j]
            step_of[positions[j]] = counter
            logprob_of[positions[j]] = float(logprobs[j, tokens[j]])
            if (mass := decided.mass(rows[j], positions[j] - prompt_len)) is not None:
                mass_of[positions[j]] = mass

    def unrevealed(lo: int, hi: int) -> list[int]:
        return [i for i in range(max(lo, prompt_len), hi) if i not in step_of]

    while (cut := stop_cut(seq[prompt_len:], max_new_tokens, stop_ids)) is None:
        start = len(seq) // b * b
        reading = start // b == read_block
        if len(seq) == start and decided.pinned(start - prompt_len) is None:
            # the block's first position is generated and masked: inherited from row kB-1
            row = block_causal_logits(model, seq, b)[start - 1 : start]
            seq.append(mask_id)
            reveal(row, [start], [0])
        decided.open(seq, start + b, prompt_len, mask_id, step_of, logprob_of)
        steps = 0
        done = reading and not decided.read_left(unrevealed(start, start + b), prompt_len)
        for lo in range(start, start + b, s):
            while not done and (pending := unrevealed(lo, lo + s)):
                logits = block_causal_logits(model, seq, b)
                rows = decided.restrict(logits[[i - 1 for i in pending]], [i - prompt_len for i in pending])
                confidence = torch.softmax(rows, dim=-1).max(dim=-1).values.tolist()
                chosen = [j for j, c in enumerate(confidence) if c > threshold]
                if not chosen:
                    chosen = [max(range(len(pending)), key=lambda j: (confidence[j], -j))]
                steps += 1
                if reading and steps == decided.read_steps:  # the read's last step: the rest of the template
                    rest = decided.read_left(unrevealed(start, start + b), prompt_len)
                    pending += [i for i in rest if i not in pending]
                    chosen = sorted({*chosen, *(j for j, i in enumerate(pending) if i in rest)})
                reveal(logits[[i - 1 for i in pending]], pending, chosen)
                done = reading and not decided.read_left(unrevealed(start, start + b), prompt_len)
        if reading:
            cut = decided.finish(seq, prompt_len, step_of, logprob_of)
            break
    length, finish_reason = cut
    positions = range(prompt_len, prompt_len + length)
    return FastDllmResult(
        token_ids=[seq[i] for i in positions],
        step_map=[step_of[i] for i in positions],
        finish_reason=finish_reason,
        logprobs=[logprob_of[i] for i in positions],
        forwards=counter,
        label_mass={i - prompt_len: mass_of[i] for i in positions if i in mass_of},
    )
