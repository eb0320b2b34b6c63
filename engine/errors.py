"""The errors callers of the engine handle, in a leaf module every layer may import.

Each is a refusal the caller can act on (the servers map them to HTTP statuses: RequestError,
CheckpointError and WeightUpdateError to 400, EngineHeldError to 503 with Retry-After,
EngineDeadError to 503).
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class CheckpointError(ValueError):
    """The checkpoint directory is missing something or holds something we cannot serve."""


class WeightUpdateError(ValueError):
    """An update was refused; no rank changed its weights."""


class EngineDeadError(RuntimeError):
    """The step loop is not running; the replica needs a restart."""


class EngineHeldError(RuntimeError):
    """A request waited `hold_timeout_s` while generation was paused or memory released; retry later."""

    def __init__(self, state: str, waited_s: float, retry_after_s: float):
        super().__init__(f"the engine is {state}: the request waited {waited_s:.1f}s without being served; "
                         f"retry in {retry_after_s:.0f}s")
        self.state, self.waited_s, self.retry_after_s = state, waited_s, retry_after_s
