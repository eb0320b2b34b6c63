"""lmdeploy's offline API over this engine: a script written for `lmdeploy.pipeline` runs here by
changing its import line to `from engine.lmdeploy import pipeline, PytorchEngineConfig,
GenerationConfig`. The names, defaults and output fields are lmdeploy's; docs/migrate.md lists what
each maps to and the differences that remain."""

from engine.lmdeploy.configs import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig
from engine.lmdeploy.pipeline import Pipeline, Response, pipeline

__all__ = ["ChatTemplateConfig", "GenerationConfig", "Pipeline", "PytorchEngineConfig", "Response", "pipeline"]
