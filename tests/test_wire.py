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
from deployments.wire import ControlAnswer, EngineRequest, ModelInfo, Rejection
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
]


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_every_wire_type_crosses_a_process_boundary_unchanged(obj):
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(obj))
        assert type(back) is type(obj) and back == obj


def test_the_request_params_arrive_with_every_field_given():
    """The engine names the given sampling fields when a request's step fails: every field of the
    requests the endpoints build counts as given, on the engine's side too."""
    reqs = engine_requests("Hi", SamplingFields(), HTTP_RENAME, n=2, max_new_tokens=4)
    for req in (pickle.loads(pickle.dumps(r)) for r in reqs):
        assert req.params.model_fields_set == set(GenerationConfig.model_fields)


def test_a_rejection_is_the_same_api_error_on_both_sides():
    e = ApiError("the engine is held", None, 503, "engine_held", retry_after_s=1.5)
    back = ApiError.from_rejection(pickle.loads(pickle.dumps(e.to_rejection())))
    assert (back.message, back.param, back.status, back.type, back.retry_after_s) == (
        e.message, e.param, e.status, e.type, e.retry_after_s)
    assert back.to_dict() == e.to_dict()


def test_control_answer_of_the_engine_answer_keeps_what_the_ingress_reads():
    a = ControlAnswer.of({"success": True, "message": "generation paused (abort)", "requests": 3}, "rep", 1)
    assert (a.success, a.message, a.replica, a.rank, a.refused, a.requests) == (True, "generation paused (abort)",
                                                                                  "rep", 1, False, 3)
    refused = ControlAnswer.of({"success": False, "message": "bad", "refused": True})
    assert not refused.success and refused.refused and refused.rank is None


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


@pytest.mark.parametrize("cls", [*WIRE_TYPES, _CarrierFields, Response], ids=lambda c: c.__name__)
def test_every_wire_field_says_what_it_holds(cls):
    names = [f.name for f in fields(cls)] if is_dataclass(cls) else list(cls.model_fields)
    assert names and _undocumented_fields(cls) == []


def test_the_field_check_sees_every_wire_type():
    assert {c.__name__ for c in WIRE_TYPES} == {"EngineRequest", "Rejection", "ModelInfo", "ControlAnswer"}
