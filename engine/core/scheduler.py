"""Continuous batching: which sequences run in the next forward, and how many of their tokens.

Every step takes running sequences first (AR decode rows, DLLM denoising blocks), then admits
waiting ones (prefill, chunked under `max_prefill_token_num`). What a sequence feeds next comes
from its decoding strategy; a chunk ends on a multiple of the strategy's `chunk_alignment` (a
block-diffusion query sees every key of its own block). A waiting sequence whose prompt another
running sequence is still prefilling waits for it (its prompt then comes from the prefix cache:
the n samples of one prompt compute the prompt once). When KV pages run out, the
newest running sequence is preempted: its pages are freed and it is recomputed later from its
tokens, which reproduces exactly the state it had.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from configs import EngineConfig
from engine.core.decoding.base import DecodingStrategy
from engine.core.sequence import SeqStatus, Sequence
from engine.core.step_plan import Feed, ScheduledSeq
from engine.kv.page_manager import KVPageManager

_UNLIMITED = 1 << 62


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVPageManager, decoding: DecodingStrategy):
        self.config = config
        self.kv = kv
        self.decoding = decoding
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # prompt -> (the running sequence computing it, how far its prefix-cacheable part reaches)
        self._prefilling: dict[tuple[int, ...], tuple[Sequence, int]] = {}
        self._busy: set[str] | frozenset[str] = frozenset()  # this step's requests in a forward in flight

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.table)
        if seq.trajectory is not None:
            self.kv.free(seq.trajectory.scratch)
        key = tuple(seq.prompt_ids)
        if self._prefilling.get(key, (None,))[0] is seq:
            del self._prefilling[key]

    def _waits_for_shared_prompt(self, seq: Sequence) -> bool:
        """Another running sequence is computing this prompt's cacheable prefix right now."""
        if not self.kv.enable_prefix_caching:
            return False
        key = tuple(seq.prompt_ids)
        leader, target = self._prefilling.get(key, (None, 0))
        if leader is None:
            return False
        if leader.status is SeqStatus.RUNNING and leader.num_computed < target:
            return True
        del self._prefilling[key]
        return False

    def _plan_feeds(self, seqs: list[Sequence]) -> list[Feed]:
        """Per sequence its next forward (`step_plan.Feed`): the strategy's plan, or a trajectory's
        context prefill (its views come after)."""
        if not [seq for seq in seqs if seq.trajectory is not None]:  # a comprehension: one call a step
            return self.decoding.plan_feeds(seqs)
        planned = iter(self.decoding.plan_feeds([seq for seq in seqs if seq.trajectory is None]))
        return [(seq.trajectory.context_len, False, False, 0) if seq.trajectory is not None else next(planned)
                for seq in seqs]

    def _cacheable(self, seq: Sequence) -> int:
        if seq.trajectory is not None:  # its whole context is committed tokens
            return seq.trajectory.context_len
        return self.decoding.cacheable_prefix(seq)

    def _chunk_end(self, seq: Sequence, target: int, budget: int) -> int | None:
        start = seq.num_computed
        if target - start <= budget:
            return target
        end = start + budget
        end -= end % self.decoding.chunk_alignment
        return end if end > start else None

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self, busy: set[str] | frozenset[str] = frozenset(), max_seqs: int | None = None
                 ) -> list[ScheduledSeq]:
        """The next forward's items. `busy`: running requests whose previous forward is still in
        flight (overlap scheduling): they are neither scheduled nor preempted. At most `max_seqs`
        sequences (None: no limit besides the batch size and the prefill budget)."""
        budget = self.config.max_prefill_token_num
        limit = _UNLIMITED if max_seqs is None else max_seqs
        self._busy = busy
        out: list[ScheduledSeq] = []
        page_size = self.kv.page_size
        candidates = [seq for seq in self.running if seq.request_id not in busy]
        for seq, feed in zip(candidates, self._plan_feeds(candidates)):
            target, sample, decoding, kv_final = feed
            if max_seqs is not None and len(out) >= max_seqs:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted by an earlier one of this loop
                continue
            if decoding and seq.table.holds(target, page_size):  # the common step: nothing to allocate
                out.append(ScheduledSeq(seq, seq.num_computed, target, sample, True, kv_final))  # decoding
                continue
            item = self._try_schedule(seq, _UNLIMITED if decoding else budget, out, first=not out, feed=feed)
            if item is None:
                continue  # could not place it this step (it keeps its pages), or it was preempted
            item.decoding = decoding
            out.append(item)
            if not decoding:
                budget -= item.num_rows
        held: list[Sequence] = []
        while self.waiting and len(self.running) < self.config.max_batch_size and budget > 0 and len(out) < limit:
            seq = self.waiting[0]
            if self._waits_for_shared_prompt(seq):
                held.append(self.waiting.popleft())
                continue
            cacheable = self._cacheable(seq)
            seq.num_computed = self.kv.match_prefix(seq.table, seq.tokens, cacheable)
            item = self._try_schedule(seq, budget, out, first=not out, admitting=True)
            if item is None:  # wait without sitting on cached pages others may need
                self.kv.undo_match(seq.table, seq.num_computed, cacheable)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.admitted_at is None:
                seq.admitted_at = time.monotonic()
            self.running.append(seq)
            out.append(item)
            budget -= item.num_rows
            if self.kv.enable_prefix_caching and seq.num_computed < cacheable:
                self._prefilling.setdefault(tuple(seq.prompt_ids), (seq, cacheable))
        self.waiting.extendleft(reversed(held))
        return out

    def _try_schedule(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq],
                      first: bool, admitting: bool = False, feed: Feed | None = None) -> ScheduledSeq | None:
        """`feed`: the sequence's plan when the step already has it."""
        if seq.trajectory is not None and seq.num_computed >= seq.trajectory.context_len:
            return self._schedule_views(seq, budget, scheduled, first, admitting)
        target, sample, _, kv_final = feed or self._plan_feeds([seq])[0]
        end = self._chunk_end(seq, target, budget if not first else max(budget, self.decoding.chunk_alignment))
        if end is None:
            return None
        if not self._make_room(seq, scheduled, admitting, lambda: self.kv.allocate(seq.table, end)):
            return None
        return ScheduledSeq(seq, seq.num_computed, end, sample and end == target, kv_final=kv_final)

    def _schedule_views(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq], first: bool,
                        admitting: bool) -> ScheduledSeq | None:
        """The next views of a trajectory whose context is computed: as many as the budget's rows
        allow (at least one when the forward is empty) and whose scratch pages fit (fewer when they
        do not; preempting the newest others when not even one does)."""
        state = seq.trajectory
        count = min(max(budget // self.decoding.chunk_alignment, int(first)), len(state.views) - state.next_view)
        if count <= 0:
            return None
        def reserve() -> bool:
            nonlocal count
            while not state.reserve(self.kv, count):
                if count == 1:
                    return False
                count //= 2
            return True

        if not self._make_room(seq, scheduled, admitting, reserve):
            return None
        return ScheduledSeq(seq, seq.num_computed, seq.num_computed, False, views=state.take(count))

    def _make_room(self, seq: Sequence, scheduled: list[ScheduledSeq], admitting: bool,
                   fits: Callable[[], bool]) -> bool:
        """Call `fits` (which takes the pages `seq` needs) until it succeeds, preempting the newest
        running sequence not yet in this step each time it fails (`seq` itself when none is left,
        unless a newer one is in a forward in flight: that one gives way once it is applied, so `seq`
        keeps its pages and waits a step). False when `seq` cannot run this step; a sequence being
        admitted preempts nobody."""
        while not fits():
            if admitting:
                return False
            taken = self._busy | {s.seq.request_id for s in scheduled}
            victims = [s for s in self.running if s.request_id not in taken and s is not seq]
            if victims:
                self._preempt(victims[-1])
                continue
            newer = self.running[self.running.index(seq) + 1:]
            if not any(s.request_id in self._busy for s in newer):
                self._preempt(seq)
            return False
        return True

    def retract_all(self) -> int:
        """Preempt every running sequence (newest first, so they wait in their running order ahead
        of the others): pages freed, tokens kept, K/V recomputed when they are scheduled again.
        Returns how many were retracted."""
        retracted = list(self.running)
        for seq in reversed(retracted):
            self._preempt(seq)
        return len(retracted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
