"""`python -m bench.moe [--quick | --toy]`: block diffusion on an SDAR-MoE model, the engine against the SDAR
Hugging Face loop (`hf_baselines.sdar_generate` on `Qwen3MoeForCausalLM`) on the same weights.

The bench model: 8 layers, 16 experts, top 4, every layer routed, the real 151,936 vocabulary,
random weights. The engine serves `concurrency` requests at once; the HF loop decodes a sample of
them one by one (it is sequential) and its outputs must equal the engine's. Reported: tokens/s of
both, the share of the engine's generate time spent in the expert GEMM loop, and the expert FLOPs
done (routed rows only) against a dense layer that ran every expert on every token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.hf_baselines import load_hf, sdar_generate
from bench.models import DLLM_LOGIT_SCALE, VOCAB, mask_id_of, stop_ids_of
from engine import EngineConfig, GenerationConfig, pipeline
from testing.tiny_checkpoint import write_tiny_checkpoint

MOE_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 intermediate_size=1536, vocab_size=VOCAB, num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=384, norm_topk_prob=True)
TOY_MOE_SHAPE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=384, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True)
# mode -> (shape, concurrent requests, max_new_tokens, HF sample, longest prompt)
SIZES = {"full": (MOE_SHAPE, 32, 64, 4, 128), "quick": (MOE_SHAPE, 32, 32, 2, 48), "toy": (TOY_MOE_SHAPE, 4, 8, 1, 24)}
BLOCK, STRATEGY, THRESHOLD = 4, "low_confidence_dynamic", 0.85


def prompts_for(n: int, longest: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(16, longest, (n,), generator=g).tolist()
    return [torch.randint(0, 320, (k,), generator=g).tolist() for k in lengths]


def bench_moe(root: Path, mode: str) -> dict:
    """`mode`: full | quick | toy (SIZES)."""
    shape, concurrency, new_tokens, hf_sample, longest = SIZES[mode]
    path = write_tiny_checkpoint(root / "sdar_moe", model_type="sdar_moe", logit_scale=DLLM_LOGIT_SCALE,
                                 block_size=BLOCK, seed=1, **shape)
    prompts = prompts_for(concurrency, longest)
    cfg = EngineConfig(num_kv_blocks=1024, kv_block_size=16, max_batch_size=concurrency, dllm_block_length=BLOCK,
                       dllm_unmasking_strategy=STRATEGY, dllm_confidence_threshold=THRESHOLD)
    gen = GenerationConfig(max_new_tokens=new_tokens)
    with pipeline(str(path), cfg) as pipe:
        pipe(prompts[:2], gen)  # warm-up
        model = pipe.engine.executor.runner.model
        stats = model.moe_stats
        stats.routed_rows = stats.tokens = 0
        stats.expert_seconds, stats.timed = 0.0, True
        t = time.perf_counter()
        outs = pipe(prompts, gen)
        engine_s = time.perf_counter() - t
    engine_tokens = sum(len(o.token_ids) for o in outs)

    hf = load_hf(path)
    hf_tokens, hf_s, identical = 0, 0.0, True
    for prompt, out in zip(prompts[:hf_sample], outs, strict=False):
        t = time.perf_counter()
        tokens, _, _ = sdar_generate(hf, prompt, block_length=BLOCK, mask_id=mask_id_of(path),
                                     max_new_tokens=new_tokens, stop_ids=stop_ids_of(path), strategy=STRATEGY,
                                     denoising_steps=BLOCK, threshold=THRESHOLD)
        hf_s += time.perf_counter() - t
        hf_tokens += len(tokens)
        identical &= tokens == out.token_ids

    h, inter, k, e = (shape[n] for n in ("hidden_size", "moe_intermediate_size", "num_experts_per_tok",
                                          "num_experts"))
    per_row = 2 * 3 * h * inter  # gate, up and down GEMMs of one token through one expert
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    return {
        "model": shape, "concurrency": concurrency, "max_new_tokens": new_tokens,
        "engine": {"requests": len(prompts), "tokens": engine_tokens, "seconds": round(engine_s, 2),
                   "tokens_per_s": round(engine_tps, 1)},
        "hf_sdar_loop": {"requests": hf_sample, "tokens": hf_tokens, "seconds": round(hf_s, 2),
                         "tokens_per_s": round(hf_tps, 1)},
        "ratio_vs_hf": round(engine_tps / hf_tps, 2),
        "outputs_identical_on_hf_sample": identical,
        "expert_gemm_share_of_generate_time": round(stats.expert_seconds / engine_s, 3),
        "expert_gflops_routed": round(stats.routed_rows * per_row / 1e9, 2),
        "expert_gflops_dense_every_expert": round(stats.tokens * e * per_row / 1e9, 2),
        "routed_over_dense": round(stats.routed_rows / (stats.tokens * e), 4),
        "top_k_over_experts": k / e,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter prompts and outputs, a 2-request HF sample")
    size.add_argument("--toy", action="store_true", help="a toy model (seconds; figures meaningless)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mode = "toy" if args.toy else "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        t = time.perf_counter()
        result = bench_moe(Path(tmp), mode)
    result["command"] = "python -m bench.moe" + ("" if mode == "full" else f" --{mode}")
    result["wall_seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(result, indent=1))
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
