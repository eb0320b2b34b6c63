"""Fast-dLLM v2 decoding: the engine vs NVlabs' `generate()` loop on the same checkpoint.

`python -m bench.fast_dllm [--toy] [--tokens 256] [--prompt-len 20] [--device auto]` writes a
Fast_dLLM_Qwen checkpoint (the bench shape of `bench.models` with the real 151,936-token vocabulary,
or the toy shape), then decodes the same prompts greedily (threshold 0.9, sub-blocks of 8, B = 32,
`ignore_eos`) at 1 and 8 concurrent requests on both sides:

- **nvlabs**: this module's copy of the published `generate()` loop's semantics, one request at a
  time as it runs: a KV cache of committed blocks (Hugging Face `Qwen2ForCausalLM` and its
  `DynamicCache`), every sub-block step a forward over the current block whose K/V are dropped after
  (the published `update_past_key_values=False`), the forward that commits a finished block giving
  the next block's first token, no `use_block_cache`;
- **engine**: the offline pipeline, all requests of a round in flight together.

It prints one JSON object: seconds and tokens per second of each side per concurrency, forwards per
block of each, and whether the tokens are identical (they must be; a prompt of exactly one block is
avoided, where the published loop skips the prompt).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen2ForCausalLM

from bench.models import TOY_SHAPE, BenchShape
from engine import EngineConfig, GenerationConfig, pipeline
from testing.tiny_fast_dllm import FAST_DLLM_TEST_LOGIT_SCALE, load_hf_qwen2, write_tiny_fast_dllm

B, S, THRESHOLD = 32, 8, 0.9


def _forward(model: Qwen2ForCausalLM, ids: list[int], cache: DynamicCache, commit: bool) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` after the cached prefix, every query seeing the whole prefix and
    every fed token (the fed tokens are whole blocks, or the prompt's first partial one). The fed
    K/V stay in `cache` only when `commit`."""
    past = cache.get_seq_length()
    n = len(ids)
    block = (torch.arange(past, past + n) // B)[:, None] >= (torch.arange(past + n) // B)[None, :]
    mask = torch.zeros(n, past + n, dtype=model.dtype, device=model.device)
    mask.masked_fill_(~block.to(model.device), torch.finfo(model.dtype).min)
    out = model(input_ids=torch.tensor([ids], device=model.device), attention_mask=mask[None, None],
                position_ids=torch.arange(past, past + n, device=model.device)[None], cache=cache,
                use_cache=True)
    if not commit:
        cache.crop(-n)
    return out.logits[0].float()


@torch.inference_mode()
def nvlabs_generate(model: Qwen2ForCausalLM, prompt: list[int], max_new_tokens: int, mask_id: int
                    ) -> tuple[list[int], int]:
    """(generated tokens cut at `max_new_tokens`, forwards): the published loop, greedy, no stop token."""
    cache, x, forwards = DynamicCache(), list(prompt), 0
    full = len(x) // B * B
    if len(x) > B:  # the published loop's prefill of the prompt's whole blocks (skipped when P == B)
        logits = _forward(model, x[:full], cache, commit=True)
        forwards += 1
        if len(x) % B == 0:
            x.append(int(logits[-1].argmax()))
    while len(x) - len(prompt) < max_new_tokens:
        start = cache.get_seq_length()
        x += [mask_id] * (start + B - len(x))
        for lo in range(0, B, S):
            while any(t == mask_id for t in x[start + lo : start + lo + S]):
                logits = _forward(model, x[start:], cache, commit=False)
                forwards += 1
                shifted = torch.cat([logits[:1], logits[:-1]])[lo : lo + S]  # row i-1 for position i
                probs = shifted.softmax(-1)
                conf, cand = probs.max(-1)
                masked = torch.tensor([t == mask_id for t in x[start + lo : start + lo + S]])
                conf = torch.where(masked, conf, torch.tensor(-torch.inf))
                reveal = (conf > THRESHOLD) & masked
                reveal[int(conf.argmax())] = True
                for j in reveal.nonzero()[:, 0].tolist():
                    x[start + lo + j] = int(cand[j])
        logits = _forward(model, x[start:], cache, commit=True)  # commit; the next block's first token
        forwards += 1
        x.append(int(logits[-1].argmax()))
    return x[len(prompt) : len(prompt) + max_new_tokens], forwards


def measure(path: Path, tokens: int, prompt_len: int, device: str) -> dict:
    if prompt_len % B == 0 and prompt_len <= B:
        raise ValueError(f"--prompt-len {prompt_len}: the published loop skips a prompt of exactly one block")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, min(vocab, 300)) for _ in range(prompt_len)] for _ in range(8)]
    gen = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    config = EngineConfig(device=device, dtype="float32", max_batch_size=8, max_model_len=prompt_len + tokens + 2 * B,
                          dllm_sub_block_length=S, dllm_confidence_threshold=THRESHOLD)
    out: dict = {"tokens": tokens, "prompt_len": prompt_len, "block_length": B, "sub_block_length": S,
                 "threshold": THRESHOLD, "vocab_size": vocab}
    with pipeline(str(path), config) as pipe:
        runner_device = pipe.engine.executor.runner.device
        mask_id = pipe.engine.mask_id
        hf = load_hf_qwen2(path).to(runner_device)
        pipe(prompts[0], gen.model_copy(update={"max_new_tokens": 8}))  # warm-up
        nvlabs_generate(hf, prompts[0], 8, mask_id)
        for concurrency in (1, 8):
            batch = prompts[:concurrency]
            before = pipe.engine.stats.forwards
            t = time.perf_counter()
            engine_out = pipe(batch, gen)
            engine_s = time.perf_counter() - t
            engine_forwards = pipe.engine.stats.forwards - before
            t = time.perf_counter()
            ref = [nvlabs_generate(hf, p, tokens, mask_id) for p in batch]
            nvlabs_s = time.perf_counter() - t
            blocks = concurrency * -(-(prompt_len + tokens) // B)
            out[f"concurrency_{concurrency}"] = {
                "engine_s": round(engine_s, 3), "nvlabs_s": round(nvlabs_s, 3),
                "engine_tokens_per_s": round(concurrency * tokens / engine_s, 1),
                "nvlabs_tokens_per_s": round(concurrency * tokens / nvlabs_s, 1),
                "speedup": round(nvlabs_s / engine_s, 2),
                "engine_forwards": engine_forwards, "nvlabs_forwards": sum(f for _, f in ref),
                "engine_steps_per_block": round(sum(max(o.step_map) for o in engine_out) / blocks, 2),
                "nvlabs_forwards_per_block": round(sum(f for _, f in ref) / blocks, 2),
                "identical_tokens": [o.token_ids for o in engine_out] == [r for r, _ in ref],
            }
        out["device"] = str(runner_device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--toy", action="store_true", help="the toy model shape (seconds; figures meaningless)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape = asdict(TOY_SHAPE if args.toy else BenchShape())
    shape.pop("head_dim")  # Qwen2: hidden_size / num_attention_heads
    shape.pop("max_position_embeddings")
    with tempfile.TemporaryDirectory(prefix="bench-fast-dllm-") as tmp:
        path = write_tiny_fast_dllm(Path(tmp) / "fast_dllm", logit_scale=FAST_DLLM_TEST_LOGIT_SCALE, seed=1,
                                    max_position_embeddings=8192, **shape)
        print(json.dumps(measure(path, args.tokens, args.prompt_len, args.device)))


if __name__ == "__main__":
    main()
