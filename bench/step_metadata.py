"""`python -m bench.step_metadata`: host time of a step's metadata, against the context its sequences hold.

Before every forward the host assembles the step's metadata: padding to a CUDA graph's token bucket,
the attention backend's plan, the page tables, one packed tensor (engine.worker.step_upload). The
page tables are the only part that grows with the context: 128 sequences of 32k tokens hold 2,048
pages each. This bench times, for 128 sequences of which ~30 % carry a commit fused with the next
block (block 4), at several contexts:

- `tables_ms`: the step's page-table array gathered from the page manager's persistent rows
  (`engine.kv.page_rows`: `StepTables`, what `build_batch` does), against `baseline_lists_ms`, the
  same array packed from each sequence's page list (`array.fromlist` a table at a time, padded with
  page 0: what every step did before the rows);
- `upload_step_ms`: the whole upload (`upload_step`, with the `triton` backend's plan) of that batch;
- `gemma_prepare_ms`: DiffusionGemma's per-forward attention metadata (`GemmaAttentionMeta.prepare`,
  the torch backend) for 32 canvases of 256 positions over that context (sliding window 1,024, the
  release's), whose committed keys' cache slots are worked out a page at a time, against
  `gemma_baseline_slot_by_slot_ms`, the same slots one position at a time (what it did before).

Prints one JSON object: per context, milliseconds per step (median of `--repeats`) and the table
entries uploaded. Runs on the CPU (the host side is what it measures; the copy is a CPU tensor here).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array
from collections.abc import Callable

import torch

from engine.kv.page_rows import PageRows, StepTables
from engine.model.families.diffusion_gemma.attention import (
    CANVAS,
    FREED,
    GemmaAttentionMeta,
    GemmaPass,
    GemmaTorchAttention,
)
from engine.model.families.diffusion_gemma.config import FULL, SLIDING
from engine.worker.forward_batch import ForwardBatch
from engine.worker.step_upload import GraphPadding, StepUploader, upload_step
from ops.attention.triton_backend import TritonAttention

PAGE, BLOCK, SEQS = 16, 4, 128


def step_shapes(seqs: int, context: int, seed: int = 0) -> tuple[list[int], list[int], list[list[int]]]:
    """q_lens, kv_lens and page lists of `seqs` sequences denoising one block of BLOCK rows (30 % a commit
    + next block: 2 x BLOCK), each holding about `context` keys in pages handed out at random."""
    rng = random.Random(seed)
    q_lens = [2 * BLOCK if rng.random() < 0.3 else BLOCK for _ in range(seqs)]
    kv_lens = [(rng.randrange(context // 2, context) // BLOCK) * BLOCK + q for q in q_lens]
    pages = list(range(sum(-(-kv // PAGE) for kv in kv_lens) + 8))
    rng.shuffle(pages)
    return q_lens, kv_lens, [[pages.pop() for _ in range(-(-kv // PAGE))] for kv in kv_lens]


def list_tables(tables: list[list[int]], width: int) -> array:
    """The baseline: the tables packed from their lists, each padded with page 0 to `width`."""
    out, zeros = array("q"), [0] * width
    for table in tables:
        out.fromlist(table)
        out.fromlist(zeros[len(table):])
    return out


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(context: int, repeats: int) -> dict:
    q_lens, kv_lens, lists = step_shapes(SEQS, context)
    store = PageRows()
    rows = []
    for pages in lists:  # the page manager writes a table's row as its pages come
        row = store.take()
        store.write(row, 0, pages)
        rows.append(row)

    def gathered() -> object:
        tables = StepTables(store)
        tables.rows += rows
        return tables.array(-(-max(kv_lens) // PAGE))

    width = -(-max(kv_lens) // PAGE)
    assert gathered().ravel().tolist() == list(list_tables(lists, width))
    positions = [p for q, kv in zip(q_lens, kv_lens, strict=True) for p in range(kv - q, kv)]
    slots = [t[p // PAGE] * PAGE + p % PAGE for t, q, kv in zip(lists, q_lens, kv_lens, strict=True)
             for p in range(kv - q, kv)]
    batch = ForwardBatch(input_ids=[1] * len(positions), positions=positions, q_lens=q_lens, kv_lens=kv_lens,
                         slot_mapping=slots, page_tables=gathered(), sample_rows=list(range(len(positions))))
    backend = TritonAttention(query_group=4)  # SDAR-4B: 32 query heads over 8 K/V heads
    bucket = next(b for b in (256, 384, 512, 768, 1024) if b >= len(positions))
    padding = GraphPadding(bucket, SEQS + 1, null_page=0)
    uploader, cpu = StepUploader(), torch.device("cpu")
    return {"context": context, "tokens": len(positions), "bucket": bucket, "table_entries": SEQS * width,
            "tables_ms": round(median_ms(gathered, repeats), 3),
            "baseline_lists_ms": round(median_ms(lambda: list_tables(lists, width), repeats), 3),
            "upload_step_ms": round(median_ms(lambda: upload_step(batch, backend, uploader, cpu, PAGE, BLOCK, padding),
                                              repeats), 3)}


def gemma_passes(context: int, canvases: int = 32, canvas: int = 256, window: int = 1024) -> list[GemmaPass]:
    """`canvases` canvas passes over `context` committed tokens: each group's pages laid out one pass after
    another, a sliding group's pages before its window freed."""
    pages = -(-(context + canvas) // PAGE)
    live = max(0, context - (window - 1)) // PAGE  # the sliding group's first page still held
    tables = [{FULL: list(range(s * pages, (s + 1) * pages)),
               SLIDING: [FREED] * live + list(range(s * pages + live, (s + 1) * pages))} for s in range(canvases)]
    return [GemmaPass(CANVAS, context, canvas, t) for t in tables]


def slot_by_slot(passes: list[GemmaPass], window: int) -> list[list[int]]:
    """The baseline: every committed key's slot of every pass and group, a position at a time."""
    out = []
    for kind in (SLIDING, FULL):
        for p in passes:
            table, lo = p.page_tables[kind], 0 if kind == FULL else max(0, p.start - (window - 1))
            out.append([table[pos // PAGE] * PAGE + pos % PAGE for pos in range(lo, p.start)])
    return out


def measure_gemma(context: int, repeats: int, window: int = 1024) -> dict:
    passes = gemma_passes(context, window=window)

    def prepare() -> GemmaAttentionMeta:
        meta = GemmaAttentionMeta(passes, PAGE, window, torch.device("cpu"), GemmaTorchAttention())
        meta.prepare()
        return meta

    meta = prepare()
    assert [s.tolist() for kind in (SLIDING, FULL) for s in meta.groups[kind].committed] == slot_by_slot(passes, window)
    return {"gemma_prepare_ms": round(median_ms(prepare, repeats), 3),
            "gemma_baseline_slot_by_slot_ms": round(median_ms(lambda: slot_by_slot(passes, window), repeats), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_metadata", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096, 32768],
                        help="tokens each sequence holds, at most (about three quarters of it on average)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(json.dumps({"seqs": SEQS, "block": BLOCK, "page": PAGE,
                      "runs": [measure(n, args.repeats) | measure_gemma(n, args.repeats) for n in args.context]},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
