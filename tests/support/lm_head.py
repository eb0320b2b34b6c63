"""A probe on the real model of an offline pipeline: the rows each LM-head call projects (scoring tests
check that only the rows they need are projected)."""

from __future__ import annotations


def record_lm_head_rows(pipe) -> list[int]:
    """Wrap the real model's `logits` (no mock) to record how many rows each call projects."""
    model = pipe.engine.executor.runner.model
    rows: list[int] = []
    real = model.logits

    def logits(hidden):
        rows.append(hidden.shape[0])
        return real(hidden)

    model.logits = logits
    return rows
