"""LLaDA2 decoding: the engine vs diffusers' `LLaDA2Pipeline`, the offline loop a user picks today.

`python -m bench.llada2 [--tokens 256] [--toy]` writes a small llada2_moe checkpoint (4 layers of the
released shape family: fused QKV, QK norm, partial rotary, a dense first layer, 16 sigmoid-routed
experts in 4 groups plus a shared one), then decodes 8 prompts of one block (32 tokens) greedily to
`--tokens` new tokens with SGLang's LowConfidence (threshold 0.95) and JointThreshold (threshold 0.95,
edit threshold 0.9), at 1 and 8 concurrent requests on both sides:

- **diffusers**: `LLaDA2Pipeline` with its `BlockRefinementScheduler`, one request at a time, over a
  straightforward full-recompute float32 implementation of the architecture
  (testing/references/llada2_moe.py, what a published modeling file computes: every step
  a forward over the whole sequence so far);
- **engine**: the offline pipeline, all requests of a round in flight together.

It prints one JSON object: seconds per side and round, forwards per block on each side (the engine's
batched: at 8 concurrent one forward serves every request),
and how many requests got identical tokens on both sides. The post-edit budgets count one
apart: diffusers applies the edits of the step that exceeds its `max_post_steps` before ending the
block, SGLang (and this engine) end the block at that step writing nothing, so diffusers'
`max_post_steps=16` is the engine's `dllm_max_post_edit_steps=17`. The sides' float32 sums differ in
order (batched GEMMs against the reference's per-row loops), so a router choice whose two candidates
tie to ~1e-7 can flip: random weights and JointThreshold's many steps meet such a tie now and then,
and that request's later tokens differ (LowConfidence's fewer steps rarely do).

`python -m bench.llada2 --indel [--tokens 256] [--toy]` measures LLaDA2.2 instead: the same shape with
block routing (`expert_capacity` 8 of 16 experts per 32-token routing block; toy: 4 of 8) and two
ordinary ids as DELETE and SPLIT, decoded to `--tokens` (stop ids ignored) with `joint_threshold_indel`
(threshold 0.5, edit threshold 0, `dllm_max_post_edit_steps` 16) at 1 and 8 concurrent, against SGLang
0.5.23's released JointThresholdInDel and its synchronous block loop (`bench/sglang_indel.py`) over the
full-recompute reference (every forward recomputes the whole sequence, nothing remembered). It prints
forwards per block, tokens per forward and tokens/s per side, identical requests, and the DELETE /
SPLIT writes the released rule made.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import types
from pathlib import Path

import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline

from engine import EngineConfig, GenerationConfig, pipeline
from testing.references.llada2_moe import LLaDA2Reference
from testing.tiny_llada2 import MASK_TEXT, write_tiny_llada2

INDEL_IDS = (128, 295)  # DELETE, SPLIT: ordinary ids of the byte tokenizer, written now and then

B = 32
DIFFUSERS_MAX_POST_STEPS = 16
RULES = {"low_confidence": {},
         "joint_threshold": {"dllm_edit_threshold": 0.9, "dllm_max_post_edit_steps": DIFFUSERS_MAX_POST_STEPS + 1}}
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             intermediate_size=512, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, n_group=4,
             topk_group=2)


class CountingNetwork(torch.nn.Module):
    """The full-recompute network under the call diffusers makes (`model(x, ...).logits`), counting calls."""

    def __init__(self, ref: LLaDA2Reference):
        super().__init__()
        self.ref, self.calls = ref, 0
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None) -> types.SimpleNamespace:
        self.calls += 1
        return types.SimpleNamespace(logits=torch.stack([self.ref._forward(row.tolist(), B) for row in x]))


def run_diffusers(net: torch.nn.Module, prompts: list[list[int]], tokens: int, mask_id: int,
                  edit_threshold: float | None, max_post_steps: int = DIFFUSERS_MAX_POST_STEPS) -> list[list[int]]:
    """Greedy `LLaDA2Pipeline` runs (threshold 0.95, B-step blocks, no early stop), one prompt at a time,
    over `net` (called as `net(x, attention_mask, position_ids).logits`)."""
    pipe = LLaDA2Pipeline(model=net, scheduler=BlockRefinementScheduler(), tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    outs = []
    for prompt in prompts:
        out = pipe(input_ids=torch.tensor([prompt]), use_chat_template=False, gen_length=tokens, block_length=B,
                   num_inference_steps=B, temperature=0.0, sampling_method="greedy", threshold=0.95,
                   editing_threshold=edit_threshold, max_post_steps=max_post_steps, eos_early_stop=False,
                   mask_token_id=mask_id, output_type="seq")
        outs.append(out.sequences[0].tolist())
    return outs


def timed_engine(engine, batch: list[list[int]], config: GenerationConfig) -> tuple[list, float, int]:
    """The offline pipeline `engine` on `batch` after an untimed warm-up round (the first forwards of a
    shape pack weights and grow buffers): its outputs, seconds and forwards."""
    engine(batch, config)
    forwards = engine.engine.stats.forwards
    t0 = time.perf_counter()
    outputs = engine(batch, config)
    return outputs, time.perf_counter() - t0, engine.engine.stats.forwards - forwards


def run_indel(tokens: int, toy: bool) -> dict:
    """LLaDA2.2 (block routing, insert/delete editing): the engine against the released rule over the
    full-recompute reference, at 1 and 8 concurrent."""
    from bench.sglang_indel import SGLangInDel

    delete_id, split_id = INDEL_IDS
    shape = dict(expert_capacity=4) if toy else dict(SHAPE, expert_capacity=8)
    path = write_tiny_llada2(Path(tempfile.mkdtemp(prefix="bench-llada22-")), seed=1, **shape)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in added if t["content"] == MASK_TEXT)
    ref = LLaDA2Reference(path)
    calls = [0]

    def recompute(ids: list[int], block_length: int) -> torch.Tensor:
        calls[0] += 1
        return ref._forward(ids, block_length)

    knobs = {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16}
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, dllm_unmasking_strategy="joint_threshold_indel",
                              dllm_confidence_threshold=0.5, dllm_edit_threshold=0.0, dllm_max_post_edit_steps=16)
    prompts = [[random.Random(i).randrange(300) for _ in range(B)] for i in range(8)]
    result: dict = {"tokens": tokens, "shape": "toy" if toy else SHAPE, "expert_capacity": shape["expert_capacity"],
                    "delete_split_ids": list(INDEL_IDS), "threads": torch.get_num_threads()}
    engine_config = EngineConfig(max_model_len=B + tokens, num_kv_blocks=8 * (B + tokens) // 16 + 16, max_batch_size=8,
                                 dllm_delete_token_id=delete_id, dllm_split_token_id=split_id)
    with pipeline(str(path), engine_config) as engine:
        for concurrent in (1, 8):
            batch = prompts[:concurrent]
            mine, engine_s, engine_forwards = timed_engine(engine, batch, config)
            oracle = SGLangInDel(recompute, B, mask_id, delete_id, split_id, set(), **knobs)  # no stop id
            calls[0] = 0
            t0 = time.perf_counter()
            theirs = oracle.generate(batch, [tokens] * concurrent)
            released_s = time.perf_counter() - t0
            writes = [t for r in theirs for block in r.blocks for step in block for t in step.writes.values()]
            generated = sum(len(m.token_ids) for m in mine)
            blocks = sum(len(r.blocks) for r in theirs)
            result[f"indel/{concurrent}"] = {
                "engine_s": round(engine_s, 2), "released_rule_s": round(released_s, 2),
                "speedup": round(released_s / engine_s, 1),
                "engine_tok_s": round(generated / engine_s, 1),
                "released_rule_tok_s": round(sum(len(r.output) for r in theirs) / released_s, 1),
                # engine: batched forwards per block of the round; released rule: forwards of every request
                # (each a full recompute) per block
                "forwards_per_block": {"engine": round(engine_forwards / (blocks / concurrent), 2),
                                       "released_rule": round(calls[0] / blocks, 2)},
                "tokens_per_forward": {"engine": round(generated / engine_forwards, 2),
                                       "released_rule": round(sum(len(r.output) for r in theirs) / calls[0], 2)},
                "identical_requests": sum(m.token_ids == t.output and m.finish_reason == t.finish_reason
                                          for m, t in zip(mine, theirs, strict=True)),
                "requests": concurrent,
                "delete_writes": writes.count(delete_id), "split_writes": writes.count(split_id),
            }
            print(json.dumps({"indel": result[f"indel/{concurrent}"], "concurrent": concurrent}), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per request (a multiple of 32)")
    parser.add_argument("--toy", action="store_true", help="the tests' tiny shape and 64 tokens (seconds)")
    parser.add_argument("--indel", action="store_true",
                        help="LLaDA2.2: block routing and insert/delete editing against SGLang's released rule")
    args = parser.parse_args(argv)
    tokens = 64 if args.toy else args.tokens
    if args.indel:
        print(json.dumps(run_indel(tokens, args.toy)))
        return
    path = write_tiny_llada2(Path(tempfile.mkdtemp(prefix="bench-llada2-")), seed=1, **({} if args.toy else SHAPE))
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in added if t["content"] == MASK_TEXT)
    prompts = [[random.Random(i).randrange(300) for _ in range(B)] for i in range(8)]
    net = CountingNetwork(LLaDA2Reference(path))
    result: dict = {"tokens": tokens, "shape": "toy" if args.toy else SHAPE, "threads": torch.get_num_threads()}
    with pipeline(str(path), EngineConfig(max_model_len=B + tokens, num_kv_blocks=8 * (B + tokens) // 16 + 16,
                                          max_batch_size=8)) as engine:
        for rule, knobs in RULES.items():
            config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True, dllm_unmasking_strategy=(
                "joint_threshold" if rule == "joint_threshold" else None), **knobs)
            for concurrent in (1, 8):
                batch = prompts[:concurrent]
                mine, engine_s, engine_forwards = timed_engine(engine, batch, config)
                net.calls = 0
                t0 = time.perf_counter()
                theirs = run_diffusers(net, batch, tokens, mask_id, knobs.get("dllm_edit_threshold"))
                diffusers_s = time.perf_counter() - t0
                blocks = concurrent * tokens // B
                result[f"{rule}/{concurrent}"] = {
                    "engine_s": round(engine_s, 2), "diffusers_s": round(diffusers_s, 2),
                    "speedup": round(diffusers_s / engine_s, 1),
                    # engine: batched forwards per block of the round (at 1 concurrent: the request's own);
                    # diffusers: a request's forwards per block (one request at a time)
                    "forwards_per_block": {"engine": round(engine_forwards / (tokens // B), 2),
                                           "diffusers": round(net.calls / blocks, 2)},
                    "identical_requests": sum(m.token_ids == t for m, t in zip(mine, theirs, strict=True)),
                    "requests": concurrent,
                }
                print(json.dumps({rule: result[f"{rule}/{concurrent}"], "concurrent": concurrent}), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
