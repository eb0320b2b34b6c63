"""A rule that decodes only greedily (`joint_threshold_indel`) and the request's temperature: a request
that leaves temperature unset decodes greedily under it -- in the offline API (where `do_sample=True`
alone asks for nothing more) and in every HTTP body (whose default temperature is 1.0) -- and one that
sets a sampling temperature is a 400 / RequestError naming `temperature`. The HTTP bodies go through the
ingress's own conversion and an in-process EngineServer (no Ray), as the routes send them."""

from __future__ import annotations

import asyncio

import pytest

from configs import EngineConfig, GenerationConfig
from deployments.engine_server import EngineServer
from deployments.openai.protocol import CompletionRequest
from deployments.openai.serving import completion_to_engine
from deployments.sglang.serving import generate_plan
from deployments.wire import EngineRequest, Rejection
from engine import pipeline
from engine.carrier import Response
from engine.errors import RequestError
from testing.tiny_llada2 import write_tiny_llada2

RULE = "joint_threshold_indel"
# edit tokens the tiny LLaDA2.2 writes now and then (tests/engine/families/test_llada2_indel.py)
DELETE, SPLIT = 128, 287
ENGINE = dict(max_model_len=256, dllm_delete_token_id=DELETE, dllm_split_token_id=SPLIT)
PROMPT = [17, 99, 3, 250, 41, 7, 180, 66, 12]
N = 40  # two blocks of 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # LLaDA2.2: block routing, 4 of the 8 experts per 32-token routing block
    return write_tiny_llada2(tmp_path_factory.mktemp("llada2"), use_qkv_bias=True, use_bias=True, seed=0,
                             expert_capacity=4)


@pytest.fixture(scope="module")
def pipe(ckpt):
    with pipeline(str(ckpt), EngineConfig(**ENGINE)) as p:
        yield p


@pytest.fixture(scope="module")
def greedy(pipe):
    """The rule's output for PROMPT (GenerationConfig's default: greedy)."""
    out = pipe(PROMPT, GenerationConfig(max_new_tokens=N, dllm_unmasking_strategy=RULE))
    assert len(out.token_ids) > 0
    return out.token_ids


def run(server: EngineServer, requests: list[EngineRequest]) -> list[Response | Rejection]:
    return asyncio.run(server.generate_batch(requests))


def bodies(temperature: dict) -> dict[str, list[EngineRequest]]:
    """The engine requests of one prompt under the rule, from each endpoint's body."""
    flat = generate_plan({"input_ids": PROMPT, "max_tokens": N, "dllm_unmasking_strategy": RULE, **temperature})
    native = generate_plan({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N,
                                                                      "dllm_unmasking_strategy": RULE, **temperature}})
    completion = CompletionRequest.model_validate({"prompt": PROMPT, "max_tokens": N, "dllm_unmasking_strategy": RULE,
                                                   **temperature})
    ((_, completions),) = completion_to_engine(completion, "m", None, True)
    return {"/generate": flat.groups[0], "/generate (native)": native.groups[0], "/v1/completions": completions}


@pytest.fixture(scope="module")
def server(ckpt):
    s = EngineServer.func_or_class(str(ckpt), ENGINE)
    try:
        yield s
    finally:
        s.__del__()


@pytest.mark.parametrize("temperature", [{}, {"temperature": 0.0}], ids=["unset", "zero"])
def test_http_bodies_that_leave_temperature_unset_decode_greedily(server, greedy, temperature):
    for endpoint, requests in bodies(temperature).items():
        (out,) = run(server, requests)
        assert isinstance(out, Response), (endpoint, out)
        assert out.token_ids == greedy, endpoint


def test_http_bodies_with_a_sampling_temperature_are_a_400_naming_it(server):
    params = {"/generate": "temperature", "/generate (native)": "sampling_params.temperature",
              "/v1/completions": "temperature"}
    for endpoint, requests in bodies({"temperature": 0.7}).items():
        (out,) = run(server, requests)
        assert isinstance(out, Rejection) and out.status == 400, (endpoint, out)
        assert out.param == params[endpoint], (endpoint, out)
        assert "temperature" in out.message and "do_sample" not in out.message, (endpoint, out.message)
        assert RULE in out.message and "0.7" in out.message, (endpoint, out.message)


def test_offline_requests_decode_greedily_unless_they_set_a_sampling_temperature(pipe, greedy):
    base = dict(max_new_tokens=N, dllm_unmasking_strategy=RULE)
    # do_sample=True with temperature unset asks for nothing the rule cannot do
    for params in (GenerationConfig(**base, do_sample=True), GenerationConfig(**base, do_sample=True, temperature=0.0),
                   GenerationConfig(**base, temperature=0.7)):  # do_sample off: greedy, as for every rule
        assert pipe(PROMPT, params).token_ids == greedy, params
    with pytest.raises(RequestError, match="temperature=0.7") as e:
        pipe(PROMPT, GenerationConfig(**base, do_sample=True, temperature=0.7))
    assert e.value.param == "temperature" and "do_sample" not in e.value.message


def test_the_rule_engine_wide_takes_an_unset_temperature_as_greedy(ckpt, greedy):
    with pipeline(str(ckpt), EngineConfig(**ENGINE, dllm_unmasking_strategy=RULE)) as p:
        assert p(PROMPT, GenerationConfig(max_new_tokens=N, do_sample=True)).token_ids == greedy
        with pytest.raises(RequestError, match="temperature") as e:
            p(PROMPT, GenerationConfig(max_new_tokens=N, do_sample=True, temperature=0.5))
        assert e.value.param == "temperature"
