"""Oracle for the LLaDA2 family: the architecture and both decoding rules, written out literally.

No KV cache, no batching, no tensor parallelism: `LLaDA2Reference` reads the checkpoint's tensors by
their names and runs every layer over the whole sequence so far (prompt + every opened block, masks
fed as the mask token) under a block-causal mask, in float32. The layer is inclusionAI's, written
from its description: fused QKV split into q, k, v heads; per-head RMSNorm of q and k; NeoX rotary on
the first `head_dim * partial_rotary_factor` dims; attention.dense (+ bias); a dense MLP in the first
`first_k_dense_replace` layers, else a float32 sigmoid router (expert bias for choosing only, groups
scored by their two best, top `topk_group` groups, top-k experts, weights normalised and scaled) over
SwiGLU experts plus the shared experts; with `expert_capacity` (LLaDA2.2) the groups give way to
block routing: the sequence's positions in blocks of `block_size`, each block's `expert_capacity`
experts of the largest biased scores over its tokens, each token's top-k among them. Logits at
position i predict token i.

`reference_generate` decodes greedily one prompt with SGLang's LowConfidence (`low_confidence`) or
JointThreshold (`joint_threshold`) rule, whole blocks, the output cut afterwards, optionally under
typed decisions (a template, allowed sets, a read: `TypedDecisions`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from testing.references.sdar import TypedDecisions


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate = x @ w[prefix + ".gate_proj.weight"].T
    up = x @ w[prefix + ".up_proj.weight"].T
    return (F.silu(gate) * up) @ w[prefix + ".down_proj.weight"].T


class LLaDA2Reference:
    def __init__(self, path: str | Path):
        path = Path(path)
        self.cfg = json.loads((path / "config.json").read_text())
        self.w: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            self.w |= {k: v.float() for k, v in load_file(str(file)).items()}
        if "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.word_embeddings.weight"]

        self._seen: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def logits(self, ids: list[int], block_length: int) -> torch.Tensor:
        """Float32 logits [T, vocab] of one forward over `ids` (positions 0..T-1), query i seeing key j
        iff j // B <= i // B. Remembered per input (decodings that share steps share their forwards);
        computed on one thread (tiny matrices: more threads only contend)."""
        key = (block_length, tuple(ids))
        if key not in self._seen:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._seen[key] = self._forward(ids, block_length)
            finally:
                torch.set_num_threads(threads)
        return self._seen[key]

    @torch.inference_mode()
    def _forward(self, ids: list[int], block_length: int) -> torch.Tensor:
        c, w = self.cfg, self.w
        t, eps = len(ids), c["rms_norm_eps"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        rot = int(hd * c.get("partial_rotary_factor", 0.5))
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot))
        angles = torch.arange(t).float()[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rope(x: torch.Tensor) -> torch.Tensor:  # x [heads, T, hd]
            r, rest = x[..., :rot], x[..., rot:]
            half = rot // 2
            rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
            return torch.cat([r * cos + rotated * sin, rest], -1)

        block = torch.arange(t) // block_length
        allowed = block[None, :] <= block[:, None]
        x = w["model.word_embeddings.weight"][torch.tensor(ids)]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            qkv = h @ w[p + "attention.query_key_value.weight"].T
            if p + "attention.query_key_value.bias" in w:
                qkv = qkv + w[p + "attention.query_key_value.bias"]
            qkv = qkv.view(t, nh + 2 * nkv, hd).transpose(0, 1)
            q, k, v = qkv[:nh], qkv[nh : nh + nkv], qkv[nh + nkv :]
            q = rope(_rms(q, w[p + "attention.query_layernorm.weight"], eps))
            k = rope(_rms(k, w[p + "attention.key_layernorm.weight"], eps))
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
            out = attn.transpose(0, 1).reshape(t, nh * hd) @ w[p + "attention.dense.weight"].T
            if p + "attention.dense.bias" in w:
                out = out + w[p + "attention.dense.bias"]
            x = x + out
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + (self._moe(h, p) if i >= c.get("first_k_dense_replace", 0) else _swiglu(h, w, p + "mlp"))
        return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T

    def _moe(self, h: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.cfg, self.w
        n_exp, top_k = c["num_experts"], c["num_experts_per_tok"]
        expert_out = [_swiglu(h, w, f"{p}mlp.experts.{e}") for e in range(n_exp)]  # every expert, every row
        scores = torch.sigmoid(h @ w[p + "mlp.gate.weight"].T)
        biased = (scores + w[p + "mlp.gate.expert_bias"]).tolist()
        if c.get("expert_capacity") is not None:
            allowed = self._block_allowed(biased)
        else:
            allowed = [self._group_allowed(row) for row in biased]
        out = torch.zeros_like(h)
        for row in range(h.shape[0]):
            chosen = sorted(allowed[row], key=lambda e: -biased[row][e])[:top_k]
            weights = scores[row][chosen]
            if top_k > 1:
                weights = weights / (weights.sum() + 1e-20)
            weights = weights * c.get("routed_scaling_factor", 2.5)
            for e, wt in zip(chosen, weights, strict=True):
                out[row] += wt * expert_out[e][row]
        if c.get("num_shared_experts"):
            out = out + _swiglu(h, w, p + "mlp.shared_experts")
        return out

    def _group_allowed(self, biased: list[float]) -> list[int]:
        """One token's experts under group-limited routing: those of its `topk_group` best groups."""
        c = self.cfg
        n_exp, groups, keep = c["num_experts"], c["n_group"], c["topk_group"]
        size = n_exp // groups
        group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        return [e for e in range(n_exp) if e // size in kept]

    def _block_allowed(self, biased: list[list[float]]) -> list[list[int]]:
        """Every token's experts under block routing: the sequence's positions in blocks of `block_size`;
        an expert's block score is its largest biased score over the block's tokens; the
        `expert_capacity` best experts of its block."""
        c = self.cfg
        n_exp, size, capacity = c["num_experts"], c["block_size"], c["expert_capacity"]
        allowed = []
        for start in range(0, len(biased), size):
            block = biased[start : start + size]
            block_score = [max(token[e] for token in block) for e in range(n_exp)]
            allowed += [sorted(range(n_exp), key=lambda e: -block_score[e])[:capacity]] * len(block)
        return allowed


@dataclass
class Generation:
    """Output tokens (stop id kept), the global step of each token's last write (0: pinned by the
    template), the raw logprob of each token at that step (0.0 when pinned), why it ended, one event
    per step with every write of that step to a position below max_new_tokens, and per output index
    with an allowed set the raw probability mass that set held at the token's last write."""

    token_ids: list[int]
    step_map: list[int]
    logprobs: list[float]
    finish_reason: str
    trace: list[dict] = field(default_factory=list)
    label_mass: dict[int, float] = field(default_factory=dict)


def reference_generate(
    model: LLaDA2Reference,
    prompt_ids: list[int],
    *,
    rule: str,
    block_length: int,
    mask_id: int,
    max_new_tokens: int,
    stop_ids: set[int],
    threshold: float,
    edit_threshold: float = 0.0,
    max_post_edit_steps: int = 16,
    penalty_lambda: float = 0.0,
    template: list[int | None] | None = None,
    allowed: list[int] | dict[int, list[int]] | None = None,
    read_steps: int | None = None,
) -> Generation:
    """Greedy decoding, whole blocks. Each step, over the current block [s, e) and every generated
    position i in it: logits at i (lowered by `penalty_lambda` for the token at i-1 when i > s, under
    `joint_threshold`), candidate = argmax, p = its softmax probability.

    `low_confidence`: reveal every masked position with p >= threshold, else the most confident one;
    the block ends when no mask remains. `joint_threshold`: while masks remain, reveal every masked
    position with p > threshold, else the most confident one; when none remains, the block's post-edit
    count rises and beyond `max_post_edit_steps` the block ends; edit every generated non-mask position
    whose candidate differs from its token with p > edit_threshold; a step writing nothing ends the
    block. The output is cut at the first stop id of the final tokens, or at max_new_tokens.

    Typed decisions (`TypedDecisions`): a block opens with its pinned ids already revealed (never
    edited either) and takes no step when it opens without a mask; a slot's allowed set confines its
    row at every step, edits included. A read ignores `stop_ids` and `max_new_tokens` and counts the
    steps of the block holding the template's last slot: the `read_steps`-th one writes, besides the
    rule's writes, every template position still masked, and the read ends there. It ends sooner
    when the rule ends that block, and, under `low_confidence`, after the first step that leaves the
    block without a masked template position."""
    if rule not in ("low_confidence", "joint_threshold"):
        raise ValueError(f"unknown rule {rule!r}")
    decided = TypedDecisions.of(template, allowed, read_steps, mask_id, max_new_tokens)
    n_prompt = len(prompt_ids)
    read_block = None
    if decided.is_read:
        max_new_tokens, stop_ids = decided.length, set()
        read_block = (n_prompt + decided.last_slot) // block_length
    seq = list(prompt_ids)
    step_of: dict[int, int] = {}
    logprob_of: dict[int, float] = {}
    mass_of: dict[int, float] = {}
    trace: list[dict] = []
    counter = 0

    def cut() -> tuple[int, str] | None:
        out = seq[n_prompt:]
        for j, token in enumerate(out[:max_new_tokens]):
            if token in stop_ids:
                return j + 1, "stop"
        return (max_new_tokens, "length") if len(out) >= max_new_tokens else None

    while (end := cut()) is None:
        start = len(seq) // block_length * block_length
        stop = start + block_length
        gen = list(range(len(seq), stop))
        reading = start // block_length == read_block
        if not decided.open(seq, stop, n_prompt, mask_id, step_of, logprob_of):
            continue  # a fully pinned block: no step
        free = [r for r, i in enumerate(gen) if decided.pinned(i - n_prompt) is None]  # rows the rule may write
        post_edits = steps = 0
        while True:
            rows = model.logits(seq, block_length)[gen]
            raw = torch.log_softmax(rows, -1)
            logits = decided.restrict(rows, [i - n_prompt for i in gen])
            if rule == "joint_threshold" and penalty_lambda > 0:
                logits = logits.clone()
                for row, i in enumerate(gen):
                    if i > start:
                        logits[row, seq[i - 1]] -= penalty_lambda
            cand = logits.argmax(-1).tolist()
            prob = torch.softmax(logits, -1).max(-1).values.tolist()
            masked = [r for r, i in enumerate(gen) if seq[i] == mask_id]
            if rule == "low_confidence":
                if not masked:
                    break
                writes = [r for r in masked if prob[r] >= threshold]
                writes = writes or [min(masked, key=lambda r: (-prob[r], r))]
            else:
                if masked:
                    writes = [r for r in masked if prob[r] > threshold]
                    writes = writes or [min(masked, key=lambda r: (-prob[r], r))]
                else:
                    post_edits += 1
                    if post_edits > max_post_edit_steps:
                        break
                    writes = []
                writes += [r for r in free if seq[gen[r]] != mask_id and cand[r] != seq[gen[r]]
                           and prob[r] > edit_threshold]
                if not writes:
                    break
            steps += 1
            last = reading and steps == decided.read_steps
            if last:  # the read's last step writes the rest of the template too
                writes += [r for r in masked if gen[r] - n_prompt < decided.length and r not in writes]
            counter += 1
            writes = sorted(writes)
            for r in writes:
                seq[gen[r]] = cand[r]
                step_of[gen[r]] = counter
                logprob_of[gen[r]] = float(raw[r, cand[r]])
                if (mass := decided.mass(rows[r], gen[r] - n_prompt)) is not None:
                    mass_of[gen[r]] = mass
            shown = [r for r in writes if gen[r] - n_prompt < max_new_tokens]  # inside the possible output
            if shown:
                trace.append({"step": counter, "positions": [gen[r] - n_prompt for r in shown],
                              "token_ids": [cand[r] for r in shown]})
            if last or reading and rule == "low_confidence" and not decided.read_left(
                    [i for i in gen if seq[i] == mask_id], n_prompt):
                break
        if reading:
            end = decided.finish(seq, n_prompt, step_of, logprob_of)
            break
    length, reason = end
    positions = range(n_prompt, n_prompt + length)
    return Generation([seq[i] for i in positions], [step_of[i] for i in positions],
                      [logprob_of[i] for i in positions], reason, trace,
                      {i - n_prompt: mass_of[i] for i in positions if i in mass_of})
