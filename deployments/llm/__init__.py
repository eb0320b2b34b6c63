"""Ray Serve LLM's API (`ray.serve.llm`) for this engine: `build_openai_app` with `LLMConfig` /
`LLMServingArgs`, so a Ray Serve LLM YAML serves blockserve by changing its `import_path` to
`deployments.llm:build_openai_app`. docs/migrate.md lists what each field maps to.

The names are exported lazily: the ingress replicas import `deployments.llm.forwarding` and
`deployments.llm.router`, and must not load the builder's engine code with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deployments.llm.builder import build_openai_app
    from deployments.llm.config import LLMConfig, LLMServingArgs, ModelLoadingConfig

_EXPORTS = {"build_openai_app": "deployments.llm.builder", "LLMConfig": "deployments.llm.config",
            "LLMServingArgs": "deployments.llm.config", "ModelLoadingConfig": "deployments.llm.config"}

__all__ = ["LLMConfig", "LLMServingArgs", "ModelLoadingConfig", "build_openai_app"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deployments.llm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
