"""blockserve's engine: requests in, tokens (with step_map and logprobs) out, on one replica.

The public names are exported lazily, so importing a light part of the package (the carrier types,
the errors, the configuration) never loads the model code, the runner or the kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from configs import EngineConfig, GenerationConfig
    from engine.carrier import OutputChunk, Response
    from engine.offline import Pipeline, pipeline

_EXPORTS = {
    "EngineConfig": "configs",
    "GenerationConfig": "configs",
    "OutputChunk": "engine.carrier",
    "Response": "engine.carrier",
    "Pipeline": "engine.offline",
    "pipeline": "engine.offline",
}

__all__ = ["EngineConfig", "GenerationConfig", "OutputChunk", "Pipeline", "Response", "pipeline"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
