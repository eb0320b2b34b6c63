"""Loading memory: a ~1 GB bfloat16 sharded checkpoint (random weights, 40 layers, 10 shards) loads
with host peak RSS growth <= 1.25x its size, and each of 2 tensor-parallel ranks <= 0.65x. The model
is built on the meta device and filled from memory-mapped safetensors slices, file by file, so the
peak is the model's own (per-rank) weights plus the touched pages of one shard. Each load runs in a
fresh subprocess that reports its kernel peak-RSS mark (VmHWM) minus its RSS before loading.
The loaded bf16 engine's logits are checked against Hugging Face on the same bf16 weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from testing.tiny_checkpoint import load_hf_reference, write_tiny_checkpoint
from tests.support.paths import ROOT

SHAPE = dict(hidden_size=1024, num_hidden_layers=40, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             intermediate_size=3072)
SHARDS = 10
PROMPT = [5, 77, 130, 9, 250, 31, 200, 14]

CHILD = """
import json, sys, torch
from engine.model.checkpoint import load_model_spec
from engine.model.layers.parallel import TPContext
from engine.worker.runner import build_model

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

path, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = load_model_spec(path)
before = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # peak mark := current RSS
model = build_model(spec, torch.device("cpu"), torch.bfloat16, TPContext(rank=rank, size=size))
growth = rss("VmHWM:") - before
print(json.dumps({"growth": growth, "params": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


def write_bf16_checkpoint(path: Path) -> int:
    """A real-format checkpoint (config, tokenizer) whose weights are random bfloat16, in SHARDS
    files; returns the weight bytes."""
    write_tiny_checkpoint(path, model_type="qwen3", **{**SHAPE, "num_hidden_layers": 1})  # config + tokenizer
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=SHAPE["num_hidden_layers"], torch_dtype="bfloat16", dtype="bfloat16")
    cfg.pop("layer_types", None)  # written for the 1-layer stub; transformers rebuilds it
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").unlink()
    h, v, inter = SHAPE["hidden_size"], cfg["vocab_size"], SHAPE["intermediate_size"]
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (SHAPE["head_dim"],),
                       p + "self_attn.k_norm.weight": (SHAPE["head_dim"],),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    g = torch.Generator().manual_seed(0)
    names = list(shapes)
    weight_map, total = {}, 0
    for k in range(SHARDS):
        group = names[k * len(names) // SHARDS : (k + 1) * len(names) // SHARDS]
        tensors = {}
        for n in group:
            s = shapes[n]
            t = 1 + 0.1 * torch.randn(s, generator=g) if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
            tensors[n] = t.to(torch.bfloat16)
            total += tensors[n].numel() * 2
        file = f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("big")
    return path, write_bf16_checkpoint(path)


def load_in_child(path: Path, rank: int, size: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(rank), str(size)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_single_rank_peak_rss(big):
    path, size = big
    assert 0.95e9 < size < 1.1e9
    got = load_in_child(path, 0, 1)
    assert got["params"] == size
    print(f"tp=1: peak RSS growth {got['growth'] / 1e9:.3f} GB = {got['growth'] / size:.3f}x of {size / 1e9:.3f} GB")
    assert got["growth"] <= 1.25 * size


def test_each_tp_rank_peak_rss(big):
    path, size = big
    for rank in (0, 1):
        got = load_in_child(path, rank, 2)
        print(f"tp=2 rank {rank}: peak RSS growth {got['growth'] / 1e9:.3f} GB = {got['growth'] / size:.3f}x")
        assert got["growth"] <= 0.65 * size


def test_bf16_engine_logits_match_hf(big):
    from engine import EngineConfig, GenerationConfig, pipeline

    path, _ = big
    hf = load_hf_reference(path, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    with pipeline(str(path), EngineConfig(dtype="bfloat16", logprobs_mode="raw_logprobs", num_kv_blocks=8,
                                          kv_block_size=16, max_model_len=64)) as pipe:
        rows = pipe(PROMPT, GenerationConfig(max_new_tokens=0, logprob_start_len=0, logprobs=1)).input_token_logprobs
    got = torch.tensor([v for v, _ in rows])
    ref = want[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    print("max |logprob - HF| (bf16):", float((got - ref).abs().max()))
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.01)
