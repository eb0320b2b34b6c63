"""The ingress <-> EngineServer protocol's types: each crosses a process boundary (pickle, as Ray
sends it) equal to itself, every field says what it holds, and a refusal survives the trip as the
same API error."""

from __future__ import annotations

import ast
import inspect
import pickle
from dataclasses import fields, is_dataclass

import pytest
from ray import cloudpickle

from configs import EngineConfig, GenerationConfig
from deployments import wire
from deployments.errors import ApiError
from deployments.generation import HTTP_RENAME, SamplingFields, engine_requests
from deployments.metrics import RequestMetrics
from deployments.wire import ControlAnswer, EngineRequest, MetricFamilies, ModelInfo, Rejection, ReplicaStats
from engine import answers
from engine.answers import ControlResult, EngineLoad, EngineSnapshot, ExecutorFacts, GraphFacts, TPFacts
from engine.carrier import OutputChunk, Response, _CarrierFields

CHUNK = OutputChunk(request_id="r", text="hi", token_ids=[5, 6], step_map=[1, 1], logprobs=[{5: -0.1, 7: -2.0}],
                    step_trace=[{"step": 1, "positions": [0, 1], "token_ids": [5, 6]}], finish_reason="stop",
                    matched=6, input_token_len=3, generate_token_len=2, num_steps=1, weight_version="v1",
                    weight_versions=["v1"])
SAMPLES = [
    EngineRequest(prompt=[1, 2, 3], params=GenerationConfig(max_new_tokens=4).model_dump(), request_id="r-0",
                  rename={"max_new_tokens": "max_tokens"}),
    CHUNK,
    Response.from_chunks([CHUNK]),
    Rejection("max_tokens: too many", "max_tokens", 400),
    Rejection("engine held", None, 503, "engine_held", retry_after_s=2.5),
    ModelInfo("/m", "sdar", ["SDARForCausalLM"], True, 4096, 2, 8192, EngineConfig(), 600.0, "block"),
    ControlAnswer(True, "weights staged", "replica-1", 0, ranks=[1, 2], weight_version="v2"),
    ReplicaStats("replica-1", 0, "sdar", 2, 4096, EngineSnapshot(
        EngineLoad(1, 2, 64, 40, 0, 12, 20, ExecutorFacts("ray_tp", "torch", GraphFacts("off", why="tp=2"),
                                                       TPFacts(1, ["tp-worker-1"], "ns", "gloo"))),
        10, 10, 30, 40, 20, 0.5, 0.6, "serving", "v2")),
    MetricFamilies("replica-1", RequestMetrics().families()),
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_every_wire_type_crosses_a_process_boundary_unchanged(obj):
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(obj))
        assert type(back) is type(obj) and back == obj


def test_the_request_params_arrive_with_the_fields_the_client_set():
    """A sampling field the client left unset stays unset on the engine's side (a rule that only
    decodes greedily takes an unset temperature as greedy); the ones it set, and those the endpoint
    sets itself, count as given (the engine names them when a request's step fails)."""
    unset = engine_requests("Hi", SamplingFields(), HTTP_RENAME, n=2, max_new_tokens=4)
    given = engine_requests("Hi", SamplingFields(temperature=0.7, top_k=5, seed=3), HTTP_RENAME, max_new_tokens=4)
    for req in (pickle.loads(pickle.dumps(r)) for r in unset):
        assert {"temperature", "top_k", "min_p", "stop_words"}.isdisjoint(req.params.model_fields_set)
        assert {"do_sample", "max_new_tokens", "n"} <= req.params.model_fields_set
        assert req.params.do_sample and req.params.temperature == 1.0  # the HTTP default still samples
    (req,) = (pickle.loads(pickle.dumps(r)) for r in given)
    assert {"do_sample", "temperature", "top_k", "random_seed", "max_new_tokens"} <= req.params.model_fields_set
    assert "min_p" not in req.params.model_fields_set
    assert (req.params.temperature, req.params.top_k, req.params.random_seed) == (0.7, 5, 3)


def test_a_rejection_is_the_same_api_error_on_both_sides():
    e = ApiError("the engine is held", None, 503, "engine_held", retry_after_s=1.5)
    back = ApiError.from_rejection(pickle.loads(pickle.dumps(e.to_rejection())))
    assert (back.message, back.param, back.status, back.type, back.retry_after_s) == (
        e.message, e.param, e.status, e.type, e.retry_after_s)
    assert back.to_dict() == e.to_dict()


