"""Oracle for greedy block-diffusion decoding, the documented rules implemented literally.

No KV cache, no batching, no cleverness: every step re-runs a Hugging Face causal LM
(`Qwen3ForCausalLM` for SDAR, `Qwen3MoeForCausalLM` for SDAR-MoE) over the whole sequence so far
(prompt + every opened block, still-masked positions fed as the mask token) under a block-causal
4D mask, and reads the logits at the masked positions of the current block (SDAR: logits at
position i predict token i, no shift).

The 4D mask is float and additive, shape `[1, 1, T, T]`: 0 where query i may see key j
(`j // B <= i // B`), `finfo.min` elsewhere. transformers 5.x passes a 4D mask through untouched
and its eager attention adds it to the scores; load the model with `load_hf_reference`.

Typed decisions (`TypedDecisions`, shared by the block references of every family): a template over
the first generated positions pins some ids and leaves slots to decode, allowed sets confine what a
slot may become, and a read stops decoding once the template's slots are revealed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded", "random")


@dataclass
class ReferenceResult:
    """Generated tokens (stop id kept), the step that unmasked each one (0: pinned by the template),
    why generation ended, the raw log_softmax of each chosen token at its unmasking step (1:1 with
    `token_ids`; 0.0 for a pinned one), and per output index with an allowed set the raw probability
    mass that set held at the step that wrote it."""

    token_ids: list[int]
    step_map: list[int]
    finish_reason: str
    logprobs: list[float]
    label_mass: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TypedDecisions:
    """A template, allowed sets and a read, as the reference loops apply them.

    `template[g]` is the id pinned at generated index g, or None at a slot (the decoder's choice).
    A pinned id is written when its block opens, as an already revealed token: step 0, logprob 0.0,
    fed to every forward as itself, never a candidate and never rewritten. Masks are all the other
    positions of the block. A slot with an allowed set has every other logit of its row set to -inf
    before the rule reads the row (argmax, probabilities, entropies, thresholds); its recorded logprob
    stays the raw log_softmax over the whole vocabulary. Without a template every position is a slot;
    with one, positions past it take no set. `read_steps` (k) makes the decoding a read: greedy, no
    stop ids, the output exactly the template's positions, finish reason "read"; blocks before the one
    holding the last slot decode as usual, and in that block the k-th step also reveals every template
    position it still masks (each family's reference says when a read ends sooner); the pinned
    positions after that block are written without a forward."""

    template: list[int | None]
    sets: list[int] | dict[int, list[int]] | None = None
    read_steps: int | None = None

    @classmethod
    def of(cls, template: list[int | None] | None, allowed: list[int] | dict[int, list[int]] | None,
           read_steps: int | None, mask_id: int, max_new_tokens: int) -> TypedDecisions:
        """Slot markers (None, -1, the mask id) become None; a read without a template reads
        max_new_tokens slots."""
        if read_steps is not None and read_steps < 1:
            raise ValueError("read_steps must be >= 1")
        if template is None:
            slots: list[int | None] = [None] * (max_new_tokens if read_steps is not None else 0)
        else:
            slots = [None if t is None or t in (-1, mask_id) else t for t in template]
        if len(slots) > max_new_tokens:
            raise ValueError("the template is longer than max_new_tokens")
        if read_steps is not None and None not in slots:
            raise ValueError("a read needs a template slot to read")
        return cls(slots, allowed, read_steps)

    @property
    def length(self) -> int:
        return len(self.template)

    @property
    def is_read(self) -> bool:
        return self.read_steps is not None

    @property
    def last_slot(self) -> int:
        """The generated index of the template's last slot (a read has one)."""
        return max(g for g, t in enumerate(self.template) if t is None)

    def pinned(self, g: int) -> int | None:
        """The id pinned at generated index g (None: g is decoded)."""
        return self.template[g] if 0 <= g < len(self.template) else None

    def allowed(self, g: int) -> list[int] | None:
        """The ids generated index g may take (None: any)."""
        if self.template and not (g < len(self.template) and self.template[g] is None):
            return None
        return self.sets.get(g) if isinstance(self.sets, dict) else self.sets

    def open(self, seq: list[int], end: int, prompt_len: int, mask_id: int, step_of: dict[int, int],
             logprob_of: dict[int, float]) -> list[int]:
        """Extend `seq` to `end`: pinned ids written as revealed (step 0, logprob 0.0), masks elsewhere.
        Returns the positions left masked, ascending."""
        masked = []
        for i in range(len(seq), end):
            token = self.pinned(i - prompt_len)
            if token is None:
                masked.append(i)
                seq.append(mask_id)
            else:
                seq.append(token)
                step_of[i], logprob_of[i] = 0, 0.0
        return masked

    def restrict(self, logits: torch.Tensor, gens: list[int]) -> torch.Tensor:
        """`logits` rows of generated indices `gens`, -inf outside each one's allowed set (a copy when
        some row has a set)."""
        out = logits
        for row, g in enumerate(gens):
            ids = self.allowed(g)
            if ids is not None:
                if out is logits:
                    out = logits.clone()
                keep = torch.full_like(out[row], float("-inf"))
                keep[ids] = out[row, ids]
                out[row] = keep
        return out

    def mass(self, raw: torch.Tensor, g: int) -> float | None:
        """The probability its allowed set holds in generated index g's unrestricted row (None: no set)."""
        ids = self.allowed(g)
        return None if ids is None else float(torch.softmax(raw, dim=-1)[ids].sum())

    def read_left(self, masked: list[int], prompt_len: int) -> list[int]:
        """The masked positions a read still has to reveal (those inside the template)."""
        return [i for i in masked if i - prompt_len < len(self.template)]

    def finish(self, seq: list[int], prompt_len: int, step_of: dict[int, int],
               logprob_of: dict[int, float]) -> tuple[int, str]:
        """End a read: the template's positions not opened yet (all pinned) are written without a forward."""
        for i in range(len(seq), prompt_len + self.length):
            seq.append(self.template[i - prompt_len])
            step_of[i], logprob_of[i] = 0, 0.0
        return self.length, "read"


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
    template: list[int | None] | None = None,
    allowed: list[int] | dict[int, list[int]] | None = None,
    read_steps: int | None = None,
) -> ReferenceResult:
    """Greedy block-diffusion decoding of one prompt: blocks of `block_length` positions, each opened
    fully masked and unmasked over `denoising_steps` steps by `strategy` (ties to the lower position),
    the output cut at the first stop id or at `max_new_tokens`. `threshold` is the confidence threshold
    of low_confidence_dynamic, `entropy_threshold` the entropy bound (nats) of entropy_bounded; the
    `random` rule's step draws from `random.Random((seed * 1_000_003 + steps so far) mod 2**63)`.

    `template`, `allowed` and `read_steps` are typed decisions (`TypedDecisions`): a block opens with
    its pinned ids already revealed, the step quota shares out only its masks, and a block without a
    mask takes no step; a pinned stop id ends the output like a decoded one. A read ignores
    `stop_ids` and `max_new_tokens`: in the block holding the template's last slot its
    `read_steps`-th step reveals, besides the rule's choice, every template position still masked,
    each as the argmax of its (restricted) row, and the read ends there, or at the first step after
    which that block holds no masked template position."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if block_length < 1 or denoising_steps < 1:
        raise ValueError("block_length and denoising_steps must be >= 1")
    decided = TypedDecisions.of(template, allowed, read_steps, mask_id, max_new_tokens)
    prompt_len = len(prompt_ids)
    read_block = None
    if decided.is_read:
        max_new_tokens, stop_ids = decided.length, set()
        read_block = (prompt_len + decided.last_slot) // block_length
    seq = list(prompt_ids)
    step_of: dict[int, int] = {}
    logprob_of: dict[int, float] = {}
    mass_of: dict[int, float] = {}
    counter = 0
    while (cut := stop_cut(seq[prompt_len:], max_new_tokens, stop_ids)) is None:
        # Open the next block; its start is < prompt_len + max_new_tokens, or `stop_cut` would have
        # answered. The first one may be the prompt's partial block.
        block_start = len(seq) // block_length * block_length
        reading = block_start // block_length == read_block
        masked = decided.open(seq, block_start + block_length, prompt_len, mask_id, step_of, logprob_of)
        total = len(masked)
        s = 0
        while masked:
            n_s = total // denoising_steps + (1 if s < total % denoising_steps else 0)
            raw = block_causal_logits(model, seq, block_length)[masked]
            logits = decided.restrict(raw, [i - prompt_len for i in masked])
            candidate = logits.argmax(dim=-1)
            probs = torch.softmax(logits, dim=-1).gather(-1, candidate[:, None])[:, 0]
            logprobs = torch.log_softmax(raw, dim=-1).gather(-1, candidate[:, None])[:, 0]
            confidence = {i: float(p) for i, p in zip(masked, probs, strict=True)}
            dist = torch.softmax(logits, dim=-1)
            entropy = {i: float(-(row[row > 0] * row[row > 0].log()).sum()) for i, row in zip(masked, dist)}
            step_seed = (seed * 1_000_003 + counter) & ((1 << 63) - 1)
            chosen = _choose(masked, confidence, entropy, n_s, strategy, threshold, entropy_threshold, step_seed)
            s += 1
            if reading and s == decided.read_steps:  # the read's last step reveals the rest of the template
                chosen = [*chosen, *(i for i in decided.read_left(masked, prompt_len) if i not in chosen)]
            counter += 1  # n_s >= 1 while anything is masked, so every step unmasks a token
            for row, i in enumerate(masked):
                if i in chosen:
                    seq[i] = int(candidate[row])
                    step_of[i] = counter
                    logprob_of[i] = float(logprobs[row])
                    if (mass := decided.mass(raw[row], i - prompt_len)) is not None:
                        mass_of[i] = mass
            masked = [i for i in masked if i not in chosen]
            if reading and not decided.read_left(masked, prompt_len):
                break
        if reading:
            cut = decided.finish(seq, prompt_len, step_of, logprob_of)
            break
    length, finish_reason = cut
    positions = range(prompt_len, prompt_len + length)
    return ReferenceResult(
        token_ids=[seq[i] for i in positions],
        step_map=[step_of[i] for i in positions],
        finish_reason=finish_reason,
        logprobs=[logprob_of[i] for i in positions],
        label_mass={i - prompt_len: mass_of[i] for i in positions if i in mass_of},
    )
