"""JetEngine's offline API over this engine (the one TraceRL's rollouts use): a script written for
`from jetengine import LLM, SamplingParams` runs here by changing that import to
`from engine.jetengine import LLM, SamplingParams`. docs/migrate.md lists what each field maps to
and the differences that remain."""

from engine.jetengine.llm import LLM
from engine.jetengine.params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