def test_control_answer_of_the_engine_answer_keeps_what_the_ingress_reads():
    a = ControlAnswer.of(ControlResult("generation paused (abort)", requests=3), "rep", 1)
    assert (a.success, a.message, a.replica, a.rank, a.refused, a.requests) == (True, "generation paused (abort)",
                                                                                  "rep", 1, False, 3)
    joined = ControlAnswer.of(ControlResult("joined"), ranks=(3, 4))
    assert joined.ranks == [3, 4] and joined.weight_version is None
    refused = ControlAnswer.failure(ValueError("bad"))
    assert not refused.success and refused.refused and refused.message == "bad" and refused.rank is None
    failed = ControlAnswer.failure(RuntimeError("gone"), ranks=[1])
    assert not failed.success and not failed.refused and failed.message == "RuntimeError: gone"
    assert failed.ranks == [1]


def test_replica_stats_are_the_handle_apis_json():
    """`Ingress.engine_stats` answers each replica's stats as the flat JSON the handle API has always
    had: the engine's load and its executor's facts, its counters, then the replica's facts."""
    stats = next(s for s in SAMPLES if isinstance(s, ReplicaStats))
    assert stats.to_dict() == {
        "running": 1, "waiting": 2, "kv_pages_total": 64, "kv_pages_free": 40, "preemptions": 0,
        "prefix_hit_tokens": 12, "prefix_query_tokens": 20, "executor": "ray_tp", "attention_backend": "torch",
        "cuda_graphs": {"state": "off", "why": "tp=2"}, "tp_workers": 1, "tp_worker_names": ["tp-worker-1"],
        "tp_namespace": "ns", "tp_backend": "gloo", "steps": 10, "forwards": 10, "prompt_tokens": 30,
        "generated_tokens": 40, "unmasking_steps": 20, "forward_seconds": 0.5, "step_seconds": 0.6,
        "state": "serving", "weight_version": "v2", "replica": "replica-1", "rank": 0, "model_type": "sdar",
        "tp": 2, "max_model_len": 4096}
    local = {"executor": "local", "attention_backend": "torch",
             "cuda_graphs": {"state": "on", "captured": 3, "replays": 9}}
    load = {"running": 0, "waiting": 0, "kv_pages_total": 8, "kv_pages_free": 8, "preemptions": 0,
            "prefix_hit_tokens": 0, "prefix_query_tokens": 0} | local
    typed = EngineLoad(running=0, waiting=0, kv_pages_total=8, kv_pages_free=8, preemptions=0, prefix_hit_tokens=0,
                       prefix_query_tokens=0, executor=ExecutorFacts.of(local))
    assert typed.to_dict() == load  # the JSON keys LLMEngine.load() shows


def _undocumented_fields(cls: type) -> list[str]:
    """The fields of `cls` with no comment on their line or the line above."""
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(inspect.getsource(cls))
    missing = []
    for node in tree.body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own, above = lines[node.lineno - 1], lines[node.lineno - 2]
            end = lines[(node.end_lineno or node.lineno) - 1]
            if "#" not in own and "#" not in end and not above.strip().startswith("#"):
                missing.append(node.target.id)
    return missing


WIRE_TYPES = [c for c in vars(wire).values() if isinstance(c, type) and c.__module__ == wire.__name__
              and (is_dataclass(c) or hasattr(c, "model_fields"))]


ANSWER_TYPES = [c for c in vars(answers).values() if isinstance(c, type) and c.__module__ == answers.__name__]


@pytest.mark.parametrize("cls", [*WIRE_TYPES, *ANSWER_TYPES, _CarrierFields, Response], ids=lambda c: c.__name__)
def test_every_wire_field_says_what_it_holds(cls):
    names = [f.name for f in fields(cls)] if is_dataclass(cls) else list(cls.model_fields)
    assert names and _undocumented_fields(cls) == []


def test_the_field_check_sees_every_wire_type():
    assert {c.__name__ for c in WIRE_TYPES} == {"EngineRequest", "Rejection", "ModelInfo", "ControlAnswer",
                                                "ReplicaStats", "MetricFamilies"}
    assert {c.__name__ for c in ANSWER_TYPES} == {"ControlResult", "GraphFacts", "TPFacts", "ExecutorFacts",
                                                  "EngineLoad", "EngineSnapshot"}
