"""The baselines, written the way their users write them on Hugging Face transformers.

* DLLM: the SDAR reference generation loop (JetAstra/SDAR `generate.py`): the prompt's full blocks
  prefilled into a `DynamicCache`; then per block, every denoising step re-runs the current block
  over the cached prefix (block-causal: the block sees the prefix and itself) and crops the cache
  back; once the block is fully unmasked one commit forward appends its K/V. One request at a time.
  Greedy, same strategy / threshold / steps as the engine, so the outputs must be identical. As in
  the SDAR script, every forward returns the logits of all its positions (prefill and commit
  forwards included); the confidence rule is the engine's (>= threshold, ties to the lower position).
* AR: `model.generate()` with its KV cache, the batch left-padded.
* Scoring: one forward, `log_softmax` over the full vocabulary, gather the targets.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from testing.tiny_checkpoint import load_hf_reference


def load_hf(path: Path, attn: str = "sdpa") -> transformers.PreTrainedModel:
    """Load a bench checkpoint into HF `Qwen3ForCausalLM` (SDAR is Qwen3 layers) or, for the MoE
    types, `Qwen3MoeForCausalLM`."""
    return load_hf_reference(path, attn_implementation=attn)


def _cache_argument(model: transformers.PreTrainedModel) -> str:
    """The name `forward` takes its KV cache by: `cache` in current transformers, `past_key_values` before it
    (an unknown keyword would be swallowed by `**kwargs` and the loop would run without its cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ---- DLLM: the SDAR block-diffusion loop ----------------------------------------------------------
def _block_causal(q_start: int, q_len: int, kv_len: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, q_len, kv_len] mask in the model's dtype: query i sees key j iff j // B <= i // B."""
    qb = (torch.arange(q_start, q_start + q_len) // block)[:, None]
    kb = (torch.arange(kv_len) // block)[None, :]
    mask = torch.zeros(q_len, kv_len, dtype=dtype)
    mask.masked_fill_(kb > qb, torch.finfo(dtype).min)
    return mask[None, None]


def _transfer_index(confidence: torch.Tensor, masked: torch.Tensor, n: int, strategy: str,
                    threshold: float) -> torch.Tensor:
    """Which block positions to unmask this step (bool [B]); ties go to the lower position."""
    conf = torch.where(masked, confidence, torch.tensor(-float("inf")))
    pick = torch.zeros_like(masked)
    if strategy == "sequential":
        pick[masked.nonzero()[:n, 0]] = True
        return pick
    if strategy == "low_confidence_dynamic":
        high = conf >= threshold
        if int(high.sum()) >= n:
            return high
    order = torch.sort(conf, descending=True, stable=True).indices
    pick[order[:n]] = True
    return pick


@torch.inference_mode()
def sdar_generate(model, prompt: list[int], *, block_length: int, mask_id: int, max_new_tokens: int,
                  stop_ids: set[int], strategy: str, denoising_steps: int, threshold: float,
                  on_first_block=None) -> tuple[list[int], int, int]:
    """Greedy SDAR decoding of one prompt; returns (output token ids, forwards run, LM-head rows)."""
    b = block_length
    prompt_len = len(prompt)
    num_blocks = -(-(prompt_len + max_new_tokens) // b)
    x = torch.full((1, num_blocks * b), mask_id, dtype=torch.long)
    x[0, :prompt_len] = torch.tensor(prompt)
    positions = torch.arange(num_blocks * b)[None]
    kv = DynamicCache(config=model.config)
    cache = {_cache_argument(model): kv}
    forwards = rows = 0
    prefill = prompt_len // b * b
    if prefill:
        model(x[:, :prefill], attention_mask=_block_causal(0, prefill, prefill, b, model.dtype),
              position_ids=positions[:, :prefill], **cache, use_cache=True)
        forwards, rows = forwards + 1, rows + prefill
    stops = torch.tensor(sorted(stop_ids))
    for k in range(prefill // b, num_blocks):
        lo, hi = k * b, (k + 1) * b
        cur = x[:, lo:hi].clone()
        mask = torch.zeros(1, 1, b, hi, dtype=model.dtype)  # the block sees the whole prefix and itself
        total = int((cur == mask_id).sum())
        step = 0
        while True:
            masked = cur[0] == mask_id
            if not bool(masked.any()):  # commit forward: append the block's final K/V
                model(cur, attention_mask=mask, position_ids=positions[:, lo:hi], **cache, use_cache=True)
                forwards, rows = forwards + 1, rows + b
                break
            logits = model(cur, attention_mask=mask, position_ids=positions[:, lo:hi], **cache,
                           use_cache=True).logits[0].float()
            kv.crop(lo - kv.get_seq_length())  # drop the block's K/V again
            forwards, rows = forwards + 1, rows + b
            probs = logits.softmax(-1)
            conf, cand = probs.max(-1)
            n = total // denoising_steps + (1 if step < total % denoising_steps else 0)
            pick = _transfer_index(conf, masked, max(n, 1), strategy, threshold)
            cur[0, pick] = cand[pick]
            step += 1
        x[:, lo:hi] = cur
        if on_first_block is not None and k == prefill // b:
            on_first_block()
        gen = x[0, prompt_len:hi]
        if bool(torch.isin(gen, stops).any()) or hi - prompt_len >= max_new_tokens:
            break
    return cut_output(x[0, prompt_len:].tolist(), max_new_tokens, stop_ids), forwards, rows


def cut_output(generated: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The output: generated tokens cut at the first stop id (kept) or at max_new_tokens."""
    out = generated[:max_new_tokens]
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1]
    return out


# ---- AR: generate() with left padding ---------------------------------------------------------------
@torch.inference_mode()
def ar_generate(model, prompts: list[list[int]], max_new_tokens: list[int], stop_ids: set[int],
                pad_id: int) -> tuple[list[list[int]], int]:
    """One batched greedy `generate()` call, left padded, run to the longest request's budget (or until
    every row has stopped). Returns the outputs and the LM-head rows it projected (batch x steps)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max(max_new_tokens), do_sample=False,
                         eos_token_id=sorted(stop_ids), pad_token_id=pad_id, temperature=None, top_p=None,
                         top_k=None)
    gen = out[:, width:].tolist()
    return [cut_output(g, m, stop_ids) for g, m in zip(gen, max_new_tokens)], out.shape[0] * (out.shape[1] - width)


# ---- scoring: forward + log_softmax --------------------------------------------------------------
@torch.inference_mode()
def score(model, seqs: list[list[int]], start: int, batch_size: int) -> list[list[float]]:
    """log p(input_ids[j+1] | input_ids[:j+1]) for j >= start, batches of equal-length sequences."""
    out: list[list[float]] = []
    for i in range(0, len(seqs), batch_size):
        ids = torch.tensor(seqs[i : i + batch_size])
        logits = model(input_ids=ids).logits
        logprobs = logits[:, start:-1].float().log_softmax(-1)
        out += logprobs.gather(-1, ids[:, start + 1 :, None])[..., 0].tolist()
        del logits, logprobs
    return out


def timed(fn, *args, **kw):
    t = time.perf_counter()
    result = fn(*args, **kw)
    return result, time.perf_counter() - t
