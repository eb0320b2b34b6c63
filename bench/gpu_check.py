"""The GPU check: `python -m bench.gpu_check` prints each part's JSON line as it finishes, then the whole
report as one JSON object (about 3 minutes on one H200; a part that raises reports its error and the
others still run).

1. `flash`: the flash backend against the torch backend, bf16, on random page tables (AR and DLLM
   batches: prefill chunks, denoising steps, fused commit + next block, decode rows).
2. `greedy`: greedy DLLM and AR outputs (tokens, step_map) of tiny checkpoints in bf16 against the
   same engine in fp32 on the same GPU; the share of identical outputs, and at each first differing
   token the fp32 run's logprob gap between the two choices (bf16 flips near-ties; a bug flips clear calls).
3. `seeded_sampling`: sampled requests with seeds, served twice in different batch mixes: identical.
4. `throughput`: an SDAR-1.7B-shaped random-weight model (hidden 2048, 28 layers, 16 / 8 heads x 128,
   MLP 6144, vocabulary 151,936, block 4) served at 1, 32 and 128 concurrent requests, against the SDAR
   reference loop on HF transformers (bench/hf_baselines.py) on the same GPU, tokens/s and output match.
5. `float32_reference`: part 4 at one request at a time in float32, where the engine's outputs must
   match the reference loop's exactly (bf16's rounding flips confidences at the unmasking threshold).

Where CUDA is absent it prints why and exits 0. Every part is a function of (device, dtype, ...) so
tests/test_gpu_check.py runs them on the CPU in float32 with tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bench import hf_baselines as hf
from bench.measure import run_engine
from bench.models import DLLM_LOGIT_SCALE, BenchShape, mask_id_of, stop_ids_of
from bench.workloads import Traffic, make_prompts
from configs import EngineConfig, GenerationConfig
from engine.core.llm_engine import LLMEngine
from ops.attention import AttentionMetadata, FlashAttention, TorchAttention
from ops.flash_kernel import INSTALLED, FlashKernel
from tools.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

SDAR_1_7B = BenchShape(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144)
BLOCK, STRATEGY, THRESHOLD = 4, "low_confidence_dynamic", 0.85
PAGE = 16
# (tokens already cached, tokens fed now) per sequence
ATTENTION_BATCHES = {
    "ar": ([(0, 300), (128, 64), (517, 1), (33, 1), (1000, 1)], None),
    "dllm": ([(0, 256), (96, 32), (508, 8), (300, 4), (64, 4)], BLOCK),
}


# ---- 1. flash == torch ---------------------------------------------------------------------------------------
def compare_attention(kernel: FlashKernel, device: torch.device, dtype: torch.dtype, heads: int = 16,
                      kv_heads: int = 8, head_dim: int = 128, seed: int = 0) -> dict:
    """Max |flash - torch| per batch: both backends on the same `dtype` inputs, the torch one in float32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shapes, block_length) in ATTENTION_BATCHES.items():
        pages_needed = [-(-(c + f) // PAGE) for c, f in shapes]
        num_pages = sum(pages_needed) + 8
        perm = torch.randperm(num_pages, generator=g).tolist()
        tables, slots, positions = [], [], []
        for (cached, fed), n in zip(shapes, pages_needed):
            table = [perm.pop() for _ in range(n)]
            tables.append(table + [0] * (max(pages_needed) - n))
            positions += range(cached, cached + fed)
            slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached, cached + fed)]
        total = len(positions)
        q, k, v = (torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        cache = torch.randn(2, num_pages, PAGE, kv_heads, head_dim, generator=g).to(dtype)

        def run(backend, run_dtype, shapes=shapes, block_length=block_length, tables=tables, slots=slots,
                positions=positions, q=q, k=k, v=v, cache=cache):
            meta = AttentionMetadata(
                q_lens=[f for _, f in shapes], kv_lens=[c + f for c, f in shapes],
                positions=torch.tensor(positions, device=device), slot_mapping=torch.tensor(slots, device=device),
                page_tables=torch.tensor(tables, device=device), page_size=PAGE, dllm_block_length=block_length)
            k_cache, v_cache = (c.to(device=device, dtype=run_dtype) for c in cache)
            backend.prepare(meta)
            x = [t.to(device=device, dtype=run_dtype) for t in (q, k, v)]
            return backend.forward(*x, k_cache, v_cache, meta, head_dim**-0.5).float()

        err = (run(FlashAttention(kernel), dtype) - run(TorchAttention(), torch.float32)).abs().max().item()
        out[name] = {"max_abs_error": err, "ok": err < 2e-2}
    return out


# ---- 2. greedy bf16 vs fp32 ------------------------------------------------------------------------------------
def _serve(path: Path, config: EngineConfig, prompts: list[list[int]], params: list[GenerationConfig],
           concurrency: int) -> list:
    engine = LLMEngine(str(path), config)
    return run_engine(engine, prompts, params, BenchShape(), concurrency).outputs


def _tiny_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (int(length),), generator=g).tolist()
            for length in torch.randint(5, 40, (n,), generator=g)]


