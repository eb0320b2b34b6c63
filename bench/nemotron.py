"""Nemotron-Labs-Diffusion's three modes on the engine, against the release's loops.

`python -m bench.nemotron [--toy] [--requests 16] [--tokens 64] [--prompt-len 24]` writes a random-weight
checkpoint of the family (`--toy`: the tiny test shape; else hidden 512, 8 layers, the byte tokenizer's
vocabulary, block 8), then decodes the same prompts greedily (`ignore_eos`) in each `dllm_mode` --
`ar`, `diffusion` (threshold 0.9) and `linear_spec` (threshold 0: one draft forward per iteration):

- **engine**: the offline engine with every request in flight together, and one at a time;
- **release**: the reference loops (`testing.references.nemotron_labs_diffusion`: the
  model card's `ar_generate`, `generate` and `linear_spec_generate`, full recompute over transformers'
  `Ministral3ForCausalLM`, batch 1) on the first `--check` prompts, for the tokens.

It prints one JSON object: per mode the engine's seconds and tokens per second at both concurrencies,
its forwards per output token, for `linear_spec` the release's forward count (`nfe`) per token and the
mean tokens a verify accepted, and how many of the checked prompts give the release's tokens (all must).
Random weights rarely agree with their own drafts, so `linear_spec`'s acceptance here is a floor, not
what a trained checkpoint reaches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig, GenerationConfig
from engine.core.llm_engine import LLMEngine
from testing.references import nemotron_labs_diffusion as ref
from testing.tiny.nemotron_labs_diffusion import load_ministral3, write_tiny_nemotron_labs_diffusion

MODES = {"ar": None, "diffusion": 0.9, "linear_spec": None}  # mode -> its dllm_confidence_threshold
BENCH_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                   intermediate_size=1536, original_max_position_embeddings=256)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (length,), generator=g).tolist() for _ in range(n)]


def decode(engine: LLMEngine, batch: list[list[int]], params: GenerationConfig, concurrent: int
           ) -> tuple[list[dict[str, Any]], float, int]:
    """(per prompt its tokens, nfe and acceptance lengths; seconds; forwards), `concurrent` in flight."""
    out: list[dict[str, Any]] = [{"tokens": [], "nfe": None, "acceptance": []} for _ in batch]
    forwards, start = engine.stats.forwards, time.perf_counter()
    for first in range(0, len(batch), concurrent):
        for i in range(first, min(first + concurrent, len(batch))):
            engine.add_request(batch[i], params, str(i))
        while engine.has_unfinished():
            for chunk in engine.step():
                got = out[int(chunk.request_id)]
                got["tokens"] += chunk.token_ids
                got["nfe"] = chunk.nfe if chunk.nfe is not None else got["nfe"]
                got["acceptance"] += chunk.acceptance_lengths or []
    return out, time.perf_counter() - start, engine.stats.forwards - forwards


def release(model: Any, prompt: list[int], mode: str, tokens: int, block: int, mask_id: int) -> list[int]:
    """The release loop's greedy tokens."""
    if mode == "ar":
        return ref.ar_generate(model, prompt, max_new_tokens=tokens, eos_ids=set()).token_ids
    if mode == "diffusion":
        return ref.diffusion_generate(model, prompt, max_new_tokens=tokens, block_length=block, mask_id=mask_id,
                                      eos_ids=set(), threshold=MODES[mode]).token_ids
    return ref.linear_spec_generate(model, prompt, max_new_tokens=tokens, block_length=block, mask_id=mask_id,
                                    eos_ids=set()).token_ids


def run(root: Path, toy: bool, requests: int, tokens: int, prompt_len: int, check: int) -> dict[str, Any]:
    path = write_tiny_nemotron_labs_diffusion(root / "nld", seed=5, logit_scale=8.0, **({} if toy else BENCH_SHAPE))
    cfg = json.loads((path / "config.json").read_text())
    block, mask_id = cfg["block_size"], cfg["mask_token_id"]
    engine = LLMEngine(str(path), EngineConfig(max_model_len=prompt_len + tokens + 2 * block, kv_block_size=16,
                                               num_kv_blocks=requests * (-(-(prompt_len + tokens) // 16) + 4),
                                               max_batch_size=requests))
    model, batch = load_ministral3(path), prompts(requests, prompt_len)
    report: dict[str, Any] = {"toy": toy, "requests": requests, "tokens": tokens, "prompt_len": prompt_len,
                              "block_size": block, "modes": {}}
    for mode, threshold in MODES.items():
        params = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, dllm_mode=mode,
                                  dllm_confidence_threshold=threshold)
        decode(engine, batch[:2], params, 2)  # warm-up
        together, many_s, many_fwd = decode(engine, batch, params, requests)
        _, one_s, _ = decode(engine, batch, params, 1)
        generated = requests * tokens
        row: dict[str, Any] = {
            f"concurrent_{requests}_tok_s": round(generated / many_s, 1), f"concurrent_{requests}_s": round(many_s, 3),
            "concurrent_1_tok_s": round(generated / one_s, 1), "concurrent_1_s": round(one_s, 3),
            "forwards_per_token": round(many_fwd / generated, 3),
            "identical_to_release": sum(together[i]["tokens"] == release(model, batch[i], mode, tokens, block, mask_id)
                                        for i in range(min(check, requests))),
            "checked": min(check, requests)}
        if mode == "linear_spec":
            row["nfe_per_token"] = round(sum(r["nfe"] for r in together) / generated, 3)
            row["mean_accepted"] = round(statistics.mean(a for r in together for a in r["acceptance"]), 3)
        report["modes"][mode] = row
    engine.shutdown()
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="the tiny test shape: seconds, figures meaningless")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--check", type=int, default=2, help="prompts checked against the release loops")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(Path(tmp), args.toy, args.requests, args.tokens, args.prompt_len, args.check), indent=2))


if __name__ == "__main__":
    main()
