"""DiffusionGemma's renoising requests in the engine and transformers' `generate()` on them, shared by the
decoding, decisions and Triton-backend tests of tests/engine/families: the knobs and shapes they run
with, an engine built with them, a batch of requests stepped to the end, and transformers' seeded
outputs (tokens, settle steps, last-step logits, steps per canvas) to check a response against."""

from __future__ import annotations

import torch

from configs import EngineConfig, GenerationConfig
from engine.carrier import Response
from engine.core.decoding.renoising import RenoiseKnobs
from engine.core.llm_engine import LLMEngine
from testing.references.diffusion_gemma import Drafts, load_reference, settle_steps

PAGE = 4
CANVAS = 16
KNOBS = RenoiseKnobs(max_denoising_steps=12, stability_threshold=0, stop_entropy=0.8)
SEEDS = range(5)
PROMPT_LENGTHS = (1, 9, 40)  # 40 crosses the tiny sliding window (8)
MAX_NEW = (16, 40, 3 * CANVAS)


def make_engine(ckpt, **config) -> LLMEngine:
    knobs = {f"dllm_{name}": value for name, value in vars(KNOBS).items()}
    return LLMEngine(str(ckpt), EngineConfig(**{"device": "cpu", "kv_block_size": PAGE, "num_kv_blocks": 4096,
                                                "max_batch_size": 64, "max_prefill_token_num": 256, **knobs,
                                                **config}))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], GenerationConfig]]) -> dict[str, Response]:
    """Every request added at once, stepped to the end; the whole response of each."""
    chunks: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    while engine.has_unfinished():
        for chunk in engine.step():
            chunks[chunk.request_id].append(chunk)
    return {rid: Response.from_chunks(c) for rid, c in chunks.items()}


def params(**kwargs) -> GenerationConfig:
    return GenerationConfig(return_dllm_replay=True, **kwargs)


def transformers_oracle(ckpt, vocab: int, pairs: list[tuple[int, int]] | None = None) -> dict:
    """transformers' 3-canvas output per (seed, prompt length) -- of `pairs`, or every seed at every
    length: tokens, settle steps, last-step logits per canvas, canvases' step counts. Shorter
    max_new_tokens take its first canvases (the same draws)."""
    model = load_reference(ckpt)
    out = {}
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(100 + length)).tolist()
        for seed in SEEDS:
            if pairs is not None and (seed, length) not in pairs:
                continue
            drafts = Drafts()
            torch.manual_seed(seed)
            seqs = model.generate(torch.tensor([prompt]), max_new_tokens=max(MAX_NEW), streamer=drafts,
                                  max_denoising_steps=KNOBS.max_denoising_steps, t_min=KNOBS.t_min,
                                  t_max=KNOBS.t_max, stability_threshold=KNOBS.stability_threshold,
                                  confidence_threshold=KNOBS.stop_entropy).sequences
            last = [drafts.steps[e - 1] for e in drafts.canvas_ends[1:]]
            steps = [b - a for a, b in zip(drafts.canvas_ends, drafts.canvas_ends[1:], strict=False)]
            out[seed, length] = {"prompt": prompt, "tokens": seqs[0, length:].tolist(),
                                 "settle": settle_steps(drafts), "last": last, "steps": steps}
    return out


def check_response(result: Response, ref, max_new: int) -> None:
    assert result.token_ids == ref["tokens"][:max_new]
    assert result.step_map == ref["settle"][:max_new]
    assert result.finish_reason == "length"
    canvases = -(-max_new // CANVAS)
    assert [c["steps"] for c in result.dllm_replay_canvases] == ref["steps"][:canvases]
    assert {c["stop"] for c in result.dllm_replay_canvases} <= {"stable", "max_steps"}
    assert result.num_steps == sum(ref["steps"][:canvases])


PROBE = (3, 9)  # the (seed, prompt length) probed alone and among others


def probe_among_others(oracle, size: int) -> dict[str, tuple[list[int], GenerationConfig]]:
    """A seeded request, alone or with size - 1 others (other prompts, seeds, lengths)."""
    seed, length = PROBE
    requests = {"probe": (oracle[seed, length]["prompt"], params(max_new_tokens=40, random_seed=seed))}
    others = [k for k in oracle if k != (seed, length)]
    for i in range(size - 1):
        s, n = others[i % len(others)]
        requests[f"other{i}"] = (oracle[s, n]["prompt"], params(max_new_tokens=16 * (1 + i % 3), random_seed=1000 + i))
    return requests
