"""The batch kinds every attention backend is checked on: (tokens already cached, tokens fed now) per
sequence, autoregressive ones and block-diffusion ones (block length 4)."""

from __future__ import annotations

# (tokens already cached, tokens fed now) per sequence
AR_BATCHES = {
    "prefill": [(0, 40), (0, 7)],
    "prefill_chunk_and_decode": [(16, 24), (37, 1), (5, 1), (0, 3)],
    "decode": [(37, 1), (5, 1), (16, 1), (63, 1)],
    "scoring_rows": [(0, 50), (10, 33)],
}
DLLM_BATCHES = {  # block length 4
    "prefill_chunks": [(0, 32), (16, 16)],
    "denoising_steps": [(32, 4), (20, 4), (0, 4)],
    "commit_and_next_block": [(28, 8), (4, 8)],
    "mixed": [(16, 16), (28, 8), (40, 4), (0, 4)],
    "one_row_blocks": [(4, 1), (11, 1), (13, 2)],
}
