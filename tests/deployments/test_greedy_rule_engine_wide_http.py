"""A rule that decodes only greedily (`joint_threshold_indel`), set engine-wide, and the request's
temperature over HTTP: a body that leaves temperature unset decodes greedily (the ingress keeps which
sampling fields the client set, so the engine sees temperature unset, as offline, not the HTTP
default 1.0), and one that sets a sampling temperature is a 400 naming `temperature`. Each body on
the ingress's own conversion and an in-process EngineServer (no Ray), then over real HTTP on an
application of its own (tests/engine/test_greedy_rule_temperature.py: the same rule named per request)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from configs import EngineConfig, GenerationConfig
from deployments.engine_server import EngineServer
from deployments.openai.protocol import CompletionRequest
from deployments.openai.serving import completion_to_engine
from deployments.sglang.serving import generate_plan
from deployments.wire import EngineRequest, Rejection
from engine import pipeline
from engine.carrier import Response
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.serve import deploy

RULE = "joint_threshold_indel"
# the edit tokens the tiny LLaDA2.2 writes now and then (tests/engine/families/test_llada2_indel.py), and the
# rule engine-wide
ENGINE = dict(max_model_len=256, kv_block_size=16, num_kv_blocks=64, dllm_delete_token_id=128,
              dllm_split_token_id=287, dllm_unmasking_strategy=RULE)
PROMPT = [17, 99, 3, 250, 41, 7, 180, 66, 12]
N = 40  # two blocks of 32
# each endpoint's body for PROMPT (its own fields added), and the field a refusal names in it
BODIES = {"/generate": ({"input_ids": PROMPT, "max_tokens": N}, "temperature"),
          "/generate (native)": ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N}},
                                 "sampling_params.temperature"),
          "/v1/completions": ({"prompt": PROMPT, "max_tokens": N}, "temperature")}


def with_temperature(body: dict, temperature: dict) -> dict:
    if "sampling_params" in body:
        return body | {"sampling_params": body["sampling_params"] | temperature}
    return body | temperature


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # LLaDA2.2: block routing, 4 of the 8 experts per 32-token routing block
    return write_tiny_llada2(tmp_path_factory.mktemp("llada2"), use_qkv_bias=True, use_bias=True, seed=0,
                             expert_capacity=4)


@pytest.fixture(scope="module")
def greedy(ckpt) -> list[int]:
    """The rule's output for PROMPT offline (GenerationConfig's default: greedy)."""
    with pipeline(str(ckpt), EngineConfig(**ENGINE)) as p:
        out = p(PROMPT, GenerationConfig(max_new_tokens=N))
    assert len(out.token_ids) > 0
    return out.token_ids


def engine_requests(endpoint: str, body: dict) -> list[EngineRequest]:
    """What the ingress sends the engine for one endpoint's body."""
    if endpoint == "/v1/completions":
        ((_, requests),) = completion_to_engine(CompletionRequest.model_validate(body), "m", None, True)
        return requests
    return generate_plan(body).groups[0]


@pytest.mark.parametrize("temperature", [{}, {"temperature": 0.7}], ids=["unset", "sampling"])
def test_the_ingress_conversion_keeps_an_unset_temperature_unset(ckpt, greedy, temperature):
    server = EngineServer.func_or_class(str(ckpt), ENGINE)
    try:
        for endpoint, (body, param) in BODIES.items():
            (out,) = asyncio.run(server.generate_batch(engine_requests(endpoint, with_temperature(body, temperature))))
            if temperature:
                assert isinstance(out, Rejection) and out.status == 400 and out.param == param, (endpoint, out)
                assert "temperature" in out.message and RULE in out.message, (endpoint, out.message)
            else:
                assert isinstance(out, Response) and out.token_ids == greedy, (endpoint, out)
    finally:
        server.__del__()


def test_over_http_no_temperature_decodes_greedily_and_a_sampling_one_is_a_400(serve_cluster, ckpt, greedy):
    app = deploy(serve_cluster, "greedy_rule_engine_wide", ckpt, ENGINE)
    try:
        for endpoint, (body, param) in BODIES.items():
            url = app.url + endpoint.split()[0]
            r = httpx.post(url, json=body, timeout=300)
            assert r.status_code == 200, (endpoint, r.text)
            if endpoint.startswith("/generate"):  # (/v1/completions answers the text only)
                assert r.json()["output_ids"] == greedy, endpoint
            r = httpx.post(url, json=with_temperature(body, {"temperature": 0.7}), timeout=300)
            assert r.status_code == 400, (endpoint, r.text)
            error = r.json()["error"]
            assert error["param"] == param and "temperature" in error["message"], (endpoint, error)
    finally:
        serve.delete(app.name)
