"""The LLaDA2 family's own config.json fields (`model_type: llada2_moe`), read into `LLaDA2Spec`.

LLaDA2 layers differ from Qwen3's in ways the common reading cannot express: a fused QKV
projection, a rotary embedding on only part of each head, dense first layers, and a sigmoid router
with an expert bias, expert groups, a scaling factor and shared experts. Every field that changes
the math is honoured by the family's network (network.py) or refused here by name. A field a config leaves out
takes the value of the family's published configuration class (e.g. `use_bias` true, 8 expert groups).

LLaDA2.2 adds block routing: `expert_capacity` C with `block_size` (the routing block, which is also
the checkpoint's block length: the family row reads `block_size` for it) replaces the expert groups,
which are then ignored (block_routing.py); and the Insert/Delete edit tokens `delete_token_id` and
`split_token_id`, read here for the decoding rule that writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import CheckpointError


@dataclass(frozen=True)
class LLaDA2Spec:
    """LLaDA2 architecture facts (`ModelSpec.extra` of a `llada2_moe` checkpoint)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    #: layers below this index keep a dense MLP of `intermediate_size`
    first_k_dense_replace: int
    #: leading dims of each head the (NeoX, rotate-half) rotary embedding turns
    rotary_dim: int
    #: bias on the attention output projection (`attention.dense`)
    dense_bias: bool
    #: LLaDA2.2's block routing: experts a routing block may use (None: group-limited routing)
    expert_capacity: int | None = None
    #: tokens per routing block (config.json `block_size`; set with `expert_capacity`)
    routing_block: int | None = None
    #: LLaDA2.2's Insert/Delete edit tokens (config.json; None when the checkpoint names none)
    delete_token_id: int | None = None
    split_token_id: int | None = None

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


# config.json fields whose non-default values this engine does not compute: (field, accepted values)
_ONLY = (
    ("hidden_act", ("silu",)),
    ("score_function", ("sigmoid",)),
    ("router_dtype", ("fp32", "float32")),
    ("norm_head", (False,)),
    ("moe_router_enable_expert_bias", (True,)),
    ("rope_scaling", (None,)),
)


def llada2_fields(cfg: dict) -> dict[str, Any]:
    """ModelSpec fields of a `llada2_moe` config.json (CheckpointError naming any field it cannot honour)."""
    for name, accepted in _ONLY:
        if name in cfg and cfg[name] not in accepted:
            raise CheckpointError(f"config.json {name}={cfg[name]!r} is not supported for llada2_moe "
                                  f"(supported: {', '.join(map(repr, accepted))})")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rotary_dim = int(head_dim * cfg.get("partial_rotary_factor", 0.5))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise CheckpointError(f"config.json partial_rotary_factor={cfg.get('partial_rotary_factor')!r} gives "
                              f"{rotary_dim} rotary dims of head_dim={head_dim}: it must be even and in (0, head_dim]")
    num_experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    n_group, topk_group = cfg.get("n_group", 8), cfg.get("topk_group", 4)
    capacity, routing_block = _block_routing(cfg, num_experts, top_k)
    if capacity is None:  # the groups route; block routing ignores them
        _check_groups(num_experts, top_k, n_group, topk_group)
    extra = LLaDA2Spec(
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["moe_intermediate_size"],
        num_shared_experts=cfg.get("num_shared_experts") or 0, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        first_k_dense_replace=cfg.get("first_k_dense_replace", 0), rotary_dim=rotary_dim,
        dense_bias=bool(cfg.get("use_bias", True)),
        expert_capacity=capacity, routing_block=routing_block, **_edit_tokens(cfg),
    )
    return {"head_dim": head_dim, "attention_bias": bool(cfg.get("use_qkv_bias", False)),
            "qk_norm": bool(cfg.get("use_qk_norm", True)), "extra": extra}


def _check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Group-limited routing's fields (LLaDA2.0 / 2.1): groups that divide the experts and leave top-k room."""
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise CheckpointError(f"config.json n_group={n_group}, topk_group={topk_group}: n_group must divide "
                              f"num_experts={num_experts} and topk_group be between 1 and n_group")
    if num_experts // n_group < 2:
        raise CheckpointError(f"config.json n_group={n_group}: a group's score is the sum of its two best "
                              f"experts, so each group needs at least 2 of num_experts={num_experts}")
    if not 1 <= top_k <= num_experts * topk_group // n_group:
        raise CheckpointError(f"config.json num_experts_per_tok={top_k} must be between 1 and the experts of "
                              f"topk_group={topk_group} groups ({num_experts * topk_group // n_group})")


def _block_routing(cfg: dict, num_experts: int, top_k: int) -> tuple[int, int] | tuple[None, None]:
    """(expert_capacity, block_size) of a block-routed checkpoint (LLaDA2.2); (None, None) without
    `expert_capacity`."""
    capacity = cfg.get("expert_capacity")
    if capacity is None:
        return None, None
    if type(capacity) is not int or not top_k <= capacity <= num_experts:
        raise CheckpointError(f"config.json expert_capacity={capacity!r} must be an integer between "
                              f"num_experts_per_tok={top_k} and num_experts={num_experts}")
    block = cfg.get("block_size")
    if type(block) is not int or block < 1:
        raise CheckpointError(f"config.json block_size={block!r}: block routing (expert_capacity) routes per "
                              "block of block_size tokens and needs it as a positive integer")
    return capacity, block


def _edit_tokens(cfg: dict) -> dict[str, int | None]:
    """`delete_token_id` / `split_token_id` when config.json names them: distinct ids in the vocabulary."""
    ids = {name: cfg.get(name) for name in ("delete_token_id", "split_token_id")}
    for name, token in ids.items():
        if token is not None and not (type(token) is int and 0 <= token < cfg["vocab_size"]):
            raise CheckpointError(f"config.json {name}={token!r} must be a token id below "
                                  f"vocab_size={cfg['vocab_size']}")
    if ids["delete_token_id"] is not None and ids["delete_token_id"] == ids["split_token_id"]:
        raise CheckpointError(f"config.json delete_token_id and split_token_id are both {ids['split_token_id']}: "
                              "the two edit tokens must differ")
    return ids
