"""Oracle for Fast-dLLM v2 decoding (token shift, sub-blocks), the documented rule implemented literally.

No KV cache, no batching: every forward re-runs Hugging Face `Qwen2ForCausalLM` over the sequence
so far under a block-causal 4D mask (`dllm_reference.block_causal_logits`), and reads row i-1 for
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.model.families.sdar.reference import block_causal_logits, stop_cut


@dataclass
class FastDllmResult:
    token_ids: list[int]
    step_map: list[int]
    finish_reason: str
    logprobs: list[float]  # raw log_softmax of each token at the row that revealed it
    forwards: int


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
) -> FastDllmResult:
    b, s = block_length, sub_block_length
    prompt_len = len(prompt_ids)
    seq = list(prompt_ids)
    step_of: dict[int, int] = {}
    logprob_of: dict[int, float] = {}
    counter = 0

    def reveal(rows: torch.Tensor, positions: list[int], chosen: list[int]) -> None:
        nonlocal counter
        counter += 1
        logprobs = torch.log_softmax(rows, dim=-1)
        for j in chosen:
            token = int(rows[j].argmax())
            seq[positions[j]] = token
            step_of[positions[j]] = counter
            logprob_of[positions[j]] = float(logprobs[j, token])

    while (cut := stop_cut(seq[prompt_len:], max_new_tokens, stop_ids)) is None:
        start = len(seq) // b * b
        if len(seq) == start:  # the block's first position is generated: inherited from row kB-1
            row = block_causal_logits(model, seq, b)[start - 1 : start]
            seq.append(mask_id)
            reveal(row, [start], [0])
        seq.extend([mask_id] * (start + b - len(seq)))
        for lo in range(start, start + b, s):
            while pending := [i for i in range(max(lo, prompt_len), lo + s) if i not in step_of]:
                rows = block_causal_logits(model, seq, b)[[i - 1 for i in pending]]
                confidence = torch.softmax(rows, dim=-1).max(dim=-1).values.tolist()
                chosen = [j for j, c in enumerate(confidence) if c > threshold]
                if not chosen:
                    chosen = [max(range(len(pending)), key=lambda j: (confidence[j], -j))]
                reveal(rows, pending, chosen)
    length, finish_reason = cut
    positions = range(prompt_len, prompt_len + length)
    return FastDllmResult(
        token_ids=[seq[i] for i in positions],
        step_map=[step_of[i] for i in positions],
        finish_reason=finish_reason,
        logprobs=[logprob_of[i] for i in positions],
        forwards=counter,
    )
