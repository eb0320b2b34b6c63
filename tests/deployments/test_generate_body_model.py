"""`/generate` and the model a request names. On an application of several models (deployments.llm)
the flat body with `model` (what that application's 400 asks a request without one to add) is
answered by the model it names. SGLang's native body names a schema error inside `sampling_params`
by its whole path (`sampling_params.max_new_tokens`). A one-model application answers a request
that names another model, as SGLang's /generate ignores `model`, and its answer's `meta_info` says
which model was named and which one served."""

from __future__ import annotations

import re

import httpx
import pytest

from deployments.errors import ApiError
from deployments.sglang.serving import generate_body, generate_plan
from engine.carrier import Response
from tests.support.http import sse_events

TIMEOUT = 120
IDS = [40, 41, 42, 43, 44, 45, 46]
FLAT = {"input_ids": IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
MODELS = ("sdar-tiny", "qwen3-tiny")  # the shipped Ray Serve LLM config's


# ---- the request models (no Ray) -------------------------------------------------------------------
def _params(plan) -> list[tuple]:
    return [(r.prompt, r.params) for group in plan.groups for r in group]


@pytest.mark.parametrize("body", [
    {"prompt": "23+58=", "max_tokens": 4, "temperature": 0},
    {"input_ids": IDS, "max_tokens": 4, "n": 2, "seed": 3, "stop": ["x"], "return_logprob": True,
     "top_logprobs_num": 2},
])
def test_flat_body_with_model_is_the_flat_body(body):
    """`model` beside the flat fields keeps the body flat: the same engine requests as without it."""
    plan = generate_plan(body | {"model": "sdar-tiny"})
    assert _params(plan) == _params(generate_plan(body))
    assert plan.as_list == (body.get("n", 1) > 1)


def test_flat_body_model_must_be_a_string():
    with pytest.raises(ApiError) as e:
        generate_plan({"prompt": "hi", "model": 5})
    assert e.value.param == "model"


@pytest.mark.parametrize(("body", "param"), [
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 2}]}, "sampling_params[1].top_p"),
    ({"input_ids": IDS, "sampling_params": {"max_new_tokens": 0},
      "dllm_trajectory": {"output_ids": [1], "step_map": "x"}}, "dllm_trajectory.step_map"),
    ({"text": "hi", "sampling_params": 5}, "sampling_params"),  # the field itself is wrong
    ({"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
])
def test_native_schema_errors_name_the_whole_path(body, param):
    with pytest.raises(ApiError) as e:
        generate_plan(body)
    assert e.value.param == param, e.value.message
    assert param in e.value.message
    top = re.split(r"[.\[]", param)[0]
    if param != top:  # a wrong value inside the object: not also "not a list" of the field's other shape
        assert f"{top}: " not in e.value.message, e.value.message


@pytest.mark.parametrize(("body", "query", "note"), [
    ({"prompt": "hi"}, None, {}),
    ({"prompt": "hi", "model": "sdar"}, None, {}),
    ({"prompt": "hi", "model": "gpt-4"}, None, {"ignored_model": "gpt-4", "served_model": "sdar"}),
    ({"prompt": "hi"}, "gpt-4", {"ignored_model": "gpt-4", "served_model": "sdar"}),
    ({"prompt": "hi", "model": "sdar"}, "gpt-4", {}),  # the body's model, as the several-model app routes
    ({"text": "hi", "model": "gpt-4"}, None, {"ignored_model": "gpt-4", "served_model": "sdar"}),
    ({"text": "hi", "model": None}, None, {}),  # what sglang-router forwards
    ({"input_ids": [IDS, IDS], "model": "gpt-4"}, None, {"ignored_model": "gpt-4", "served_model": "sdar"}),
])
def test_a_named_other_model_is_noted_in_meta_info(body, query, note):
    plan = generate_plan(body, served_model="sdar", query_model=query)
    assert plan.meta == note
    out = generate_body(Response(request_id="r", text="x", token_ids=[1]), plan.groups[0][0].params, None,
                        plan.meta)
    assert {k: out["meta_info"].get(k) for k in note} == note
    assert ("ignored_model" in out["meta_info"]) == bool(note)


# ---- over HTTP: an application of several models ----------------------------------------------------
@pytest.fixture(scope="module")
def several_models(serve_pool):
    """deployments.llm's application of the shipped Ray Serve LLM config (the session's pool holds it):
    the tiny SDAR as `sdar-tiny` and the tiny Qwen3 as `qwen3-tiny`, one engine replica each."""
    return serve_pool["llm_yaml"].url


def _post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url, json=body, timeout=TIMEOUT, **kw)


def test_flat_body_with_model_is_routed_to_that_model(several_models):
    url = several_models + "/generate"
    refused = _post(url, FLAT)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model", refused.text
    assert "the body's `model` field" in refused.json()["error"]["message"]  # what it asks for ...
    for model in MODELS:  # ... answers, by the model named
        r = _post(url, FLAT | {"model": model})
        assert r.status_code == 200, r.text
        by_query = _post(url, FLAT, params={"model": model})
        assert by_query.status_code == 200, by_query.text
        assert r.json()["output_ids"] == by_query.json()["output_ids"] and len(r.json()["output_ids"]) == 6
        assert "ignored_model" not in r.json()["meta_info"]
    answers = {m: _post(url, FLAT | {"model": m}).json()["output_ids"] for m in MODELS}
    assert answers["sdar-tiny"] != answers["qwen3-tiny"]  # two models, two answers
    # streamed, and a text prompt
    with httpx.stream("POST", url, json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True,
                                         "model": "qwen3-tiny"}, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] is not None
    unknown = _post(url, FLAT | {"model": "gpt-4"})
    assert unknown.status_code == 404 and "gpt-4" in unknown.json()["error"]["message"]


# ---- over HTTP: one-model applications (the session's shared ones) --------------------------------------
def test_native_schema_error_names_the_whole_path_over_http(served_apps):
    r = _post(served_apps["sdar"].url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "sampling_params.max_new_tokens", r.text


def test_one_model_app_answers_the_flat_body_with_model(served_apps):
    url = served_apps["sdar"].url + "/generate"
    plain = _post(url, FLAT)
    assert plain.status_code == 200, plain.text
    for body in (FLAT | {"model": "sdar"}, FLAT | {"model": "gpt-4"}, FLAT | {"model": None}):
        r = _post(url, body)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == plain.json()["output_ids"]  # the served model's own answer


def test_one_model_app_says_which_model_answered_a_named_other_one(served_apps):
    app = served_apps["sdar"]
    served = app.url.rsplit("/", 1)[-1]  # the checkpoint directory's name: the app's served model name
    url = app.url + "/generate"
    plain = _post(url, FLAT)
    assert plain.status_code == 200 and "ignored_model" not in plain.json()["meta_info"]
    note = {"ignored_model": "gpt-4", "served_model": served}
    native = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    for body, query in ((FLAT | {"model": "gpt-4"}, None), (FLAT, {"model": "gpt-4"}),
                        (native | {"model": "gpt-4"}, None)):
        r = _post(url, body, params=query)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert {k: meta.get(k) for k in note} == note, (body, query, meta)
        assert r.json()["output_ids"] == plain.json()["output_ids"]
    assert "ignored_model" not in _post(url, FLAT | {"model": served}).json()["meta_info"]
    with httpx.stream("POST", url, json=FLAT | {"model": "gpt-4", "stream": True}, timeout=TIMEOUT) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert chunks and all({k: c["meta_info"].get(k) for k in note} == note for c in chunks)
