"""blockserve's engine: requests in, tokens (with step_map and logprobs) out, on one replica."""

from configs import EngineConfig, GenerationConfig
from engine.carrier import OutputChunk, Response
from engine.pipeline import Pipeline, pipeline

__all__ = ["EngineConfig", "GenerationConfig", "OutputChunk", "Pipeline", "Response", "pipeline"]