def compare_greedy(paths: dict[str, Path], device: str, dtypes: tuple[str, str] = ("bfloat16", "float32"),
                   requests: int = 16) -> dict:
    """Share of identical greedy outputs (tokens and, for DLLM, step_map) between two dtypes, and where they
    differ, how close a call it was: at the first differing token, the second dtype's logprob of its own token
    minus its logprob of the first dtype's token (`None` when that token is outside its top 5). Rounding
    flips near-ties (gaps of hundredths of a nat); a bug shows as large gaps."""
    prompts = _tiny_prompts(requests, seed=3)
    params = [GenerationConfig(max_new_tokens=24, logprobs=5)] * requests
    out = {}
    for name, path in paths.items():
        runs = [_serve(path, EngineConfig(device=device, dtype=dt, kv_block_size=PAGE, num_kv_blocks=256,
                                          dllm_block_length=BLOCK), prompts, params, 8) for dt in dtypes]
        tokens = sum(a.token_ids == b.token_ids for a, b in zip(*runs))
        step_maps = sum(a.step_map == b.step_map for a, b in zip(*runs))
        gaps = [_first_divergence_gap(a, b) for a, b in zip(*runs) if a.token_ids != b.token_ids]
        known = [g for g in gaps if g is not None]
        out[name] = {"dtypes": list(dtypes), "requests": requests, "same_tokens": tokens / requests,
                     "same_step_map": step_maps / requests, "divergence_gaps_nats": gaps,
                     "max_gap_nats": max(known, default=None)}
    return out


def _first_divergence_gap(first, second) -> float | None:
    """`second`'s logprob of its token minus its logprob of `first`'s token, at the first differing position."""
    n = min(len(first.token_ids), len(second.token_ids))
    i = next((i for i in range(n) if first.token_ids[i] != second.token_ids[i]), None)
    if i is None:
        return 0.0  # one output is a prefix of the other: a stop token's timing, not a different token
    row = second.logprobs[i]
    theirs = row.get(first.token_ids[i])
    return None if theirs is None else row[second.token_ids[i]] - theirs


# ---- 3. seeded sampling ----------------------------------------------------------------------------------------
def check_seeded_sampling(path: Path, device: str, dtype: str, requests: int = 12) -> dict:
    """The same seeded requests, once all together and once one at a time: identical outputs."""
    prompts = _tiny_prompts(requests, seed=4)
    params = [GenerationConfig(max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.95, random_seed=100 + i)
              for i in range(requests)]
    config = EngineConfig(device=device, dtype=dtype, kv_block_size=PAGE, num_kv_blocks=256, dllm_block_length=BLOCK)
    together = _serve(path, config, prompts, params, requests)
    alone = _serve(path, config, prompts, params, 1)
    same = sum(a.token_ids == b.token_ids and a.step_map == b.step_map for a, b in zip(together, alone))
    return {"requests": requests, "same_together_and_alone": same / requests, "ok": same == requests}


# ---- 4. throughput -----------------------------------------------------------------------------------------------
def throughput(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: list[int], traffic: Traffic,
               hf_requests: int) -> dict:
    """Engine tokens/s at each concurrency, and the SDAR HF loop's (one request at a time) on the same prompts."""
    stops, mask_id = stop_ids_of(path), mask_id_of(path)
    prompts, budgets = make_prompts(traffic, shape.vocab_size, stops | {mask_id})
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    config = EngineConfig(device=device, dtype=dtype, kv_block_size=PAGE, num_kv_blocks=0.85 if device == "cuda"
                          else 4096, max_batch_size=max(concurrency), dllm_block_length=BLOCK,
                          dllm_unmasking_strategy=STRATEGY, dllm_confidence_threshold=THRESHOLD)
    engine = LLMEngine(str(path), config)
    run_engine(engine, prompts[:1], [GenerationConfig(max_new_tokens=8)], shape, 1)  # warm-up
    result: dict = {"engine": {}}
    first_outputs: list[list[int]] = []
    for c in concurrency:
        n = max(c, min(2 * c, traffic.num_requests)) if c > 1 else min(4, traffic.num_requests)
        run = run_engine(engine, prompts[:n], params[:n], shape, c)
        if not first_outputs:
            first_outputs = [o.token_ids for o in run.outputs]
        result["engine"][str(c)] = {"requests": n, "output_tokens": run.output_tokens, "seconds": run.seconds,
                                    "tokens_per_s": run.output_tokens / run.seconds}
    del engine

    try:
        result["hf_sdar_loop"] = _hf_sdar_loop(path, device, dtype, prompts, budgets, stops, mask_id, first_outputs,
                                               hf_requests)
    except Exception as exc:  # noqa: BLE001 -- the engine's figures above stand without the baseline
        result["hf_sdar_loop"] = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    for c, e in result["engine"].items():
        result["engine"][c]["vs_hf_sdar_loop"] = e["tokens_per_s"] / result["hf_sdar_loop"]["tokens_per_s"]
    return result


