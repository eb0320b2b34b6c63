"""DiffusionGemma's encoder and canvas passes through FlexAttention.

Per layer group, the forward's keys are laid out as one sequence: every pass's committed keys
gathered from the paged cache (the slots the torch reference reads, in pass order), then the
forward's own K/V rows (encoder passes' just written, canvas passes' scratch). The mask decides per
(query row, key): same pass, and either the query is a canvas row (it sees its pass's committed keys
and its whole canvas) or the key is causal to it (position ≤ the query's) and, on sliding layers,
inside the window (position > the query's − `sliding_window`). The BlockMask lists, per tile of
`FLEX_TILE` query rows, the key blocks of the passes in that tile (an encoder pass's own keys only up
to the tile's last row), so a compiled kernel reads only those.

Compiled on CUDA where Triton is installed; eager elsewhere (the dense reference implementation,
which computes every (query, key) score: how it is tested against the torch reference). A compiled
kernel that fails to build hands over to the torch reference for the rest of the engine's life.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from engine.model.families.diffusion_gemma.attention import (
    CANVAS,
    GemmaAttentionMeta,
    GemmaTorchAttention,
    GroupPlan,
)
from ops.attention import FLEX_TILE, flex_attention_fn

log = logging.getLogger(__name__)

KEY_BLOCK = 16  # keys per BlockMask block


def plan_flex(meta: GemmaAttentionMeta, plan: GroupPlan) -> dict[str, list[int] | int]:
    """The host-side arrays of one group's BlockMask and mask (as lists), and its sizes."""
    num_rows = sum(p.q_len for p in meta.passes)
    num_committed = sum(len(slots) for slots in plan.committed)
    key_pass: list[int] = []
    key_pos: list[int] = []
    for s, (slots, lo) in enumerate(zip(plan.committed, plan.committed_from, strict=True)):
        key_pass += [s] * len(slots)
        key_pos += range(lo, lo + len(slots))
    q_pass: list[int] = []
    q_pos: list[int] = []
    q_canvas: list[int] = []
    for s, p in enumerate(meta.passes):
        q_pass += [s] * p.q_len
        q_pos += range(p.start, p.start + p.q_len)
        q_canvas += [int(p.kind == CANVAS)] * p.q_len
    key_pass += q_pass
    key_pos += q_pos
    tiles = -(-num_rows // FLEX_TILE)
    num_keys = -(-len(key_pass) // KEY_BLOCK) * KEY_BLOCK
    # each tile's key blocks: per pass in it, its committed keys and its own rows (an encoder pass's
    # own rows up to the tile's last row: a row sees no later row of its pass)
    committed_at = [0]
    for slots in plan.committed:
        committed_at.append(committed_at[-1] + len(slots))
    tile_blocks: list[set[int]] = [set() for _ in range(tiles)]
    for s, (p, row) in enumerate(zip(meta.passes, plan.rows, strict=True)):
        for t in range(row // FLEX_TILE, (row + p.q_len - 1) // FLEX_TILE + 1):
            tile_end = min(row + p.q_len, (t + 1) * FLEX_TILE)
            own_end = row + p.q_len if p.kind == CANVAS else tile_end
            for start, end in ((committed_at[s], committed_at[s + 1]),
                               (num_committed + row, num_committed + own_end)):
                if end > start:
                    tile_blocks[t].update(range(start // KEY_BLOCK, (end - 1) // KEY_BLOCK + 1))
    blocks = [sorted(b) for b in tile_blocks]
    width = max(len(b) for b in blocks)
    pad_rows, pad_keys = tiles * FLEX_TILE - num_rows, num_keys - len(key_pass)
    return {"slots": np.concatenate(plan.committed).tolist() if plan.committed else [],
            "key_pass": key_pass + [-1] * pad_keys, "key_pos": key_pos + [0] * pad_keys,
            "q_pass": q_pass + [-2] * pad_rows, "q_pos": q_pos + [0] * pad_rows, "q_canvas": q_canvas + [0] * pad_rows,
            "kv_num_blocks": [len(b) for b in blocks],
            "kv_indices": [i for b in blocks for i in b + [0] * (width - len(b))],
            "tiles": tiles, "width": width, "num_rows": num_rows, "num_keys": num_keys}


class GemmaFlexAttention:
    """FlexAttention over each pass's committed keys and the forward's own K/V (see the module)."""

    graph_safe = False

    def __init__(self, compiled: bool, dynamic: bool = False):
        """`dynamic`: as `ops.attention.flex_attention_fn`'s (serving compiles symbolic shapes)."""
        self.compiled, self.name = compiled, "flex"
        self.fn = flex_attention_fn(compiled, dynamic)
        self.fallback: GemmaTorchAttention | None = None  # serves instead once the compiled kernel failed

    def prepare(self, meta: GemmaAttentionMeta, plan: GroupPlan) -> None:
        if self.fallback is not None:
            self.fallback.prepare(meta, plan)
            return
        host = plan_flex(meta, plan)
        device = meta.device
        arrays = {name: torch.tensor(host[name], dtype=torch.long, device=device)
                  for name in ("slots", "key_pass", "key_pos", "q_pass", "q_pos")}
        arrays["q_canvas"] = torch.tensor(host["q_canvas"], dtype=torch.bool, device=device)
        num_blocks = torch.tensor(host["kv_num_blocks"], dtype=torch.int32, device=device)[None, None]
        indices = torch.tensor(host["kv_indices"], dtype=torch.int32, device=device).view(host["tiles"], host["width"])
        if self.compiled and device.type != "cuda":  # the CPU kernel wants a column per block of keys
            indices = F.pad(indices, (0, host["num_keys"] // KEY_BLOCK - host["width"]))
        plan.backend["flex"] = {**arrays, "num_keys": host["num_keys"],
                                "block_mask": BlockMask.from_kv_blocks(
                                    num_blocks, indices[None, None], BLOCK_SIZE=(FLEX_TILE, KEY_BLOCK),
                                    mask_mod=_mask_mod(arrays, plan.window),
                                    seq_lengths=(host["num_rows"], host["num_keys"]), compute_q_blocks=False)}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: GemmaAttentionMeta, plan: GroupPlan) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback.attend(q, k, v, k_cache, v_cache, meta, plan)
        flex = plan.backend["flex"]
        kvh, d = k_cache.shape[-2:]
        pad = flex["num_keys"] - len(flex["slots"]) - k.shape[0]
        keys = torch.cat([k_cache.view(-1, kvh, d).index_select(0, flex["slots"]), k, k.new_zeros(pad, kvh, d)])
        values = torch.cat([v_cache.view(-1, kvh, d).index_select(0, flex["slots"]), v, v.new_zeros(pad, kvh, d)])
        try:
            out = self.fn(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                          block_mask=flex["block_mask"], scale=1.0, enable_gqa=True)
        except Exception as error:  # noqa: BLE001 -- whatever the compiler raised; eager errors propagate
            if not self.compiled:
                raise
            log.error("compiled FlexAttention failed on a diffusion_gemma model (%s: %s); the torch attention "
                      "backend serves instead", type(error).__name__, error)
            self.fallback, self.name = GemmaTorchAttention(), "torch (compiled flex failed)"
            return self.fallback.attend(q, k, v, k_cache, v_cache, meta, plan)
        return out[0].transpose(0, 1)


def _mask_mod(arrays: dict[str, torch.Tensor], window: int | None) -> Callable[..., torch.Tensor]:
    key_pass, key_pos = arrays["key_pass"], arrays["key_pos"]
    q_pass, q_pos, q_canvas = arrays["q_pass"], arrays["q_pos"], arrays["q_canvas"]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        qp, kp = q_pos[q_idx], key_pos[kv_idx]
        causal = kp <= qp
        if window is not None:
            causal = causal & (kp > qp - window)
        return (key_pass[kv_idx] == q_pass[q_idx]) & (q_canvas[q_idx] | causal)

    return mask_mod
