"""LLaDA2.2's block routing: each routing block of a request picks the experts its tokens may use.

With `expert_capacity` C and `block_size` b, a request's tokens at absolute positions [kb, (k+1)b)
form one routing block. Over that block, an expert's score is the largest biased score
r = sigmoid(router logits) + expert_bias (float32) any of its tokens gives it; the C best experts
are the block's allowed set, and each token takes its top `num_experts_per_tok` experts of that set
by r. (The weights, from the unbiased scores, are the group-limited router's: moe.py.)

A block's routing depends on every one of its tokens, so a forward must feed each request whole
routing blocks: a segment [start, end) of a request with start and end multiples of b. The engine
feeds block diffusion that way (a prompt's last partial block is completed by the first generated
masks; prefill chunks end on block multiples; a prefix-cache hit covers whole DLLM blocks; a step
feeds the current block, fused with the previous block's commit), and `check_segments` verifies it
per request before every forward, so a segment that covers part of a block is refused instead of
being routed differently. Once every segment is aligned, every b consecutive rows of the flat batch
are one routing block of one request (each request's rows start at a multiple of b in the batch),
which `allowed_experts` uses: no per-token request ids are needed, and the shapes are the same for
every step, as CUDA graphs need.
"""

from __future__ import annotations

import torch

from ops.attention import AttentionMetadata


def check_block_length(block_length: int | None, routing_block: int) -> None:
    """The engine's block length must be the checkpoint's routing block (the block the router was trained on)."""
    if block_length != routing_block:
        raise ValueError(f"dllm_block_length={block_length!r} does not fit this checkpoint: its block routing "
                         f"(config.json expert_capacity) routes blocks of block_size={routing_block} tokens; "
                         f"set dllm_block_length to {routing_block} or leave it unset")


def check_segments(meta: AttentionMetadata, routing_block: int) -> None:
    """Each request's segment of this forward covers whole routing blocks: a ValueError naming the first
    that does not (and the block length, which must be the routing block)."""
    check_block_length(meta.dllm_block_length, routing_block)
    b = routing_block
    for s, (q, kv) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True)):
        if q % b or kv % b:
            raise ValueError(f"block routing: sequence {s} of this forward feeds positions [{kv - q}, {kv}), "
                             f"which does not cover whole routing blocks of {b} tokens")


def allowed_experts(biased: torch.Tensor, routing_block: int, capacity: int) -> torch.Tensor:
    """A [T, E] mask of the experts each token may use: its routing block's `capacity` best by the block's
    largest biased score. `biased` [T, E] holds whole routing blocks of consecutive rows (`check_segments`)."""
    t, e = biased.shape
    blocks = biased.view(t // routing_block, routing_block, e)
    best = blocks.amax(dim=1).topk(capacity, dim=-1).indices
    keep = torch.zeros(t // routing_block, e, dtype=torch.bool, device=biased.device).scatter_(1, best, True)
    return keep.repeat_interleave(routing_block, dim=0)
