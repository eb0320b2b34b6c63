"""The project's paged-attention kernel, in Triton: every row kind the engine feeds, in one launch whose
grid a CUDA graph can capture.

A *tile* is up to `BLOCK_Q` consecutive query rows of one sequence. One program attends one tile for
one K/V head: the `G` query heads that share that K/V head are packed into the tile's M dimension
(`BLOCK_M = BLOCK_Q * G` rows, row `m` being query row `m // G` of head `kvh * G + m % G`), so every
K/V head is read once per tile, in place, through the sequence's page table. Which keys a query row
at position `pos` of a sequence holding `kv_len` keys sees is `[lo, hi)`:

* causal (AR prefill and decode): `hi = pos + 1`;
* block-causal (block diffusion, block length `B`): `hi = min((pos // B + 1) * B, kv_len)` -- a
  prefill chunk sees its own block bidirectionally and the blocks before it; a denoising block, a
  commit fused with the next block's first step and a sub-block all are this rule;
* bidirectional: `hi = kv_len` (a canvas over its committed prefix);
* a sliding window `W > 0` adds `lo = pos - W + 1`.

The loop runs over key tiles from the tile's lowest `lo` to its highest `hi` (positions grow along a
sequence's rows), with an online softmax in float32; P is cast to the K/V dtype for P·V, as
FlashAttention does. A tile never mixes sequences and keys are never split across programs, so a
sequence's attention does not depend on what else is in the batch.

The host plan (`plan_tiles`) is a few int arrays per tile. Padded with empty tiles (`rows == 0`, the
program returns at once) to a count fixed per graph bucket, it makes the grid `(tiles, kv_heads)` the
same at every replay of the bucket, whatever mix of prefill chunks, blocks and decode rows the step
carries. Page-table columns past a sequence's keys are never read, so a table padded with anything
serves.

On the CPU the kernel runs under Triton's interpreter, which TRITON_INTERPRET=1 switches on when it is
set before Triton is first imported (tests/conftest.py does): that is how the suite checks it. Two
things differ there: the interpreter's `tl.dot` is
wrong on bfloat16, so it computes in float32 (`UPCAST`; loads, stores and addressing still run in
the storage dtype), and float32 dots are IEEE on every device (`IEEE`; a GPU would use TF32 else).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

CAUSAL, BLOCK_CAUSAL, BIDIRECTIONAL, PASSES = 0, 1, 2, 3
PASS_ENCODE, PASS_CANVAS = 0, 1  # a tile's kind in PASSES mode
BLOCK_M = 16  # query rows x packed heads per program: the smallest tile tl.dot takes


def block_q(group: int) -> int:
    """Query rows per tile when `group` query heads share a K/V head."""
    return max(1, BLOCK_M // group)


def max_tiles(tokens: int, max_seqs: int, rows_per_tile: int) -> int:
    """An upper bound on the tiles of any step of `tokens` rows over at most `max_seqs` sequences: each
    sequence's last tile may be partial."""
    return -(-tokens // rows_per_tile) + min(max_seqs, tokens)


def plan_tiles(q_lens: list[int], kv_lens: list[int], rows_per_tile: int, pad_to: int | None = None
               ) -> dict[str, np.ndarray]:
    """Per tile: its sequence (the page-table row), first flat query row, row count and the sequence's
    key count, as int64 arrays; `pad_to` appends empty tiles up to that many. A few array operations for
    the whole step: the plan is host work of every forward, graphed or not."""
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"{len(q_lens)} query lengths for {len(kv_lens)} key lengths")
    q = np.asarray(q_lens, dtype=np.int64)
    tiles = -(-q // rows_per_tile)  # per sequence (none for one that feeds no row)
    seq = np.repeat(np.arange(q.size), tiles)
    k = np.arange(seq.size) - (np.cumsum(tiles) - tiles)[seq]  # each tile's index within its sequence
    n = seq.size
    if pad_to is not None and n > pad_to:
        raise ValueError(f"{n} tiles do not fit a plan of {pad_to}")
    plan = np.zeros((4, n if pad_to is None else pad_to), dtype=np.int64)  # the padding tiles: all zero
    plan[0, :n] = seq
    plan[1, :n] = (np.cumsum(q) - q)[seq] + k * rows_per_tile
    np.minimum(rows_per_tile, q[seq] - k * rows_per_tile, out=plan[2, :n])
    plan[3, :n] = np.asarray(kv_lens, dtype=np.int64)[seq]
    return {"tile_seq": plan[0], "tile_row0": plan[1], "tile_rows": plan[2], "tile_kv_len": plan[3]}


def _paged_attention(out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, pos_ptr,
                     tile_seq_ptr, tile_row0_ptr, tile_rows_ptr, tile_kv_ptr,
                     tile_kind_ptr, tile_lo_ptr, tile_own_row0_ptr, tile_own_len_ptr, own_k_ptr, own_v_ptr,
                     scale, table_stride, q_s0, q_s1, o_s0, o_s1, c_s0, c_s1, c_s2, own_s0, own_s1,
                     MODE: tl.constexpr, DLLM_BLOCK: tl.constexpr, WINDOW: tl.constexpr, G: tl.constexpr,
                     BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, HEAD: tl.constexpr,
                     HEAD_P: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.load(tile_rows_ptr + tile)
    if rows == 0:  # an empty tile padding the grid to its bucket's size
        return
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row0_ptr + tile)
    kv_len = tl.load(tile_kv_ptr + tile)
    m = tl.arange(0, BLOCK_Q * G)
    r = m // G  # query row inside the tile
    h = kvh * G + m % G  # query head
    d = tl.arange(0, HEAD_P)
    row_ok = r < rows
    d_ok = d < HEAD
    pos = tl.load(pos_ptr + row0 + r, mask=row_ok, other=0)
    pos_first = tl.load(pos_ptr + row0)
    pos_last = tl.load(pos_ptr + row0 + rows - 1)
    # each row's cached keys [lo, hi), and the tile's whole range [key_lo, key_end): positions grow
    # along a tile's rows, so its first and last rows bound it
    if MODE == 3:  # passes: a canvas tile sees its committed keys from an anchored lo, bidirectionally
        canvas = tl.load(tile_kind_ptr + tile) == 1  # PASS_CANVAS (a jit function reads no Python globals)
        canvas_lo = tl.load(tile_lo_ptr + tile)
        hi = tl.where(canvas, kv_len, pos + 1)
        key_end = tl.where(canvas, kv_len, pos_last + 1)
        if WINDOW > 0:
            lo = tl.where(canvas, canvas_lo, tl.maximum(pos - WINDOW + 1, 0))
            key_lo = tl.where(canvas, canvas_lo, tl.maximum(pos_first - WINDOW + 1, 0))
        else:
            lo = tl.where(canvas, canvas_lo, 0) + tl.zeros_like(pos)  # a row's bound: [BLOCK_M]
            key_lo = tl.where(canvas, canvas_lo, 0)
    else:
        if MODE == 0:
            hi = pos + 1
            key_end = pos_last + 1
        elif MODE == 1:
            hi = tl.minimum((pos // DLLM_BLOCK + 1) * DLLM_BLOCK, kv_len)
            key_end = tl.minimum((pos_last // DLLM_BLOCK + 1) * DLLM_BLOCK, kv_len)
        else:
            hi = tl.zeros_like(pos) + kv_len
            key_end = kv_len
        if WINDOW > 0:
            lo = tl.maximum(pos - WINDOW + 1, 0)
            key_lo = tl.maximum(pos_first - WINDOW + 1, 0)
        else:
            lo = tl.zeros_like(pos)
            key_lo = 0
    hi = tl.where(row_ok, hi, 0)
    q = tl.load(q_ptr + (row0 + r)[:, None] * q_s0 + h[:, None] * q_s1 + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_Q * G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G], tl.float32)
    acc = tl.zeros([BLOCK_Q * G, HEAD_P], tl.float32)
    # One loop over key tiles: first the cached keys through the page table (none below key_lo is
    # loaded: a sliding window's pages before it may have been freed), then, in PASSES mode, a canvas
    # tile's own K/V rows, which never enter the cache and which every row of it sees. (One loop, its
    # softmax update inline: a device-function call costs the CPU interpreter a re-patch per call.)
    key_base = key_lo // TILE * TILE
    cached_tiles = tl.cdiv(key_end - key_base, TILE)
    tiles = cached_tiles
    own_row0 = row0 * 0  # read only in PASSES mode, but every branch of the loop below compiles
    own_len = row0 * 0
    if MODE == 3:
        own_row0 = tl.load(tile_own_row0_ptr + tile)
        own_len = tl.load(tile_own_len_ptr + tile)
        tiles = cached_tiles + tl.cdiv(own_len, TILE)
    for t in range(0, tiles):
        if t < cached_tiles:
            j = key_base + t * TILE + tl.arange(0, TILE)
            j_ok = (j >= key_lo) & (j < key_end)
            page = tl.load(tables_ptr + seq * table_stride + j // PAGE, mask=j_ok, other=0).to(tl.int64)
            slot = page * c_s0 + (j % PAGE) * c_s1 + kvh * c_s2
            k = tl.load(k_ptr + slot[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptr + slot[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            visible = (j[None, :] < hi[:, None]) & (j[None, :] >= lo[:, None])
        else:
            j = (t - cached_tiles) * TILE + tl.arange(0, TILE)
            j_ok = j < own_len
            at = (own_row0 + j).to(tl.int64) * own_s0 + kvh * own_s1
            k = tl.load(own_k_ptr + at[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(own_v_ptr + at[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            visible = row_ok[:, None] & j_ok[None, :]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (row0 + r)[:, None] * o_s0 + h[:, None] * o_s1 + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_KERNEL = triton.jit(_paged_attention)


def key_tile(head_dim: int) -> int:
    """Keys per loop iteration: fewer for wide heads, whose K and V tiles fill the registers."""
    return 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16


def run_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                        positions: torch.Tensor, tiles: dict[str, torch.Tensor], scale: float, mode: int,
                        dllm_block: int = 1, window: int = 0, own_k: torch.Tensor | None = None,
                        own_v: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (last dim contiguous); caches [pages, page, KVH, D] contiguous; `page_tables` [S, width]
    int64 (rows indexed by `tiles["tile_seq"]`); `positions` [T]; `tiles` the plan's arrays as int64
    tensors -- in PASSES mode also `tile_kind`, `tile_lo`, `tile_own_row0` and `tile_own_len`, and
    `own_k` / `own_v` [T, KVH, D] the forward's K/V whose rows canvas tiles read. Returns [T, H, D];
    rows no tile covers are left as they were allocated (uninitialised)."""
    _, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    upcast = q.device.type == "cpu"
    seq = tiles["tile_seq"]
    passes = [tiles[name] for name in ("tile_kind", "tile_lo", "tile_own_row0", "tile_own_len")] if mode == PASSES \
        else [seq] * 4  # read only in PASSES mode
    own_k = k_cache if own_k is None else own_k
    own_v = v_cache if own_v is None else own_v
    _KERNEL[(seq.shape[0], kv_heads)](
        out, q, k_cache, v_cache, page_tables, positions,
        seq, tiles["tile_row0"], tiles["tile_rows"], tiles["tile_kv_len"], *passes, own_k, own_v,
        scale, page_tables.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), own_k.stride(0), own_k.stride(1),
        MODE=mode, DLLM_BLOCK=dllm_block, WINDOW=window, G=group, BLOCK_Q=block_q(group), PAGE=page,
        TILE=key_tile(head_dim), HEAD=head_dim, HEAD_P=triton.next_power_of_2(head_dim),
        IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast, num_warps=8 if head_dim >= 256 else 4)
    return out
