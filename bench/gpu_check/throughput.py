"""Parts 4-6 on SDAR-shaped random-weight models: `throughput` and `float32_reference` (the engine
against the SDAR reference loop on HF transformers on the same GPU) and `sdar_4b` (one shape at one
concurrency, weights drawn on the device)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench import hf_baselines as hf
from bench.gpu_check.breakdown import profile_steps, serve_and_break_down
from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.model_engine import bench_engine
from bench.gpu_check.random_weights import weights_on_device
from bench.gpu_check.settings import BLOCK, STRATEGY, THRESHOLD
from bench.models import DLLM_LOGIT_SCALE, BenchShape, mask_id_of, stop_ids_of
from bench.progress import log
from bench.workloads import Traffic
from configs import GenerationConfig
from testing.tiny_checkpoint import write_tiny_checkpoint


def write_sdar(root: Path, shape: BenchShape) -> Path:
    """An SDAR checkpoint of `shape` written to disk: the HF reference loop loads it too."""
    return write_tiny_checkpoint(root / f"sdar-{shape.hidden_size}x{shape.num_hidden_layers}", model_type="sdar",
                                 block_size=BLOCK, logit_scale=DLLM_LOGIT_SCALE, seed=1, **asdict(shape))


def throughput(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: list[int], traffic: Traffic,
               hf_requests: int, max_seconds: float = 240.0, profile_at_most: int = 8,
               choice: EngineChoice | None = None) -> dict:
    """Engine tokens/s at each concurrency with its breakdown, a profile at the highest one, and the SDAR HF
    loop's tokens/s (one request at a time) on the same prompts. A concurrency starts only while the part
    has spent less than `max_seconds`."""
    t0 = time.perf_counter()
    engine, prompts, params = bench_engine(path, shape, device, dtype, concurrency, traffic, choice)
    result: dict = {"attention_backend": engine.executor.runner.backend.name, "engine": {}}
    first_outputs: list[list[int]] = []
    for c in concurrency:
        if time.perf_counter() - t0 > max_seconds:
            result["engine"][str(c)] = {"skipped": f"the part's {max_seconds:.0f} s cap was spent"}
            continue
        n = max(c, min(2 * c, traffic.num_requests)) if c > 1 else min(4, traffic.num_requests)
        run, result["engine"][str(c)] = serve_and_break_down(engine, prompts[:n], params[:n], shape, c)
        log(f"throughput at {c} concurrent:", json.dumps(result["engine"][str(c)]))
        if not first_outputs:
            first_outputs = [o.token_ids for o in run.outputs]
    c = max(concurrency)
    result["profile"] = profile_steps(engine, prompts[:c], params[:c], steps=profile_at_most)
    with_launches(result["engine"][str(c)], result["profile"])
    del engine

    try:
        result["hf_sdar_loop"] = _hf_sdar_loop(path, device, dtype, prompts, budgets_of(params), stop_ids_of(path),
                                               mask_id_of(path), first_outputs, hf_requests)
    except Exception as exc:  # noqa: BLE001 -- the engine's figures above stand without the baseline
        result["hf_sdar_loop"] = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    for e in result["engine"].values():
        if "tokens_per_s" in e:
            e["vs_hf_sdar_loop"] = e["tokens_per_s"] / result["hf_sdar_loop"]["tokens_per_s"]
    return result


def budgets_of(params: list[GenerationConfig]) -> list[int]:
    return [p.max_new_tokens for p in params]


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


def shape_throughput(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: int, traffic: Traffic,
                     profile_steps_at_most: int = 8, choice: EngineChoice | None = None) -> dict:
    """Tokens/s of one concurrency with its breakdown and profile, weights drawn on the device."""
    with weights_on_device():
        engine, prompts, params = bench_engine(path, shape, device, dtype, [concurrency], traffic, choice)
    _, out = serve_and_break_down(engine, prompts[:concurrency], params[:concurrency], shape, concurrency)
    out["attention_backend"] = engine.executor.runner.backend.name
    out["profile"] = profile_steps(engine, prompts[:concurrency], params[:concurrency], steps=profile_steps_at_most)
    return with_launches(out, out["profile"])


def with_launches(run: dict, profile: dict) -> dict:
    """`run` (one concurrency's figures) with the launches per step its profile counted, unless it was skipped."""
    if "skipped" not in run:
        run["kernel_launches_per_step"] = profile["kernel_launches_per_step"]
    return run
