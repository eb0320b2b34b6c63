"""The bench checkpoints: SDAR-shaped and Qwen3-shaped, random weights, the real 151,936 vocabulary."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from testing.tiny_checkpoint import write_tiny_checkpoint

VOCAB = 151_936  # Qwen3 / SDAR vocabulary size
# With the shape below, logit_scale 4 puts about half of the greedy confidences at masked positions
# under the 0.85 threshold (median about 0.85), so dynamic unmasking takes 1 to 4 steps per block.
DLLM_LOGIT_SCALE = 4.0


@dataclass(frozen=True)
class BenchShape:
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = VOCAB
    max_position_embeddings: int = 8192  # room for the memory part's 6,000-token sequence

    def matmul_flops_per_token(self) -> int:
        """Projection + MLP FLOPs of one token through every layer (2 per multiply-add)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size
        return 2 * per_layer * self.num_hidden_layers

    def attention_flops(self, q_len: int, kv_len: int) -> int:
        """QK^T and PV FLOPs of q_len queries over kv_len keys, every layer and head."""
        return 4 * q_len * kv_len * self.num_attention_heads * self.head_dim * self.num_hidden_layers

    def lm_head_flops(self, rows: int) -> int:
        return 2 * rows * self.hidden_size * self.vocab_size


# Seconds-long runs for the test suite: every code path of a bench, figures meaningless. 384 covers the
# byte tokenizer's 324 tokens.
TOY_SHAPE = BenchShape(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, vocab_size=384, max_position_embeddings=1024)


def write_bench_models(root: Path, shape: BenchShape) -> dict[str, Path]:
    """Write both checkpoints under `root`; returns {"sdar": path, "qwen3": path}.

    The Qwen3 checkpoint shares the SDAR one's weights file (a symlink; only config.json differs),
    which halves the time spent writing 600+ MB of embeddings."""
    sdar = write_tiny_checkpoint(root / "sdar", model_type="sdar", logit_scale=DLLM_LOGIT_SCALE, block_size=4,
                                 seed=1, **asdict(shape))
    qwen3 = root / "qwen3"
    qwen3.mkdir(parents=True, exist_ok=True)
    for f in sdar.iterdir():
        target = qwen3 / f.name
        target.unlink(missing_ok=True)
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
            cfg.pop("block_size", None)
            cfg.pop("mask_token_id", None)
            target.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        elif f.suffix == ".safetensors":
            target.symlink_to(f.resolve())
        else:
            shutil.copy(f, target)
    return {"sdar": sdar, "qwen3": qwen3}


def stop_ids_of(path: Path) -> set[int]:
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    eos = gen.get("eos_token_id", [])
    return {cfg["eos_token_id"], *(eos if isinstance(eos, list) else [eos])}


def mask_id_of(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["mask_token_id"]
