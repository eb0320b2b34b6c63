"""The sampler's side of a step: how each sequence's rows are picked, and the picks cut per sequence.

`pick` asks the decoding strategy how the sampler treats each sequence's rows (`row_groups`), queues
the sampler on the forward's logits -- and the logprob values, when a row asks for them -- and their
copy to the host; `read` waits for that copy and cuts it into one `PickedRows` per sequence (a
strategy that samples its rows itself gets a reader of each sequence's raw logits rows instead).
Nothing here changes a sequence: applying the picks is the strategy's `apply`.
"""

from __future__ import annotations

from functools import partial

import torch

from engine.core.decoding.base import DecodingStrategy, PickedRows
from engine.core.logprobs import logprob_entries, logprob_values, token_logprobs
from engine.core.overlap import LaunchedForward
from engine.core.sampler import PickedOnHost, RowGroup, allowed_rows, pick_tokens
from engine.core.step_plan import SampleSlice


class StepSampling:
    def __init__(self, decoding: DecodingStrategy, logprobs_mode: str | None):
        """`logprobs_mode`: the engine's (`EngineConfig.logprobs_mode`): which values logprobs report."""
        self.decoding = decoding
        self.logprobs_mode = logprobs_mode

    def pick(self, fwd: LaunchedForward) -> None:
        """Queue the sampler on the forward's logits, and the copy of its picks to the host."""
        fwd.groups = groups = self.decoding.row_groups(fwd.slices)
        any_logprobs = any_logits = False
        for g in groups:
            any_logprobs = any_logprobs or g.params.logprobs is not None
            any_logits = any_logits or g.want_logits
        fwd.any_logits = any_logits
        processed = any_logprobs and self.logprobs_mode in ("processed_logprobs", "processed_logits")
        picked = pick_tokens(fwd.result.logits, [(sl.first, sl.end - sl.first, g) for sl, g in zip(fwd.slices, groups)],
                             self.decoding.needs_confidence, overwrite=not (any_logprobs or any_logits),
                             keep_processed=processed)
        logprobs = None
        if any_logprobs:  # computed on the device for every row, read back with the picks
            fwd.ks = [k for sl, g in zip(fwd.slices, groups) for k in [g.params.logprobs] * len(sl.positions)]
            values = picked.processed if processed else fwd.result.logits
            logprobs = logprob_values(values, picked.tokens, max(k for k in fwd.ks if k is not None),
                                      self.logprobs_mode, self._allowed_rows(fwd.slices, groups, values))
        fwd.on_host = PickedOnHost(picked, logprobs)

    @staticmethod
    def _allowed_rows(slices: list[SampleSlice], groups: list[RowGroup], values: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits rows with an allowed set and their `allowed_mask` (None: no row has one)."""
        sets: list[list[int] | None] = [None] * values.shape[0]
        for sl, g in zip(slices, groups):
            if g.allowed is not None:
                sets[sl.first: sl.end] = g.allowed
        return allowed_rows(values, sets)

    def read(self, fwd: LaunchedForward) -> LaunchedForward:
        """Wait for the picks on the host and cut them per sequence (a strategy that samples its rows
        itself gets each sequence's raw logits rows)."""
        if self.decoding.samples_logits:
            logits = fwd.result.logits
            fwd.rows = [PickedRows(sl.positions, [], [], None, []) for sl in fwd.slices]
            for rows, sl in zip(fwd.rows, fwd.slices):
                rows.read_logits = partial(logits.__getitem__, slice(sl.first, sl.end))
            return fwd
        if fwd.on_host is None:
            return fwd
        tokens, confidence, entropy = fwd.on_host.lists()
        chosen_v, top_v, top_i = fwd.on_host.logprob_lists()
        entries: list[dict | None] = [None] * len(tokens)
        if chosen_v is not None:
            entries = logprob_entries(tokens, fwd.ks, chosen_v, top_v, top_i)
        fwd.rows = [PickedRows(sl.positions, tokens[sl.first: sl.end], confidence[sl.first: sl.end],
                               entropy[sl.first: sl.end] if entropy is not None else None, entries[sl.first: sl.end])
                    for sl in fwd.slices]
        mass = fwd.on_host.label_mass()
        if mass is not None or fwd.any_logits:
            for rows, sl, group in zip(fwd.rows, fwd.slices, fwd.groups):
                if mass is not None and group.allowed is not None:
                    rows.label_mass = mass[sl.first: sl.end]
                if group.want_logits:
                    rows.logits = fwd.result.logits[sl.first: sl.end]
                    rows.logprob_of = partial(token_logprobs, rows.logits, k=group.params.logprobs,
                                              mode=self.logprobs_mode)
        return fwd
