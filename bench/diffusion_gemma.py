"""DiffusionGemma renoising decoding: the engine's canvas loop vs transformers' `generate()`.

`python -m bench.diffusion_gemma [--requests 8] [--max-new-tokens 64] [--canvas 32] [--steps 16]`
writes a tiny random diffusion_gemma checkpoint whose canvases converge (`converging_checkpoint`),
then decodes the same seeded prompts on both sides, float32 on CPU:

- **transformers**: `generate()` one request at a time (`torch.manual_seed(seed)` before each) and
  once as its own static batch of all requests;
- **engine**: `LLMEngine`, one request at a time and all requests in flight together (one forward
  serves every request's pass).

After an untimed warm-up of both, it prints one JSON object: seconds and generated tokens per
second per side and mode, and how many seeded requests got tokens identical to transformers'
batch-1 output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from configs import EngineConfig, GenerationConfig
from engine.core.decoding.renoising import RenoiseKnobs
from engine.core.llm_engine import LLMEngine
from engine.model.families.diffusion_gemma.reference import load_reference
from engine.model.families.diffusion_gemma.tiny import write_tiny_diffusion_gemma


def converging_checkpoint(path: Path, canvas_length: int, norm_scale: float = 12.0,
                          self_conditioning_scale: float = 0.05, **text_kwargs) -> Path:
    """A tiny random checkpoint that behaves like a trained one under renoising: the final norm scaled
    up (peaked distributions, so the stop rule ends canvases after varying numbers of steps) and the
    self-conditioning output scaled down (a random network's self-conditioning amplifies float32
    rounding differences 2-4x per step; damped, two implementations keep drawing alike)."""
    path = write_tiny_diffusion_gemma(path, canvas_length=canvas_length, **text_kwargs)
    weights = load_file(path / "model.safetensors")
    weights["model.decoder.norm.weight"] *= norm_scale
    weights["model.decoder.self_conditioning.down_proj.weight"] *= self_conditioning_scale
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(requests: int, max_new_tokens: int, canvas: int, steps: int, prompt_len: int = 12) -> dict:
    knobs = RenoiseKnobs(max_denoising_steps=steps, stability_threshold=0, stop_entropy=0.8)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = converging_checkpoint(Path(tmp) / "tiny", canvas)
        model = load_reference(ckpt)
        eng = LLMEngine(str(ckpt), EngineConfig(
            device="cpu", kv_block_size=16, num_kv_blocks=4096, max_batch_size=max(requests, 1),
            max_prefill_token_num=max(256, prompt_len),
            **{f"dllm_{name}": value for name, value in vars(knobs).items()}))
    vocab = eng.spec.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(requests)]
    hf_kwargs = {"max_new_tokens": max_new_tokens, "max_denoising_steps": steps, "t_min": knobs.t_min,
                 "t_max": knobs.t_max, "stability_threshold": 0, "confidence_threshold": knobs.stop_entropy}

    def hf_one() -> list[list[int]]:
        out = []
        for seed, prompt in enumerate(prompts):
            torch.manual_seed(seed)
            out.append(model.generate(torch.tensor([prompt]), **hf_kwargs).sequences[0, prompt_len:]
                       [:max_new_tokens].tolist())
        return out

    def hf_batch() -> None:
        torch.manual_seed(0)
        model.generate(torch.tensor(prompts), **hf_kwargs)

    def engine(concurrent: int) -> list[list[int]]:
        done: dict[int, list[int]] = {}
        for first in range(0, requests, concurrent):
            for seed in range(first, min(first + concurrent, requests)):
                done[seed] = []
                eng.add_request(prompts[seed], GenerationConfig(max_new_tokens=max_new_tokens, random_seed=seed),
                                str(seed))
            while eng.has_unfinished():
                for chunk in eng.step():
                    done[int(chunk.request_id)] += chunk.token_ids
        return [done[i] for i in range(requests)]

    tokens = requests * max_new_tokens
    hf_batch(), engine(requests)  # warm-up, untimed
    hf_tokens, hf1 = _timed(hf_one)
    _, hfb = _timed(hf_batch)
    eng_tokens, e1 = _timed(lambda: engine(1))
    _, en = _timed(lambda: engine(requests))
    return {
        "requests": requests, "max_new_tokens": max_new_tokens, "canvas_length": canvas, "max_denoising_steps": steps,
        "transformers": {"batch_1_s": round(hf1, 3), "batch_1_tok_s": round(tokens / hf1, 1),
                         f"static_batch_{requests}_s": round(hfb, 3),
                         f"static_batch_{requests}_tok_s": round(tokens / hfb, 1)},
        "engine": {"concurrent_1_s": round(e1, 3), "concurrent_1_tok_s": round(tokens / e1, 1),
                   f"concurrent_{requests}_s": round(en, 3), f"concurrent_{requests}_tok_s": round(tokens / en, 1)},
        "identical_to_transformers": sum(a == b for a, b in zip(eng_tokens, hf_tokens, strict=True)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--canvas", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args.requests, args.max_new_tokens, args.canvas, args.steps), indent=2))


if __name__ == "__main__":
    main()
