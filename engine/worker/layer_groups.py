"""Forwards of networks whose layers form groups with their own K/V geometry (DiffusionGemma:
sliding-window and full attention layers), run as encoder and canvas passes.

The network declares its page geometry (`kv_layout(page_size, tp_size)`: bytes per page of each
group, pool sizes for a memory budget, the per-layer caches); this module sizes the pools, allocates
the caches and runs a `ForwardBatch` whose `pass_kinds` are set. Each canvas pass may read the
self-conditioning input kept from the same request's previous canvas pass (zero at the rows the
batch's `zero_conditioning` names: a template's pinned positions) and keep its own for the next:
the soft embedding [canvas, hidden] in the weights' dtype, the smallest form the next step needs
exactly (the logits enter it only through softmax(logits / temperature) @ embedding).
"""

from __future__ import annotations

import torch

from configs import EngineConfig
from engine.worker.forward_batch import ForwardBatch, ForwardOutput
from engine.worker.kv_sizing import kv_budget_bytes


class LayerGroupPasses:
    """The pools, caches and kept self-conditioning of one rank serving a layer-group network."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 tp_size: int, max_len: int, attention: object):
        """`attention`: the network's own backend for its passes (`network.attention_backend`)."""
        self.attention = attention
        self.layout = model.kv_layout(config.kv_block_size, tp_size)
        self.device, self.dtype, self.page_size, self.tp_size = device, dtype, config.kv_block_size, tp_size
        n = config.num_kv_blocks
        explicit = isinstance(n, int) and not isinstance(n, bool)
        longest = -(-(max_len + 64) // config.kv_block_size)
        budget = 1 << 62 if explicit else kv_budget_bytes(config, device)
        self.pools = self.layout.pool_sizes(budget, dtype, config.max_batch_size, config.max_prefill_token_num,
                                            n if explicit else config.max_batch_size * longest)
        self.conditioning: dict[str, torch.Tensor] = {}

    @property
    def groups(self) -> dict[str, tuple[int, int | None]]:
        """Per layer group: (its pages, its sliding window or None)."""
        windows = self.layout.windows()
        return {g: (n, windows[g]) for g, n in self.pools.items()}

    def allocate(self) -> list[tuple[torch.Tensor, ...]]:
        return self.layout.allocate(self.pools, self.dtype, self.device)

    def execute(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, ...]],
                batch: ForwardBatch) -> ForwardOutput:
        for key in batch.drop_conditioning:
            self.conditioning.pop(key, None)
        n = len(batch.q_lens)
        keys = batch.conditioning_keys or [None] * n
        soft = [self.conditioning.get(k) if k is not None else None for k in keys]
        for s, rows in enumerate(batch.zero_conditioning):
            if rows and soft[s] is not None:
                soft[s] = soft[s].index_fill(0, torch.tensor(rows, device=self.device), 0)
        starts = [kv - q for kv, q in zip(batch.kv_lens, batch.q_lens, strict=True)]
        meta = model.pass_metadata(batch.pass_kinds, starts, batch.q_lens, batch.group_page_tables, soft,
                                   self.page_size, self.device, self.attention)
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        hidden = model(ids, positions, kv_caches, meta)
        # a canvas pass samples every row of its canvas: its first sampled row -> (key, temperature)
        first_sampled = {r: i for i, r in enumerate(batch.sample_rows)}
        keep, row = {}, 0
        for s, kept in enumerate(batch.keep_conditioning or [None] * n):
            if kept is not None:
                keep[first_sampled[row]] = kept
            row += batch.q_lens[s]
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        logits = CanvasLogits(model, hidden[rows], keep, self.conditioning)
        if self.tp_size > 1:  # every rank keeps its own self-conditioning; only rank 0's logits are read
            for first, q in zip(list(keep), (q for q, k in zip(batch.q_lens, batch.keep_conditioning) if k),
                                strict=True):
                logits[first: first + q]
            logits.keep = {}
        return ForwardOutput(logits=logits)


class CanvasLogits:
    """The logits rows of a forward of encoder / canvas passes, projected when a slice of them is
    read: the engine reads one request's rows at a time, so at most one request's [canvas, vocabulary]
    logits are alive whatever the batch. Reading a canvas's rows also keeps its self-conditioning
    for the request's next canvas pass (softmax(logits / temperature) @ embedding), from the same
    projection."""

    def __init__(self, model: torch.nn.Module, hidden: torch.Tensor, keep: dict[int, tuple[str, float]],
                 conditioning: dict[str, torch.Tensor]):
        self.model, self.hidden, self.keep, self.conditioning = model, hidden, keep, conditioning

    @property
    def shape(self) -> tuple[int, int]:
        return self.hidden.shape[0], self.model.spec.vocab_size

    @torch.inference_mode()
    def __getitem__(self, rows: slice) -> torch.Tensor:
        logits = self.model.logits(self.hidden[rows])
        kept = self.keep.get(rows.start or 0)
        if kept is not None:
            key, temperature = kept
            self.conditioning[key] = self.model.soft_embedding(logits / temperature)
        return logits
