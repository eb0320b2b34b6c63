"""Which masked positions of a DLLM block a denoising step reveals (CONTRACT.md §3)."""

from __future__ import annotations


def tokens_this_step(num_masked_at_block_start: int, steps: int, step_index: int) -> int:
    """n_s = M // S + (1 if s < M % S else 0)."""
    m, s = num_masked_at_block_start, steps
    return m // s + (1 if step_index < m % s else 0)


def choose_positions(
    strategy: str,
    masked: list[int],
    confidence: list[float],
    n: int,
    threshold: float,
) -> list[int]:
    """The masked positions to reveal, in ascending order.

    `masked` are the block's still-masked positions (ascending); `confidence[i]` belongs to
    `masked[i]`. At least one and at most len(masked) positions are chosen. Ties in confidence break
    toward the lower position.
    """
    n = max(1, min(n, len(masked)))
    if strategy == "sequential":
        return masked[:n]
    ranked = sorted(range(len(masked)), key=lambda i: (-confidence[i], masked[i]))
    if strategy == "low_confidence_dynamic":
        confident = [i for i in ranked if confidence[i] >= threshold]
        if len(confident) >= n:
            return sorted(masked[i] for i in confident)
    elif strategy != "low_confidence_static":
        raise ValueError(f"unknown dllm_unmasking_strategy {strategy!r}")
    return sorted(masked[i] for i in ranked[:n])
