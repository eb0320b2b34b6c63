"""Fault isolation: a step that raises is re-run one request at a time (K/V writes are idempotent and
sampling draws are counter-based, so a re-run reproduces exactly what that request would have got in
the batch); only the request(s) that still fail end, with an error naming their parameters. Held by
`LLMEngine` as `isolation`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from configs.knobs import request_knobs
from engine.carrier import OutputChunk
from engine.core.model_settings import EngineStats
from engine.core.sequence import Sequence
from engine.core.step_plan import ScheduledSeq

if TYPE_CHECKING:
    from engine.core.overlap import LaunchedForward

log = logging.getLogger(__name__)
T = TypeVar("T")

# Request fields that shape the sampling distribution (named when a request's step fails).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample", "random_seed",
                    "min_new_tokens", "stop_token_ids",
                    *(k.name for k in request_knobs() if k.name != "dllm_block_length"))


class FaultIsolation:
    """Runs a step's forward so that one request's failure ends that request only."""

    def __init__(self, seqs: dict[str, Sequence], stats: EngineStats,
                 forward: Callable[[list[ScheduledSeq]], LaunchedForward],
                 apply: Callable[[LaunchedForward], list[OutputChunk]],
                 fail: Callable[[str, str], OutputChunk | None]):
        """The engine's requests in flight and stats, and its steps: `forward` (run items' forward and
        sampling), `apply` (apply a forward) and `fail` (end a request with an error)."""
        self.seqs, self.stats = seqs, stats
        self._forward, self._apply, self._fail = forward, apply, fail

    def guarded(self, items: list[ScheduledSeq], run: Callable[[], T]) -> tuple[T | None, list[OutputChunk]]:
        """(run(), []); when it raises, (None, the chunks of re-running `items` one by one). A fatal
        executor error goes up."""
        try:
            return run(), []
        except Exception as e:  # noqa: BLE001 - isolated: see _isolate
            if getattr(e, "fatal", False):
                raise
            return None, self._isolate(items, e)

    def _isolate(self, items: list[ScheduledSeq], error: Exception) -> list[OutputChunk]:
        """Re-run each request of a failed step alone; end only those that fail alone."""
        log.warning("engine step over %d requests failed (%s: %s); re-running them one by one",
                    len(items), type(error).__name__, error)
        chunks: list[OutputChunk] = []
        for it in items:
            if it.seq.request_id not in self.seqs:
                continue
            try:
                fwd = self._forward([it])
            except Exception as e:  # noqa: BLE001 - this request's own failure
                if getattr(e, "fatal", False):
                    raise
                chunks += self.fail_alone(it.seq, e)
            else:
                chunks += self._apply(fwd)
        return chunks

    def fail_alone(self, seq: Sequence, error: Exception) -> list[OutputChunk]:
        """End `seq`, whose own step raised `error`, with an error message naming its sampling parameters."""
        log.error("request %s failed in its own step: %s: %s", seq.request_id, type(error).__name__, error)
        self.stats.isolated_failures += 1
        chunk = self._fail(seq.request_id, self._failure_message(seq, error))
        return [chunk] if chunk is not None else []

    @staticmethod
    def _failure_message(seq: Sequence, error: Exception) -> str:
        p = seq.params
        named = ", ".join(f"{f}={getattr(p, f)!r}" for f in _SAMPLING_FIELDS if f in p.model_fields_set)
        return (f"this request's step failed ({type(error).__name__}: {error}); its sampling parameters: "
                f"{named or 'defaults'}: change them and retry")
