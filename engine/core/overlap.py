"""The overlap schedule: forwards launched on the device and not applied yet.

With `EngineConfig.overlap_schedule` a step launches the forward of at most half of the running
requests, then applies the forward the previous step launched, which the device ran meanwhile: the
host prepares one half's next step while the device computes the other's. The requests of a forward
in flight are neither scheduled nor preempted until it is applied, and anything that changes what a
forward ran on (weights, KV pages) or ends one of its requests lands every forward in flight first;
the chunks that applying one early made wait in `ready` for the next step (or for the request's end).

`LaunchedForward` is one forward either way: the plain schedule launches and reads it back at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.carrier import OutputChunk
from engine.core.decoding.base import PickedRows
from engine.core.sampler import PickedOnHost, RowGroup
from engine.core.step_plan import SampleSlice, ScheduledSeq
from engine.worker.forward_batch import ForwardBatch, ForwardOutput


@dataclass
class LaunchedForward:
    """One forward and its sampling: queued on the device at launch (on the CPU: done), its picks read
    back per sequence into `rows`; nothing is applied to the sequences until the engine applies it."""

    items: list[ScheduledSeq]
    batch: ForwardBatch
    result: ForwardOutput
    slices: list[SampleSlice]
    on_host: PickedOnHost | None = None  # None when no sequence samples in this forward
    groups: list[RowGroup] = field(default_factory=list)  # per slice: how the sampler treated its rows
    any_logits: bool = False  # whether a group asked for its rows' raw logits back
    ks: list[int | None] = field(default_factory=list)  # per sampled row: the logprobs asked for (when any)
    rows: list[PickedRows] = field(default_factory=list)  # per slice, once read back


# schedule(request ids not to schedule, most sequences) -> the items of the next forward
Schedule = Callable[[set[str], int], list[ScheduledSeq]]
# launch(items) -> (the launched forward, or None when it failed; the chunks of isolating its requests)
Launch = Callable[[list[ScheduledSeq]], tuple[LaunchedForward | None, list[OutputChunk]]]
# land(forward) -> the chunks of reading it back and applying it
Land = Callable[[LaunchedForward], list[OutputChunk]]


class OverlapSchedule:
    def __init__(self) -> None:
        self.in_flight: deque[LaunchedForward] = deque()  # at most one between steps
        self.ready: list[OutputChunk] = []  # made by landing a forward outside a step

    def request_ids(self) -> set[str]:
        """The requests of the forwards launched and not applied yet."""
        return {it.seq.request_id for fwd in self.in_flight for it in fwd.items}

    def take_ready(self) -> list[OutputChunk]:
        chunks, self.ready = self.ready, []
        return chunks

    def take_ready_of(self, request_id: str) -> list[OutputChunk]:
        """The ready chunks of one request, removed from the others'."""
        mine = [c for c in self.ready if c.request_id == request_id]
        if mine:
            self.ready = [c for c in self.ready if c.request_id != request_id]
        return mine

    def step(self, schedule: Schedule, launch: Launch, land: Land, max_seqs: int) -> tuple[list[OutputChunk], bool]:
        """Launch the next half, then land the previous forward; (chunks, whether anything ran)."""
        chunks: list[OutputChunk] = []
        items = schedule(self.request_ids(), max_seqs)
        launched = None
        if items:
            launched, failed = launch(items)
            chunks += failed
        previous = self.in_flight.popleft() if self.in_flight else None
        if launched is not None:  # in flight before the previous one lands, so a failure there cannot lose it
            self.in_flight.append(launched)
        if previous is not None:
            chunks += land(previous)
        return chunks, bool(items) or previous is not None

    def land_all(self, land: Land) -> None:
        """Apply every forward in flight now; their chunks go out with the next step."""
        while self.in_flight:
            self.ready += land(self.in_flight.popleft())
