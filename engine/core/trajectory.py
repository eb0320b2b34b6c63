"""Scoring block-diffusion trajectories: the logprob of every output token of a rollout at the step
that revealed it, computed without regenerating.

The input of every denoising step is known from the rollout (docs/rollouts.md): the committed prompt
and earlier blocks as context, and the step's own block with the tokens revealed at earlier steps
visible and the mask id elsewhere. So a trajectory runs as

1. its *context* -- the prompt and every block before the last one, with their final tokens -- as an
   ordinary block-causal prefill into the request's own KV pages (prefix cache reused; these K/V are
   exactly the ones generation committed), then
2. one *view* per step: a query group of the B positions of that step's block, at their absolute
   positions, whose page table shares the context pages before the block and has private scratch
   pages for its own copy of the block. Views of every block and step are independent, so as many
   run in one forward as the prefill budget and the free pages allow. When a block does not start
   on a page boundary, the context part of its first page is copied into the view's scratch page
   (`kv_copy_src` / `kv_copy_dst`) before the forward.

The LM head runs only on the rows each view reveals -- one per output token -- through the runner's
scoring path (`score_rows`, in chunks of `logprobs_chunk_rows`), so memory never grows with views x
vocabulary. In processed modes the rows get the penalty and sampling filters the sampler applied at
that step (the repetition penalty over the tokens seen before the step, stop ids masked before
`min_new_tokens`, temperature / top-k / top-p / min-p).

engine.core.trajectory_plan checks a trajectory and lays out its context and views; this module puts
views into a forward, collects their rows and builds the request's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.carrier import OutputChunk
from engine.kv.page_manager import KVPageManager
from engine.kv.page_rows import StepTables
from engine.worker.forward_batch import ForwardBatch, ForwardOutput, RowFilter, RowPenalty

if TYPE_CHECKING:
    from engine.core.sequence import Sequence
    from engine.core.step_plan import ScheduledSeq
    from engine.core.trajectory_plan import TrajectoryState


# ---- one forward -----------------------------------------------------------------------------------
def add_view_rows(batch: ForwardBatch, tables: StepTables, it: ScheduledSeq, page_size: int,
                  view_fields: Callable[[ForwardBatch], None] | None = None) -> None:
    """Append the item's views to the batch: B query rows each at their absolute positions (a seed's
    view: one), a page table of the shared context pages before the block and the view's scratch
    pages, one score row per revealed output token; `view_fields` adds a view's pass fields."""
    seq = it.seq
    state: TrajectoryState = seq.trajectory
    params = state.params
    scratch = iter(state.scratch.pages)
    it.score_first = len(batch.score_rows)
    filtered: list[list[int]] = []  # [first row, count] of the runs of rows the sampling filters apply to
    for v in it.views:
        base, end = len(batch.input_ids), v.start + len(v.tokens)
        shared = v.start // page_size
        private = [next(scratch) for _ in range(v.scratch_pages)]
        table = seq.table.pages[:shared] + private
        batch.input_ids += v.tokens
        batch.q_lens.append(len(v.tokens))
        batch.kv_lens.append(end)
        if view_fields is not None:
            view_fields(batch)
        tables.add_pages(table)  # its rows' positions and slots follow (`batch.build_batch`)
        head = v.start % page_size  # context tokens sharing the block's first page
        if head:
            batch.kv_copy_src += [seq.table.pages[shared] * page_size + o for o in range(head)]
            batch.kv_copy_dst += [private[0] * page_size + o for o in range(head)]
        if state.processed:
            suppress = [g < params.min_new_tokens for g in v.outputs]
            if v.penalty_ids is not None or any(suppress):
                batch.score_penalties.append(RowPenalty(len(batch.score_rows), params.repetition_penalty,
                                                        v.penalty_ids or [], suppress, state.stop_ids))
        if not v.argmax:  # an argmax step's row was never filtered
            if filtered and sum(filtered[-1]) == len(batch.score_rows):
                filtered[-1][1] += len(v.rows)
            else:
                filtered.append([len(batch.score_rows), len(v.rows)])
        batch.score_rows += [base + r for r in v.rows]
        batch.score_targets += v.targets
    if state.processed and not params.is_greedy:
        batch.score_filters += [RowFilter(first, count, params) for first, count in filtered]
    batch.score_top_k = max(batch.score_top_k, params.logprobs or 0)
    batch.score_entropy |= state.entropy is not None


def take_view_rows(items: list[ScheduledSeq], result: ForwardOutput, kv: KVPageManager) -> None:
    """Record each view item's scored rows on its trajectory and give its scratch pages back."""
    for it in items:
        if it.views is None:
            continue
        state: TrajectoryState = it.seq.trajectory
        k = state.params.logprobs or 0
        i = it.score_first
        for v in it.views:
            for g, target in zip(v.outputs, v.targets):
                entry = {target: result.score_values[i]}
                if k:
                    for value, token in result.score_top[i][:k]:
                        entry.setdefault(token, value)
                state.entries[g] = entry
                if state.entropy is not None:
                    state.entropy[g] = result.score_entropy[i]
                i += 1
        state.done_views += len(it.views)
        kv.free(state.scratch)


def scoring_done(seq: Sequence) -> bool:
    """A scoring-only request (max_new_tokens=0) is done: a trajectory once every view came back,
    input-token scoring once its prompt is computed."""
    if seq.trajectory is not None:
        return seq.trajectory.done
    return seq.num_computed >= seq.prompt_len


# ---- output ----------------------------------------------------------------------------------------
class TrajectoryOutput:
    """The one chunk of a trajectory request: the rollout's tokens and step_map with the scored logprob
    of each (and the entropy on request), once every view is scored."""

    quiet = False  # `build` is asked every step (it answers None until the request finishes)

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        self.tokenizer = tokenizer

    def build(self, finished: bool, weight_version: str) -> OutputChunk | None:
        if not finished:
            return None
        seq, state = self.seq, self.seq.trajectory
        scored = state.done
        out = state.output_ids if scored else []
        skip = seq.params.skip_special_tokens
        return OutputChunk(
            request_id=seq.request_id,
            text=self.tokenizer.decode(out, skip_special_tokens=skip) if out else "",
            token_ids=list(out),
            step_map=list(state.step_map) if scored else [],
            logprobs=list(state.entries) if scored else [],
            entropy=list(state.entropy) if scored and state.entropy is not None else None,
            finish_reason=seq.finish_reason,
            input_token_len=seq.prompt_len,
            generate_token_len=len(out),
            num_steps=max(state.step_map) if scored else 0,
            weight_version=weight_version,
            weight_versions=[weight_version],
            queue_time_s=seq.admitted_at - seq.added_at if seq.admitted_at is not None else None,
        )