def _hf_sdar_loop(path: Path, device: str, dtype: str, prompts: list[list[int]], budgets: list[int], stops: set[int],
                  mask_id: int, engine_outputs: list[list[int]], requests: int) -> dict:
    """The SDAR reference loop on HF transformers, one request at a time: tokens/s and agreement with the engine."""
    model = hf.load_hf(path).to(device=device, dtype=getattr(torch, dtype))
    tokens, seconds, match = 0, 0.0, 0
    with torch.device(device):  # the loop builds its tensors with default devices
        for i in range(requests):
            t = time.perf_counter()
            out, _, _ = hf.sdar_generate(model, prompts[i], block_length=BLOCK, mask_id=mask_id,
                                         max_new_tokens=budgets[i], stop_ids=stops, strategy=STRATEGY,
                                         denoising_steps=BLOCK, threshold=THRESHOLD)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t
            tokens += len(out)
            match += out == engine_outputs[i]
    return {"requests": requests, "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "same_as_engine": match / requests}


def write_tiny_pair(root: Path) -> dict[str, Path]:
    return {"dllm": write_tiny_checkpoint(root / "sdar", model_type="sdar", seed=5, logit_scale=DLLM_TEST_LOGIT_SCALE),
            "ar": write_tiny_checkpoint(root / "qwen3", model_type="qwen3", seed=4, logit_scale=2.0)}


def write_sdar(root: Path, shape: BenchShape) -> Path:
    return write_tiny_checkpoint(root / f"sdar-{shape.hidden_size}x{shape.num_hidden_layers}", model_type="sdar",
                                 block_size=BLOCK, logit_scale=DLLM_LOGIT_SCALE, seed=1, **asdict(shape))


PARTS = ("flash", "greedy", "seeded_sampling", "throughput", "float32_reference")
MODEL_PARTS = {"throughput", "float32_reference"}  # the parts that need the SDAR-1.7B-shaped checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts alone")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the GPU check runs only where torch.cuda.is_available()"}))
        return 0
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "flash_kernel": None if INSTALLED is None else f"{INSTALLED.source} ({INSTALLED.key_lengths})"}
    selected = set(args.only or PARTS) - (MODEL_PARTS if args.skip_throughput else set())
    t0 = time.perf_counter()

    def part(name: str, check: Callable[[], dict]) -> None:
        """Run one part, print it at once (a later part's crash or timeout keeps the earlier ones), record it."""
        if name not in selected:
            return
        try:
            report[name] = check()
        except Exception as exc:  # noqa: BLE001 -- one failing part must not hide the others' results
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({name: report[name]}), flush=True)

    part("flash", lambda: {"skipped": "no flash kernel installed"} if INSTALLED is None
         else compare_attention(INSTALLED, torch.device("cuda"), torch.bfloat16))
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_pair(Path(tmp))
        part("greedy", lambda: compare_greedy(tiny, "cuda"))
        part("seeded_sampling", lambda: {name: check_seeded_sampling(path, "cuda", "bfloat16")
                                         for name, path in tiny.items()})
        if selected & MODEL_PARTS:
            path = write_sdar(Path(tmp), SDAR_1_7B)
            traffic = Traffic(256, (64, 256), (64, 128))
            part("throughput", lambda: throughput(path, SDAR_1_7B, "cuda", "bfloat16", [1, 32, 128], traffic,
                                                  hf_requests=4))
            part("float32_reference", lambda: throughput(path, SDAR_1_7B, "cuda", "float32", [1], traffic,
                                                         hf_requests=4))
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
