"""Linear self-speculation (`dllm_mode='linear_spec'`, `engine.core.decoding.seeded_block`): draft passes
fill a block's masks over the causal prefix, then one causal verify forward accepts the drafts that the
autoregressive tokens of its rows confirm, plus one bonus token, the next block's seed. Every emitted
token is an autoregressive token, so greedy output equals `ar`'s."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.decoding.base import PickedRows
from engine.core.sequence import Sequence

#: (the sequence, the processed rows, the raw rows, row indices, tokens) -> the tokens' logprob entries
Logprobs = Callable[[Sequence, torch.Tensor, torch.Tensor, list[int], list[int]], list[dict | None]]


class LinearSpeculation:
    """The draft and verify forwards of a speculating request (its `SeededState` says which is next)."""

    def __init__(self, block_length: int, mask_id: int, logprobs: Logprobs):
        self.block_length, self.mask_id = block_length, mask_id
        self.logprobs = logprobs

    def draft(self, seq: Sequence, rows: PickedRows) -> None:
        """One draft pass over the block's rows: fill every mask (threshold 0), or the most confident and
        every other at least the threshold confident; the block is verified once no mask is left (or
        after B passes, a mask id drawn as a draft being no mask to fill)."""
        state = seq.state
        tokens, probs = state.draw(rows.logits.float())
        picks = tokens.tolist()
        offsets = [p - state.start for p in state.masked]
        if state.threshold:
            confidence = {j: float(probs[j, picks[j]]) for j in offsets}
            chosen = [j for j in offsets if confidence[j] >= state.threshold] or [max(offsets, key=confidence.get)]
        else:
            chosen = offsets
        for j in chosen:
            seq.tokens[state.start + j] = picks[j]
        state.passes += 1
        state.masked = [p for p in state.masked if seq.tokens[p] == self.mask_id]
        state.verifying = not state.threshold or not state.masked or state.passes >= self.block_length

    def verify(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """Accept the drafts the autoregressive tokens of the block's rows confirm, plus the bonus token;
        the K/V stay final up to the last accepted draft and the next block opens with the bonus."""
        state, b, start = seq.state, self.block_length, seq.state.start
        logits = rows.logits.float()
        ar = state.draw(logits)[0].tolist()
        accepted = 1
        while accepted < b and ar[accepted - 1] == seq.tokens[start + accepted]:
            accepted += 1
        seq.step_counter += 1
        state.speculation.acceptance.append(accepted)
        emitted = ar[:accepted]
        g = start + 1 - seq.prompt_len  # the first emitted token's generated index
        del seq.tokens[start + 1:], seq.out_steps[g:], seq.out_block_steps[g:], seq.out_logprobs[g:]
        seq.tokens += emitted
        seq.out_steps += [seq.step_counter] * accepted
        seq.out_block_steps += [state.passes + 2] * accepted  # as a pass's: the drafts, then the verify
        seq.out_logprobs += self.logprobs(seq, logits, logits, list(range(accepted)), emitted)
        seq.num_computed = start + accepted  # the seed and the accepted drafts were fed as themselves
        self.open_draft(seq, start + accepted)
        return list(range(g, g + accepted))

    def open_draft(self, seq: Sequence, start: int) -> None:
        """The next block to draft: [the seed at `start`, MASK x (B-1)]."""
        state, n = seq.state, self.block_length - 1
        seq.append_positions([self.mask_id] * n)
        state.start, state.verifying, state.passes = start, False, 0
        state.masked = list(range(start + 1, start + 1 + n))
