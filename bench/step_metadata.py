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
- `upload_step_ms`: the whole upload (`upload_step`, with the `triton` backend's plan) of that batch.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_metadata", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096, 32768],
                        help="tokens each sequence holds, at most (about three quarters of it on average)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(json.dumps({"seqs": SEQS, "block": BLOCK, "page": PAGE,
                      "runs": [measure(n, args.repeats) for n in args.context]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
