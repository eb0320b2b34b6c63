"""The network class of each model family, chosen by the checkpoint's `model_type`.

Every class here is built on the meta device from a `ModelSpec` and a `TPContext`, then
`materialize`d and loaded (engine.model.loading); it exposes `forward` (final hidden states of the
fed tokens), `logits` (full-vocabulary float32 rows for the hidden rows asked for),
`use_compiled_elementwise`, `spec`, `tp` and `moe_stats`, so the runner never knows which one it runs.
"""

from __future__ import annotations

from torch import nn

from engine.model.checkpoint import ModelSpec
from engine.model.llada2 import LLaDA2MoeModelLM
from engine.model.qwen3 import Qwen3ForCausalLM, TPContext

NETWORKS: dict[str, type[nn.Module]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3ForCausalLM,
    "sdar": Qwen3ForCausalLM,
    "sdar_moe": Qwen3ForCausalLM,
    "llada2_moe": LLaDA2MoeModelLM,
    "Fast_dLLM_Qwen": Qwen3ForCausalLM,  # Qwen2 layers: the Qwen3 stack without q/k norm (spec.qk_norm)
}


def build_network(spec: ModelSpec, tp: TPContext | None = None) -> Qwen3ForCausalLM:
    """The (unallocated, when built under `torch.device("meta")`) network for `spec`'s family."""
    return NETWORKS[spec.model_type](spec, tp)
