"""What an engine answers about itself, as typed plain data: what a control operation did
(`ControlResult`), what the engine holds now (`EngineLoad`, with its executor's `ExecutorFacts`) and
its stats (`EngineSnapshot`).

Light on purpose (built-in types only, nothing of the engine imported): the answers cross to the
ingress by pickle, and the ingress loads no engine code. `to_dict()` is each one's JSON shape, the
keys the handle API and /server_info have always shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ControlResult:
    """What one control operation did on an engine (a refusal raises instead)."""

    message: str  # what was done
    requests: int | None = None  # pause_generation, abort_all: the requests it ended, retracted or held
    released: list[str] | None = None  # release / resume_memory_occupation: the memory tags released after it
    weight_version: str | None = None  # weight updates: the version served after it


@dataclass(frozen=True)
class GraphFacts:
    """Whether a runner's forwards replay CUDA graphs."""

    state: str  # "on" or "off"
    captured: int | None = None  # on: the graphs captured
    replays: int | None = None  # on: the replays so far
    why: str | None = None  # off: why not

    @classmethod
    def of(cls, facts: Mapping[str, Any]) -> GraphFacts:
        """From the runner's report (`ModelRunner.describe()["cuda_graphs"]`)."""
        return cls(str(facts["state"]), facts.get("captured"), facts.get("replays"), facts.get("why"))

    def to_dict(self) -> dict[str, Any]:
        """The runner's shape: the fields of its state only."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TPFacts:
    """The tensor-parallel workers of a `ray_tp` executor (ranks 1..tp-1)."""

    workers: int  # how many worker actors
    worker_names: list[str]  # their Ray actor names
    namespace: str | None  # their Ray namespace
    backend: str | None  # the torch.distributed backend of the group (None: not initialized)

    def to_dict(self) -> dict[str, Any]:
        return {f"tp_{k}": v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ExecutorFacts:
    """How an engine's ranks run (its executor's `describe()`)."""

    executor: str  # "local" (tp=1, in-process) or "ray_tp"
    attention_backend: str | None  # the attention backend of the forwards
    cuda_graphs: GraphFacts | None  # whether they replay CUDA graphs
    tp: TPFacts | None = None  # ray_tp: its workers

    @classmethod
    def of(cls, facts: Mapping[str, Any]) -> ExecutorFacts:
        graphs = facts.get("cuda_graphs")
        tp = None
        if "tp_workers" in facts:
            tp = TPFacts(int(facts["tp_workers"]), list(facts.get("tp_worker_names", ())), facts.get("tp_namespace"),
                         facts.get("tp_backend"))
        return cls(str(facts["executor"]), facts.get("attention_backend"),
                   None if graphs is None else GraphFacts.of(graphs), tp)

    def forwards(self) -> dict[str, Any]:
        """How the forwards run (as /server_info's `internal_states` show it): the attention backend,
        and CUDA graphs on with their counts, or off and why."""
        return {"attention_backend": self.attention_backend,
                "cuda_graphs": None if self.cuda_graphs is None else self.cuda_graphs.to_dict()}

    def to_dict(self) -> dict[str, Any]:
        return {"executor": self.executor, **self.forwards(), **(self.tp.to_dict() if self.tp is not None else {})}


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds now (`LLMEngine.load()`)."""

    running: int  # requests being decoded
    waiting: int  # requests queued for admission
    kv_pages_total: int  # KV cache pages
    kv_pages_free: int  # free KV cache pages
    preemptions: int  # sequences preempted for KV space since start
    prefix_hit_tokens: int  # tokens found in the prefix cache since start, over every lookup
    prefix_query_tokens: int  # tokens looked up in the prefix cache since start (a preempted request again)
    executor: ExecutorFacts  # how its ranks run

    def to_dict(self) -> dict[str, Any]:
        counts = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "executor"}
        return counts | self.executor.to_dict()


@dataclass(frozen=True)
class EngineSnapshot:
    """An engine's stats at one moment (`AsyncEngine.stats()`): its load and its counters since start."""

    load: EngineLoad  # what it holds now
    steps: int  # engine steps
    forwards: int  # model forwards
    prompt_tokens: int  # prompt tokens admitted
    generated_tokens: int  # tokens generated (unmasked)
    unmasking_steps: int  # block diffusion: denoising steps
    forward_seconds: float  # time spent in model forwards
    step_seconds: float  # time spent in engine steps
    state: str  # "serving", "paused" or "released"
    weight_version: str  # the weights it serves

    def to_dict(self) -> dict[str, Any]:
        return self.load.to_dict() | {f.name: getattr(self, f.name) for f in fields(self) if f.name != "load"}
