"""Nemotron-Labs-Diffusion's three modes on the engine, against the release's loops, and LinearSpec's
speed against `ar` on a checkpoint whose drafts agree with its autoregressive tokens.

`python -m bench.nemotron [--toy] [--requests 8] [--tokens 64] [--prompt-len 24] [--check 2]
[--train-steps 300]`, in one run:

- **modes**: a random-weight checkpoint of the family (`--toy`: the tiny test shape; else hidden 512,
  8 layers, the byte tokenizer's vocabulary, block 8) decodes the same prompts greedily (`ignore_eos`)
  in each `dllm_mode` -- `ar`, `diffusion` (threshold 0.9) and `linear_spec` (threshold 0: one draft
  forward per iteration) -- on the offline engine with `--requests` in flight together and one at a
  time; the release's loops (`testing.references.nemotron_labs_diffusion`: the model card's
  `ar_generate`, `generate` and `linear_spec_generate`, full recompute over transformers'
  `Ministral3ForCausalLM`, batch 1, as the release runs them) decode the first `--check` prompts one
  after the other, for their tokens (the engine's must be the same) and their tokens per second.
  Random weights rarely agree with their own drafts, so `linear_spec`'s acceptance here is a floor.
- **drafting**: the tiny checkpoint trained `--train-steps` CPU steps on a periodic toy language
  (`testing.tiny.nemotron_drafting`), so that its drafts agree with its autoregressive tokens as a
  trained model's do; `ar` and `linear_spec` decode periodic prompts one at a time. What the
  acceptance predicts is the ratio of forwards per token (`ar`: 1; `linear_spec`: its drafts and
  verifies over the tokens they emit), which equals the speed-up when a forward of B rows costs what a
  forward of one does; `measured_over_predicted` says how close the seconds come.

It prints one JSON object.
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
from testing.tiny.nemotron_drafting import periodic, write_drafting_nemotron
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


def new_engine(path: Path, requests: int, prompt_len: int, tokens: int, block: int) -> LLMEngine:
    return LLMEngine(str(path), EngineConfig(max_model_len=prompt_len + tokens + 2 * block, kv_block_size=16,
                                             num_kv_blocks=requests * (-(-(prompt_len + tokens) // 16) + 4),
                                             max_batch_size=requests))


def modes(root: Path, toy: bool, requests: int, tokens: int, prompt_len: int, check: int) -> dict[str, Any]:
    """Every mode on random weights: the engine at `requests` and 1 concurrent, the release loop on `check`
    prompts one after the other."""
    path = write_tiny_nemotron_labs_diffusion(root / "nld", seed=5, logit_scale=8.0, **({} if toy else BENCH_SHAPE))
    cfg = json.loads((path / "config.json").read_text())
    block, mask_id = cfg["block_size"], cfg["mask_token_id"]
    engine = new_engine(path, requests, prompt_len, tokens, block)
    model, batch = load_ministral3(path), prompts(requests, prompt_len)
    report: dict[str, Any] = {}
    for mode, threshold in MODES.items():
        params = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, dllm_mode=mode,
                                  dllm_confidence_threshold=threshold)
        decode(engine, batch[:2], params, 2)  # warm-up
        together, many_s, many_fwd = decode(engine, batch, params, requests)
        _, one_s, _ = decode(engine, batch, params, 1)
        checked = min(check, requests)
        start = time.perf_counter()
        loop = [release(model, batch[i], mode, tokens, block, mask_id) for i in range(checked)]
        loop_s = time.perf_counter() - start
        generated = requests * tokens
        row: dict[str, Any] = {
            f"concurrent_{requests}_tok_s": round(generated / many_s, 1), f"concurrent_{requests}_s": round(many_s, 3),
            "concurrent_1_tok_s": round(generated / one_s, 1), "concurrent_1_s": round(one_s, 3),
            "forwards_per_token": round(many_fwd / generated, 3),
            "release_tok_s": round(checked * tokens / loop_s, 1),
            f"engine_{requests}_over_release": round(generated / many_s / (checked * tokens / loop_s), 2),
            "identical_to_release": sum(together[i]["tokens"] == loop[i] for i in range(checked)),
            "checked": checked}
        if mode == "linear_spec":
            row["nfe_per_token"] = round(sum(r["nfe"] for r in together) / generated, 3)
            row["mean_accepted"] = round(statistics.mean(a for r in together for a in r["acceptance"]), 3)
        report[mode] = row
    engine.shutdown()
    return report


def drafting(root: Path, steps: int, requests: int, tokens: int, prompt_len: int, toy: bool) -> dict[str, Any]:
    """`ar` against `linear_spec`, one request at a time, on the tiny checkpoint trained to draft (`toy`: a
    few small batches, for the run's shape only)."""
    torch.manual_seed(0)
    path = write_drafting_nemotron(root / "drafting", steps=steps, **(dict(batch=4, length=32) if toy else {}))
    block = json.loads((path / "config.json").read_text())["block_size"]
    engine = new_engine(path, 1, prompt_len, tokens, block)
    batch = periodic(requests, prompt_len, torch.Generator().manual_seed(1)).tolist()
    generated, out = requests * tokens, {}
    for mode in ("ar", "linear_spec"):
        params = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, dllm_mode=mode)
        decode(engine, batch[:1], params, 1)  # warm-up
        results, seconds, forwards = decode(engine, batch, params, 1)
        out[mode] = {"tok_s": round(generated / seconds, 1), "s": round(seconds, 3),
                     "forwards_per_token": round(forwards / generated, 3), "tokens": [r["tokens"] for r in results]}
        if mode == "linear_spec":
            out[mode]["mean_accepted"] = round(statistics.mean(a for r in results for a in r["acceptance"]), 3)
    engine.shutdown()
    ar, spec = out["ar"], out["linear_spec"]
    predicted = ar["forwards_per_token"] / spec["forwards_per_token"]
    measured = spec["tok_s"] / ar["tok_s"]
    report = {"train_steps": steps, "requests": requests, "block_size": block,
              "greedy_equal_to_ar": sum(a == b for a, b in zip(ar.pop("tokens"), spec.pop("tokens"), strict=True)),
              "ar": ar, "linear_spec": spec, "predicted_speedup": round(predicted, 2),
              "measured_speedup": round(measured, 2), "measured_over_predicted": round(measured / predicted, 3)}
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="the tiny test shape and a short training: seconds, figures "
                    "meaningless")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--check", type=int, default=2, help="prompts decoded by the release loops too")
    ap.add_argument("--train-steps", type=int, default=300, help="training steps of the drafting checkpoint")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report = {"toy": args.toy, "requests": args.requests, "tokens": args.tokens, "prompt_len": args.prompt_len,
                  "modes": modes(root, args.toy, args.requests, args.tokens, args.prompt_len, args.check),
                  "drafting": drafting(root, 5 if args.toy else args.train_steps, args.requests, args.tokens,
                                       args.prompt_len, args.toy)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
