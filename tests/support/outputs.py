"""Engine outputs of two runs that must agree (another attention backend, CUDA graphs or not): tokens, step
maps and finish reasons equal, logprobs within 1e-5."""

from __future__ import annotations

import torch


def as_pairs(rows: list) -> list[list[tuple[float, int]]]:
    """Input rows ((value, token)) and output entries ({token: value}) alike as [(value, token), ...]."""
    return [[(v, t) for t, v in e.items()] if isinstance(e, dict) else [e] for e in rows]


def assert_same_outputs(flex, torch_outs) -> None:
    for a, b in zip(flex, torch_outs, strict=True):
        assert (a.token_ids, a.step_map, a.finish_reason) == (b.token_ids, b.step_map, b.finish_reason)
        for rows_a, rows_b in ((a.input_token_logprobs, b.input_token_logprobs), (a.logprobs, b.logprobs)):
            if rows_b is None:
                assert rows_a is None
                continue
            flat, want = as_pairs(rows_a), as_pairs(rows_b)
            assert [[t for _, t in r] for r in flat] == [[t for _, t in r] for r in want]
            torch.testing.assert_close(torch.tensor([v for r in flat for v, _ in r]),
                                       torch.tensor([v for r in want for v, _ in r]), atol=1e-5, rtol=0)
