"""Input-token scoring bookkeeping: which rows of a forward score prompt tokens, and handing their
values to the request's output.

A request scoring from N (`logprob_start_len`) owes one row per prompt position N .. L-2: the
logits at position p score token p + 1. Rows are owed until the prefill has passed them, whatever
the chunking; the runner reduces each row to (value, top-k) in bounded chunks.
"""

from __future__ import annotations

from engine.core.step_plan import ScheduledSeq
from engine.worker.forward_batch import ForwardBatch, ForwardOutput


def _owed(it: ScheduledSeq) -> tuple[int, int]:
    seq = it.seq
    return max(it.start, seq.next_score_pos), min(it.end, seq.score_end)


def add_score_rows(batch: ForwardBatch, it: ScheduledSeq, base: int) -> None:
    """Ask the forward for the scoring rows this item's tokens owe (`base` = its first row)."""
    lo, hi = _owed(it)
    if lo < hi:
        seq = it.seq
        batch.score_rows += [base + p - it.start for p in range(lo, hi)]
        batch.score_targets += seq.tokens[lo + 1 : hi + 1]
        batch.score_top_k = max(batch.score_top_k, seq.params.logprobs or 0)


def take_score_rows(items: list[ScheduledSeq], batch: ForwardBatch, result: ForwardOutput, outputs: dict) -> None:
    """Hand each item's scoring rows to its output builder and mark them paid."""
    i = 0
    for it in items:
        lo, hi = _owed(it)
        if lo >= hi:
            continue
        seq, n = it.seq, hi - lo
        k = seq.params.logprobs or 0
        top = [row[:k] for row in result.score_top[i : i + n]] if k and result.score_top else None
        outputs[seq.request_id].add_input_rows(result.score_values[i : i + n], batch.score_targets[i : i + n], top)
        seq.next_score_pos = hi
        i += n
