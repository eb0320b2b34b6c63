"""What every attention backend shares: the per-forward metadata, the host-side plan, the backend
interface and the paged K/V write."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Everything a layer needs to attend over the paged cache; built once per forward.

    `q_lens[s]` query tokens of sequence s (contiguous in the flat batch, in order) end at position
    `kv_lens[s] - 1`: this forward writes them and they are the newest keys of the sequence.
    """

    q_lens: list[int]
    kv_lens: list[int]
    positions: torch.Tensor  # [T] absolute positions of the query tokens
    slot_mapping: torch.Tensor  # [T] flat cache slot (page * page_size + offset) of each token
    page_tables: torch.Tensor  # [S, max_pages] int64, padded with 0
    page_size: int
    dllm_block_length: int | None  # None = causal
    # per sequence: its rows see every key below its kv_len, unmasked (a block denoised over its causal
    # prefix); the others follow `dllm_block_length`. None: no sequence of the forward is named
    bidirectional: list[bool] | None = None
    # Derived, filled by the backend's `prepare` once per forward and reused by every layer.
    extra: dict | None = None
    # The page tables as host lists (unpadded), when the caller has them: `plan` reads these.
    page_table_lists: list[list[int]] | None = None
    # The backend's `plan` for this forward, and its arrays as device tensors (uploaded by the caller).
    plan: StepPlan | None = None
    planned: dict[str, torch.Tensor] | None = None


@dataclass
class StepPlan:
    """What a backend derives from a batch on the host: flat int arrays (lists or int64 numpy arrays,
    uploaded with the step's other metadata) and host values (sizes, flags) that `prepare` needs without
    reading the device."""

    arrays: dict[str, list[int] | np.ndarray] = field(default_factory=dict)
    scalars: dict[str, object] = field(default_factory=dict)


def table_lists(rows: list[list[int]], kv_lens: list[int], page_size: int) -> list[list[int]]:
    """Padded page-table rows cut to each sequence's pages up to its last key's (what a backend's plan
    reads when it `plans_from_page_tables`)."""
    return [row[: -(-kv // page_size)] for row, kv in zip(rows, kv_lens, strict=True)]


def planned(backend: AttentionBackend, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """`meta.planned`, planning and uploading here (one copy per array) if the caller did not."""
    if meta.planned is None:
        tables = meta.page_table_lists
        if tables is None and backend.plans_from_page_tables:  # read back
            tables = table_lists(meta.page_tables.tolist(), meta.kv_lens, meta.page_size)
        meta.plan = backend.plan(meta.q_lens, meta.kv_lens, tables or [], meta.page_size, meta.dllm_block_length,
                                 None, meta.bidirectional)
        device = meta.positions.device
        meta.planned = {name: torch.tensor(values, dtype=torch.long, device=device)
                        for name, values in meta.plan.arrays.items()}
    return meta.planned


class AttentionBackend:
    """One way to attend over the paged cache. `prepare` derives what every layer of a forward shares
    (into `meta.extra`); `forward` writes this forward's K/V into the cache, then `attend`s."""

    name = "base"
    plans_from_page_tables = False  # whether `plan` reads the page tables
    # Whether a CUDA graph may capture this backend's forwards: `prepare` makes no host->device copy and
    # every launch is fixed by the step's padded token count once `plan` pads to `tiles_for` its tiles.
    graph_safe = False

    def plan(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             block_length: int | None, pad_tiles: int | None = None, bidirectional: list[bool] | None = None
             ) -> StepPlan:
        """Host-side metadata of a forward from the batch's lists alone (as `AttentionMetadata`'s fields;
        `page_tables` unpadded). A graph-safe backend pads its per-tile arrays to `pad_tiles` tiles."""
        return StepPlan()

    def tiles_for(self, tokens: int, max_seqs: int) -> int:
        """(Graph-safe backends) the tiles every step of `tokens` rows over at most `max_seqs` sequences
        is padded to."""
        raise NotImplementedError(f"the {self.name} backend is not graph-safe")

    def prepare(self, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [pages, page_size, KVH, D]. Returns [T, H, D]."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Paged KV write: token t's K/V go to flat slot `slots[t]` (overwriting what was there)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)
