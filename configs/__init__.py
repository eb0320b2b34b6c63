"""Pydantic configuration schemas shared by every layer (engine, ops, deployments)."""

from configs.engine_config import EngineConfig
from configs.generation_config import GenerationConfig

__all__ = ["EngineConfig", "GenerationConfig"]
