"""Part `diffusion_gemma`: DiffusionGemma at the release's shape (the Gemma-4 26B-A4B text stack, all
30 layers, vocabulary 262,144, canvas 256) with random weights drawn on the device, on each attention
backend the family has (`torch`, `flex`).

Per backend: the engine's build and warm-up time (a compiled kernel builds during the warm-up), then
at each concurrency N seeded requests all in flight together (one canvas each at the default 256
tokens): generated tokens per second, forwards, denoising steps per request and milliseconds per
forward. Random weights never meet the stop rule, so every canvas runs `dllm_max_denoising_steps`
steps; a trained model's canvases stop earlier, so compare per-forward times, not tokens/s, with a
trained model's figures. Last, how many requests got the same tokens on every backend.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.random_weights import weights_on_device
from bench.progress import log
from configs import GenerationConfig
from engine.carrier import Response
from engine.core.llm_engine import LLMEngine
from engine.model.checkpoint import ModelSpec
from tools.published_checkpoints import write_published_config

RELEASE = "DiffusionGemma-26B-A4B"
PROMPT_LEN = 32


def write_release_config(root: Path, num_hidden_layers: int = 30) -> Path:
    """The release's config.json (at `num_hidden_layers`), the tiny tokenizer and a one-element stand-in
    weights file, so that the directory passes the engine's checkpoint check: an engine built inside
    `weights_on_device` draws its weights and never reads the file."""
    path = write_published_config(RELEASE, root / "diffusion-gemma", num_hidden_layers)
    save_file({"stand_in": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def fill_like_published(model: torch.nn.Module, spec: ModelSpec, seed: int) -> None:
    """Weights as `tools.published_checkpoints.write_published` writes them, drawn on the model's device:
    per-layer scalars (one element) 1, every other tensor N(0, 0.02)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() == 1:
                param.fill_(1.0)
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=g, device=device))


def _serve(engine: LLMEngine, n: int, max_new_tokens: int, max_seconds: float) -> tuple[dict, list[list[int]]]:
    """`n` seeded requests in flight together until done or `max_seconds` (then the rest are aborted)."""
    vocab = engine.spec.vocab_size
    chunks: dict[str, list] = {}
    for i in range(n):
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(prompt, GenerationConfig(max_new_tokens=max_new_tokens, random_seed=i), str(i))
        chunks[str(i)] = []
    forwards, start = 0, time.perf_counter()
    while engine.has_unfinished() and time.perf_counter() - start < max_seconds:
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
        forwards += 1
    elapsed = time.perf_counter() - start
    for rid in chunks:
        final = engine.abort(rid) if engine.has_unfinished() else None
        if final is not None:
            chunks[rid].append(final)
    responses = [Response.from_chunks(chunks[str(i)]) for i in range(n)]
    done = [r for r in responses if r.finish_reason in ("length", "stop")]
    tokens = sum(len(r.token_ids) for r in done)
    return ({"requests": n, "finished": len(done), "seconds": round(elapsed, 3), "forwards": forwards,
             "ms_per_forward": round(1000 * elapsed / max(forwards, 1), 2),
             "tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
             "steps_per_request": sorted({r.num_steps for r in done})},
            [r.token_ids if r.finish_reason in ("length", "stop") else [] for r in responses])


def diffusion_gemma(path: Path, device: str, dtype: str, choice: EngineChoice | None = None,
                    concurrency: tuple[int, ...] = (1, 32), max_new_tokens: int = 256,
                    backends: tuple[str, ...] = ("torch", "flex"), max_seconds: float = 60.0) -> dict:
    """The part's figures for the checkpoint directory `path` (its config and tokenizer; the weights are
    drawn on the device); each concurrency's run stops after `max_seconds`. `choice` sets the engine
    but for its attention backend, which is each of `backends` in turn."""
    out: dict = {"max_new_tokens": max_new_tokens}
    tokens: dict[str, list[list[int]]] = {}
    for backend in backends:
        started = time.perf_counter()
        config = replace(choice or EngineChoice(), attention=backend).config(
            device=device, dtype=dtype, num_kv_blocks=0.3 if device == "cuda" else 4096,
            max_batch_size=max(concurrency), max_prefill_token_num=1024)
        try:
            with weights_on_device(fill=fill_like_published):
                engine = LLMEngine(str(path), config)
        except Exception as exc:  # noqa: BLE001 -- one backend's failure leaves the other's figures
            out[backend] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        result: dict = {"build_s": round(time.perf_counter() - started, 2)}
        warm = time.perf_counter()
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=8, dllm_max_denoising_steps=2), "warm-up")
        while engine.has_unfinished():
            engine.step()
        result["warm_up_s"] = round(time.perf_counter() - warm, 2)
        log(f"diffusion_gemma {backend}: built in {result['build_s']} s, warmed up in {result['warm_up_s']} s")
        for n in concurrency:
            result[str(n)], tokens[backend] = _serve(engine, n, max_new_tokens, max_seconds)
            log(f"diffusion_gemma {backend} at {n} concurrent:", json.dumps(result[str(n)]))
        result["ran_as"] = engine.executor.runner.backend.name  # a compiled kernel that failed: torch
        if device == "cuda":
            result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        out[backend] = result
        engine.shutdown()
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if len(tokens) > 1:  # requests finished on every backend (one cut by `max_seconds` has no tokens to compare)
        compared = [same for same in zip(*tokens.values(), strict=True) if all(same)]
        out["same_tokens_on_every_backend"] = sum(len(set(map(tuple, same))) == 1 for same in compared)
        out["compared_requests"] = len(compared)
    return out
