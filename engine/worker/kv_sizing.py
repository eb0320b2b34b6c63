"""How many KV pages a rank allocates: an explicit count, or what a memory budget holds."""

from __future__ import annotations

import torch

from configs import EngineConfig
from engine.model.spec import ModelSpec


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """The memory the KV cache may take: a share of CUDA's free memory, or of the CPU budget."""
    n = config.num_kv_blocks
    fraction = 0.9 if n is None else float(n)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return int(config.cpu_kv_cache_bytes * (1.0 if n is None else fraction))


def page_bytes(spec: ModelSpec, page_size: int, dtype: torch.dtype, tp_size: int) -> int:
    """Bytes one KV page takes on one shard (K and V, every layer)."""
    per_token = 2 * spec.num_hidden_layers * (spec.num_key_value_heads // tp_size) * spec.head_dim
    return per_token * page_size * torch.empty((), dtype=dtype).element_size()


def num_kv_pages(spec: ModelSpec, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Pages to allocate: an explicit count, or a share of memory (CUDA free memory / CPU budget)."""
    n = config.num_kv_blocks
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    pages = kv_budget_bytes(config, device) // page_bytes(spec, config.kv_block_size, dtype, config.tp)
    max_useful = config.max_batch_size * -(-(config.max_model_len + 64) // config.kv_block_size)
    if spec.is_dllm and config.dllm_block_length:
        max_useful += trajectory_view_pages(config.dllm_block_length, config)
    return max(1, min(pages, max_useful))


def trajectory_view_pages(block_length: int, config: EngineConfig) -> int:
    """Scratch pages for one forward full of trajectory-scoring views: each view is a block's B rows
    with private pages for its own copy of the block (blocks start at multiples of B, so a block
    spans exactly the pages B needs when B and the page size divide one another, else at most one
    more), and a forward holds up to `max_prefill_token_num` rows of views.
    Without them a few trajectories would share the pages left over by their contexts and score in
    dozens of forwards instead of one or two."""
    page = config.kv_block_size
    per_view = -(-block_length // page) + (page % block_length != 0 and block_length % page != 0)
    return config.max_prefill_token_num // block_length * per_view
