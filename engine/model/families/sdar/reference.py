"""Oracle for greedy block-diffusion decoding, the documented rules implemented literally.

No KV cache, no batching, no cleverness: every step re-runs a Hugging Face causal LM
(`Qwen3ForCausalLM` for SDAR, `Qwen3MoeForCausalLM` for SDAR-MoE) over the whole sequence so far
(prompt + every opened block, still-masked positions fed as the mask token) under a block-causal
4D mask, and reads the logits at the masked positions of the current block (SDAR: logits at
position i predict token i, no shift).

The 4D mask is float and additive, shape `[1, 1, T, T]`: 0 where query i may see key j
(`j // B <= i // B`), `finfo.min` elsewhere. transformers 5.x passes a 4D mask through untouched
and its eager attention adds it to the scores; load the model with `load_hf_reference`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded", "random")


@dataclass
class ReferenceResult:
    """Generated tokens (stop id kept), the step that unmasked each one, why generation ended, and
    the raw log_softmax of each chosen token at its unmasking step (1:1 with `token_ids`)."""

    token_ids: list[int]
    step_map: list[int]
    finish_reason: str
    logprobs: list[float]


def block_causal_mask(seq_len: int, block_length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive `[1, 1, T, T]` mask: query i sees key j iff `j // B <= i // B`."""
    block = torch.arange(seq_len) // block_length
    allowed = block[None, :] <= block[:, None]
    mask = torch.zeros(seq_len, seq_len, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def block_causal_logits(model: PreTrainedModel, token_ids: list[int], block_length: int) -> torch.Tensor:
    """Float32 logits `[T, vocab]` of one full forward over `token_ids` (positions 0..T-1)."""
    seq_len = len(token_ids)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    position_ids = torch.arange(seq_len)[None]
    mask = block_causal_mask(seq_len, block_length, model.dtype)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out.logits[0].float()


def _choose(masked: list[int], confidence: dict[int, float], entropy: dict[int, float], n_s: int, strategy: str,
            threshold: float, entropy_threshold: float, step_seed: int) -> list[int]:
    """Positions to unmask this step (`masked` is ascending; ties go to the lower position)."""
    if strategy == "random":  # n_s of the masked positions, drawn by a generator seeded for this step
        return [masked[j] for j in random.Random(step_seed).sample(range(len(masked)), n_s)]
    if strategy == "sequential":
        return masked[:n_s]
    if strategy == "entropy_bounded":  # lowest entropies first while their running sum stays < bound
        ranked = sorted(masked, key=lambda i: (entropy[i], i))
        k = 0
        while k < len(ranked) and sum(entropy[i] for i in ranked[: k + 1]) < entropy_threshold:
            k += 1
        return ranked[: max(k, 1)]
    if strategy == "low_confidence_dynamic":
        confident = [i for i in masked if confidence[i] >= threshold]
        if len(confident) >= n_s:
            return confident
    return sorted(masked, key=lambda i: (-confidence[i], i))[:n_s]


def stop_cut(generated: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[int, str] | None:
    """Where the output ends, if the generated tokens so far already determine it."""
    for j, token in enumerate(generated[:max_new_tokens]):
        if token in stop_ids:
            return j + 1, "stop"
    if len(generated) >= max_new_tokens:
        return max_new_tokens, "length"
    return None


def reference_dllm_generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    *,
    block_length: int,
    mask_id: int,
    max_new_tokens: int,
    stop_ids: set[int],
    strategy: str,
    denoising_steps: int,
    threshold: float,
    entropy_threshold: float = 0.35,
    seed: int = 0,
) -> ReferenceResult:
    """Greedy block-diffusion decoding of one prompt: blocks of `block_length` positions, each opened
    fully masked and unmasked over `denoising_steps` steps by `strategy` (ties to the lower position),
    the output cut at the first stop id or at `max_new_tokens`. `threshold` is the confidence threshold
    of low_confidence_dynamic, `entropy_threshold` the entropy bound (nats) of entropy_bounded; the
    `random` rule's step draws from `random.Random((seed * 1_000_003 + steps so far) mod 2**63)`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if block_length < 1 or denoising_steps < 1:
        raise ValueError("block_length and denoising_steps must be >= 1")
    prompt_len = len(prompt_ids)
    seq = list(prompt_ids)
    step_of: dict[int, int] = {}
    logprob_of: dict[int, float] = {}
    counter = 0
    while (cut := stop_cut(seq[prompt_len:], max_new_tokens, stop_ids)) is None:
        # Open the next block; its start is < prompt_len + max_new_tokens, or `stop_cut` would have
        # answered. The first one may be the prompt's partial block.
        block_start = len(seq) // block_length * block_length
        block_end = block_start + block_length
        masked = list(range(len(seq), block_end))
        seq.extend([mask_id] * len(masked))
        total = len(masked)
        s = 0
        while masked:
            n_s = total // denoising_steps + (1 if s < total % denoising_steps else 0)
            logits = block_causal_logits(model, seq, block_length)[masked]
            candidate = logits.argmax(dim=-1)
            probs = torch.softmax(logits, dim=-1).gather(-1, candidate[:, None])[:, 0]
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, candidate[:, None])[:, 0]
            confidence = {i: float(p) for i, p in zip(masked, probs, strict=True)}
            dist = torch.softmax(logits, dim=-1)
            entropy = {i: float(-(row[row > 0] * row[row > 0].log()).sum()) for i, row in zip(masked, dist)}
            step_seed = (seed * 1_000_003 + counter) & ((1 << 63) - 1)
            chosen = _choose(masked, confidence, entropy, n_s, strategy, threshold, entropy_threshold, step_seed)
            counter += 1  # n_s >= 1 while anything is masked, so every step unmasks a token
            for row, i in enumerate(masked):
                if i in chosen:
                    seq[i] = int(candidate[row])
                    step_of[i] = counter
                    logprob_of[i] = float(logprobs[row])
            masked = [i for i in masked if i not in chosen]
            s += 1
    length, finish_reason = cut
    positions = range(prompt_len, prompt_len + length)
    return ReferenceResult(
        token_ids=[seq[i] for i in positions],
        step_map=[step_of[i] for i in positions],
        finish_reason=finish_reason,
        logprobs=[logprob_of[i] for i in positions],
    )
