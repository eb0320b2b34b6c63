"""`python -m bench.step_metadata`: host time of a graphed step's metadata, against `max_model_len`.

A step that replays a CUDA graph first assembles its metadata on the host: padding to the token bucket,
the attention backend's plan, the page tables flattened, one packed tensor (engine.worker.step_upload).
This bench times exactly that (`upload_step`, with the `triton` backend's plan) for 128 sequences of
which ~30 % carry a commit fused with the next block (block 4), at several `max_model_len`, beside the
baseline the previous graph path paid: every page table padded through a Python list to the graph's
full width, `(max_model_len + 64) / page` columns. Prints one JSON object: per `max_model_len`,
milliseconds per step for both (median of `--repeats`), and the elements each uploads.

Runs on the CPU (the host side is what it measures; the copy itself is a CPU tensor here).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.worker.forward_batch import ForwardBatch
from engine.worker.step_upload import GraphPadding, StepUploader, upload_step
from ops.attention.triton_backend import TritonAttention

PAGE, BLOCK, SEQS = 16, 4, 128


def step_batch(seqs: int, context: int, seed: int = 0) -> ForwardBatch:
    """`seqs` sequences denoising one block of BLOCK rows (30 % a commit + next block: 2 x BLOCK), each
    holding about `context` keys in pages handed out at random."""
    rng = random.Random(seed)
    q_lens = [2 * BLOCK if rng.random() < 0.3 else BLOCK for _ in range(seqs)]
    kv_lens = [(rng.randrange(context // 2, context) // BLOCK) * BLOCK + q for q in q_lens]
    pages = list(range(sum(-(-kv // PAGE) for kv in kv_lens) + 8))
    rng.shuffle(pages)
    tables = [[pages.pop() for _ in range(-(-kv // PAGE))] for kv in kv_lens]
    positions = [p for q, kv in zip(q_lens, kv_lens) for p in range(kv - q, kv)]
    slots = [t[p // PAGE] * PAGE + p % PAGE for t, q, kv in zip(tables, q_lens, kv_lens) for p in range(kv - q, kv)]
    sample = list(range(len(positions)))
    return ForwardBatch(input_ids=[1] * len(positions), positions=positions, q_lens=q_lens, kv_lens=kv_lens,
                        slot_mapping=slots, page_tables=tables, sample_rows=sample)


def padded_tables(batch: ForwardBatch, width: int) -> list[int]:
    """The baseline: every table padded to the graph's full width through a Python list."""
    return [p for t in batch.page_tables for p in t + [0] * (width - len(t))]


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(max_model_len: int, repeats: int, context: int = 512) -> dict:
    batch = step_batch(SEQS, context)  # the same batch at every max_model_len
    backend = TritonAttention(query_group=4)  # SDAR-4B: 32 query heads over 8 K/V heads
    tokens = len(batch.input_ids)
    bucket = next(b for b in (256, 384, 512, 768, 1024) if b >= tokens)
    padding = GraphPadding(bucket, SEQS + 1, null_page=0)
    uploader, cpu = StepUploader(), torch.device("cpu")
    sizes: list[int] = []
    upload = uploader.upload

    def counted(fields, device):
        sizes.append(sum(len(v) for v in fields.values()))
        return upload(fields, device)

    uploader.upload = counted
    now = median_ms(lambda: upload_step(batch, backend, uploader, cpu, PAGE, BLOCK, padding), repeats)
    width = -(-(max_model_len + 64) // PAGE)
    baseline = median_ms(lambda: torch.tensor(padded_tables(batch, width), dtype=torch.long), repeats)
    return {"max_model_len": max_model_len, "tokens": tokens, "bucket": bucket,
            "upload_step_ms": round(now, 3), "uploaded_elements": sizes[-1],
            "baseline_padded_tables_ms": round(baseline, 3), "baseline_table_elements": (SEQS * width)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_metadata", description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(json.dumps({"seqs": SEQS, "block": BLOCK, "page": PAGE,
                      "runs": [measure(n, args.repeats) for n in args.max_model_len]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
