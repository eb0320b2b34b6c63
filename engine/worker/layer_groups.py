"""Forwards of networks whose layers form groups with their own K/V geometry (DiffusionGemma:
sliding-window and full attention layers), run as encoder and canvas passes.

The network declares its page geometry (`kv_layout(page_size, tp_size)`: bytes per page of each
group, pool sizes for a memory budget, the per-layer caches); this module sizes the pools, allocates
the caches and runs a `ForwardBatch` whose `pass_kinds` are set. Each canvas pass may read the
self-conditioning input kept from the same request's previous canvas pass and keep its own for the
next: the soft embedding [canvas, hidden] in the weights' dtype, the smallest form the next step
needs exactly (the logits enter it only through softmax(logits / temperature) @ embedding).
"""

from __future__ import annotations

import torch

from configs import EngineConfig
from engine.worker.forward_batch import ForwardBatch, ForwardOutput
from engine.worker.kv_sizing import kv_budget_bytes


class LayerGroupPasses:
    """The pools, caches and kept self-conditioning of one rank serving a layer-group network."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 tp_size: int, max_len: int):
        if config.attention_backend in ("flash", "flex"):
            raise ValueError(f"attention_backend={config.attention_backend!r}: a {model.spec.model_type} model's "
                             "encoder and canvas passes run on the torch reference attention only; "
                             "use attention_backend='torch' or 'auto'")
        self.layout = model.kv_layout(config.kv_block_size, tp_size)
        self.device, self.dtype, self.page_size = device, dtype, config.kv_block_size
        n = config.num_kv_blocks
        explicit = isinstance(n, int) and not isinstance(n, bool)
        longest = -(-(max_len + 64) // config.kv_block_size)
        budget = 1 << 62 if explicit else kv_budget_bytes(config, device)
        self.pools = self.layout.pool_sizes(budget, dtype, config.max_batch_size, config.max_prefill_token_num,
                                            n if explicit else config.max_batch_size * longest)
        self.conditioning: dict[str, torch.Tensor] = {}

    def allocate(self) -> list[tuple[torch.Tensor, ...]]:
        return self.layout.allocate(self.pools, self.dtype, self.device)

    def execute(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, ...]],
                batch: ForwardBatch) -> ForwardOutput:
        for key in batch.drop_conditioning:
            self.conditioning.pop(key, None)
        n = len(batch.q_lens)
        keys = batch.conditioning_keys or [None] * n
        soft = [self.conditioning.get(k) if k is not None else None for k in keys]
        starts = [kv - q for kv, q in zip(batch.kv_lens, batch.q_lens, strict=True)]
        meta = model.pass_metadata(batch.pass_kinds, starts, batch.q_lens, batch.group_page_tables, soft,
                                   self.page_size, self.device)
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        hidden = model(ids, positions, kv_caches, meta)
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        out = ForwardOutput(logits=model.logits(hidden[rows]))
        sampled = {r: i for i, r in enumerate(batch.sample_rows)}
        row = 0
        for s, keep in enumerate(batch.keep_conditioning or [None] * n):
            if keep is not None:
                key, temperature = keep
                span = range(row, row + batch.q_lens[s])
                if all(r in sampled for r in span):  # the canvas's logits were projected already
                    logits = out.logits[[sampled[r] for r in span]]
                else:
                    logits = model.logits(hidden[span.start: span.stop])
                self.conditioning[key] = model.soft_embedding(logits / temperature)
            row += batch.q_lens[s]
        return out
