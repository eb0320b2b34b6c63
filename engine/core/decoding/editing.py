"""Token-editing rules: a step may write masked positions (reveals) AND rewrite revealed ones (edits).

An editing rule sees every generated position of the current block, in ascending order, as columns:
`tokens` (what the position holds now: a token or the mask id), `candidates` and `confidence` (the
sampler's pick at that position and its probability under the distribution it drew from),
`masked` (whether the position holds the mask id), and the block's post-edit count so far. It
returns the indices to write this step, ascending, or None when the block ends (nothing is written then).

`joint_threshold` is SGLang's JointThreshold (LLaDA2.1), with t = `confidence_threshold`,
e = `edit_threshold`, m = `max_post_edit_steps`:

- while masks remain: reveal every masked position with p > t, else the single most confident one
  (ties: the lower position);
- when none remains: the block's post-edit count rises by one; past m the block ends;
- in both cases: edit every revealed position whose candidate differs from its token with p > e;
- a step that writes nothing ends the block.

A block whose last mask is gone and whose budget is spent (`budget_spent`) can only end at its next
step, whatever that step sees: the engine ends it with the writes of the step that spent the budget,
without that forward.

The λ penalty (`penalty_lambda`) lowers, at every position but the block's first, the logit of the
token at the position before it; it is applied to the logits before the sampler picks (see
`engine.core.sampler`), so the candidates and confidences here already include it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.decoding.unmasking import UnmaskingSettings, above_threshold_or_best


@dataclass
class BlockRows:
    """The current block's generated positions as columns (one entry per position, ascending)."""

    tokens: list[int]
    candidates: list[int]
    confidence: list[float]
    masked: list[bool]


def joint_threshold(rows: BlockRows, post_edit_steps: int, settings: UnmaskingSettings) -> list[int] | None:
    """The indices to write this step (ascending), or None when the block ends. `post_edit_steps` is the
    block's count including this step when no mask remains (the caller raises it first)."""
    masked = [i for i, m in enumerate(rows.masked) if m]
    if masked:
        t = settings.confidence_threshold
        reveals = [masked[j] for j in above_threshold_or_best([rows.confidence[i] for i in masked], t)]
    elif post_edit_steps > settings.max_post_edit_steps:
        return None
    else:
        reveals = []
    e = settings.edit_threshold
    edits = [i for i, m in enumerate(rows.masked)
             if not m and rows.candidates[i] != rows.tokens[i] and rows.confidence[i] > e]
    writes = sorted(reveals + edits)
    return writes or None


def budget_spent(post_edit_steps: int, settings: UnmaskingSettings) -> bool:
    """Whether a block without masks, after `post_edit_steps` post-edit steps, ends at its next step
    writing nothing: that step would exceed `max_post_edit_steps`."""
    return post_edit_steps >= settings.max_post_edit_steps
