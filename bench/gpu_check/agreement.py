"""Parts 2 and 3 on tiny checkpoints: `greedy` (bf16 outputs against fp32 on the same GPU) and
`seeded_sampling` (seeded requests served together and one at a time: identical)."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.gpu_check.settings import BLOCK, PAGE
from bench.measure import run_engine
from bench.models import BenchShape
from configs import EngineConfig, GenerationConfig
from engine.core.llm_engine import LLMEngine
from ops.attention import triton_unmet
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

# The backends the seeded_sampling part serves on: flex runs everywhere (compiled where it can, else
# eager); triton where Triton can launch on the device.
SEEDED_BACKENDS = ("torch", "flex", "triton")


def write_tiny_pair(root: Path) -> dict[str, Path]:
    """The tiny DLLM and AR checkpoints both parts serve."""
    return {"dllm": write_tiny_checkpoint(root / "sdar", model_type="sdar", seed=5, logit_scale=DLLM_TEST_LOGIT_SCALE),
            "ar": write_tiny_checkpoint(root / "qwen3", model_type="qwen3", seed=4, logit_scale=2.0)}


def _serve(path: Path, config: EngineConfig, prompts: list[list[int]], params: list[GenerationConfig],
           concurrency: int) -> tuple[list, str]:
    """The outputs, and the attention backend that served them (a compiled kernel that failed: torch)."""
    engine = LLMEngine(str(path), config)
    outputs = run_engine(engine, prompts, params, BenchShape(), concurrency).outputs
    return outputs, engine.executor.runner.backend.name


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
                                          dllm_block_length=BLOCK), prompts, params, 8)[0] for dt in dtypes]
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


def check_seeded_sampling(path: Path, device: str, dtype: str, requests: int = 12, attention: str = "auto") -> dict:
    """The same seeded requests, once all together and once one at a time: identical outputs, on the
    attention backend `attention` (the result names the one that served)."""
    prompts = _tiny_prompts(requests, seed=4)
    params = [GenerationConfig(max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.95, random_seed=100 + i)
              for i in range(requests)]
    config = EngineConfig(device=device, dtype=dtype, kv_block_size=PAGE, num_kv_blocks=256, dllm_block_length=BLOCK,
                          attention_backend=attention)
    together, backend = _serve(path, config, prompts, params, requests)
    alone, _ = _serve(path, config, prompts, params, 1)
    same = sum(a.token_ids == b.token_ids and a.step_map == b.step_map for a, b in zip(together, alone))
    return {"attention_backend": backend, "requests": requests, "same_together_and_alone": same / requests,
            "ok": same == requests}


def backend_unmet(backend: str, device: str) -> list[str]:
    """Why `backend` cannot serve on `device` (empty: it can)."""
    return triton_unmet(torch.device(device)) if backend == "triton" else []


def seeded_sampling_part(paths: dict[str, Path], device: str, dtype: str,
                         backends: tuple[str, ...] = SEEDED_BACKENDS, requests: int = 12) -> dict:
    """Part 3: `check_seeded_sampling` per checkpoint and backend; a backend that cannot run here is
    reported skipped, with why, and one that raises reports its error beside the others' results."""
    out: dict = {}
    for name, path in paths.items():
        out[name] = {}
        for backend in backends:
            unmet = backend_unmet(backend, device)
            if unmet:
                out[name][backend] = {"skipped": "; ".join(unmet)}
                continue
            try:
                out[name][backend] = check_seeded_sampling(path, device, dtype, requests=requests, attention=backend)
            except Exception as exc:  # noqa: BLE001 -- a new backend's failure must not hide the others'
                out[name][backend] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
