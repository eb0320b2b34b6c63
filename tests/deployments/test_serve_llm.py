"""deployments.llm: Ray Serve LLM configs serve blockserve. The shipped YAML (a Ray Serve LLM config
with only import_path changed) serves two models; LLMConfig objects (this module's and
ray.serve.llm's are taken too) serve one; the official openai client completes against each by name; an unknown
model is a 404 naming it. The YAML's app is the session pool's (tests/support/serve_pool.py)."""

from __future__ import annotations

import httpx
import openai
import pytest
import yaml

from engine import EngineConfig, GenerationConfig, pipeline
from tests.support.paths import ROOT
from tests.support.ray_env import QUIET
from tests.support.serve_pool import SHIPPED_LLM_CONFIG

SHIPPED = ROOT / SHIPPED_LLM_CONFIG


def shipped_app() -> dict:
    return yaml.safe_load(SHIPPED.read_text())["applications"][0]


@pytest.fixture(scope="module")
def apps(serve_pool, tiny_checkpoints):
    """`yaml`: the shipped YAML's app (sdar-tiny and qwen3-tiny), built from its import_path and args as
    `serve run` builds it (the session's pool holds it). `objects`: one model from an LLMServingArgs of an
    LLMConfig."""
    from ray import serve

    from deployments.llm import LLMConfig, LLMServingArgs, build_openai_app

    config = LLMConfig(model_loading_config=dict(model_id="tiny-qwen", model_source=str(tiny_checkpoints["qwen3"])),
                       engine_kwargs=dict(max_model_len=256, block_size=4, max_num_seqs=8, dtype="float"))
    objects = build_openai_app(LLMServingArgs(llm_configs=[config], ingress_deployment_config={"num_replicas": 1}))
    serve.run(objects, name="llm_objects", route_prefix="/llm_objects", logging_config=QUIET)
    yield {"yaml": serve_pool["llm_yaml"].url, "objects": f"{serve_pool.cluster.url}/llm_objects"}
    serve.delete("llm_objects", _blocking=False)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="fake-key", timeout=120, max_retries=0)


def ray_serve_llm():
    """Ray's own `ray.serve.llm`, or a skip: it imports only beside vLLM or SGLang and pyarrow, which
    README's test install does not bring (docs/rl.md's install of sglang and the callers' requirements
    does, as .ci/run runs it)."""
    return pytest.importorskip("ray.serve.llm", exc_type=ImportError,
                               reason="docs/rl.md's sglang install brings what ray.serve.llm imports")


def test_shipped_yaml_is_a_ray_serve_llm_config():
    RayLLMServingArgs = ray_serve_llm().LLMServingArgs
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(yaml.safe_load(SHIPPED.read_text()))
    spec = shipped_app()
    assert spec["import_path"] == "deployments.llm:build_openai_app"
    ray_args = RayLLMServingArgs.model_validate(spec["args"])  # Ray's own builder takes the same args
    assert [c.model_id for c in ray_args.llm_configs] == ["sdar-tiny", "qwen3-tiny"]


def test_two_models_in_one_app_routed_by_model(apps):
    oa = client(apps["yaml"])
    assert sorted(m.id for m in oa.models.list().data) == ["qwen3-tiny", "sdar-tiny"]
    assert oa.models.retrieve("sdar-tiny").id == "sdar-tiny"
    sdar = oa.completions.create(model="sdar-tiny", prompt="Hello", max_tokens=8, temperature=0)
    assert sdar.model == "sdar-tiny" and sdar.choices[0].finish_reason in ("stop", "length")
    chat = oa.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=6, temperature=0)
    assert chat.model == "qwen3-tiny" and chat.usage.completion_tokens >= 1
    # the answer is the model's own: the engine with what the YAML's engine_kwargs mean
    engine = EngineConfig(max_model_len=1024, kv_block_size=16, max_batch_size=64, enable_prefix_caching=True)
    with pipeline(str(ROOT / "models" / "sdar-tiny"), engine) as pipe:
        want = pipe("Hello", GenerationConfig(max_new_tokens=8))
    assert sdar.choices[0].text == want.text
    # streamed through the front ingress: the model ingress's own Server-Sent Events
    pieces = [c.choices[0].text for c in oa.completions.create(model="sdar-tiny", prompt="Hello", max_tokens=8,
                                                               temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == want.text


def test_unknown_model_is_a_404_naming_it(apps):
    oa = client(apps["yaml"])
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        oa.completions.create(model="no-such-model", prompt="Hello", max_tokens=4)
    r = httpx.get(apps["yaml"] + "/v1/models/no-such-model", timeout=60)
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]
    # several models: a route without a model names the choice
    r = httpx.post(apps["yaml"] + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_llm_config_objects_serve_one_model(apps):
    oa = client(apps["objects"])
    assert [m.id for m in oa.models.list().data] == ["tiny-qwen"]
    assert oa.models.retrieve("tiny-qwen").id == "tiny-qwen"
    out = oa.completions.create(model="tiny-qwen", prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError, match="sdar-tiny"):
        oa.completions.create(model="sdar-tiny", prompt="Hello", max_tokens=4)
    # one model: its other routes answer without naming it (here SGLang's /generate)
    r = httpx.post(apps["objects"] + "/generate", json={"input_ids": [1, 2, 3], "max_tokens": 5, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 5


def test_ray_serve_llm_config_objects_map_field_by_field():
    from deployments.llm.config import LLMServingArgs, app_args

    RayLLMConfig = ray_serve_llm().LLMConfig

    ray_config = RayLLMConfig(model_loading_config=dict(model_id="m", model_source="models/qwen3-tiny"),
                              engine_kwargs=dict(tensor_parallel_size=1, block_size=4, max_num_seqs=8,
                                                 gpu_memory_utilization=0.5, dtype="half", enforce_eager=True),
                              deployment_config=dict(num_replicas=2), accelerator_type="A10G",
                              runtime_env={"env_vars": {"X": "1"}},
                              experimental_configs={"stream_batching_interval_ms": 20})
    args = app_args(LLMServingArgs(llm_configs=[ray_config]).llm_configs[0])
    assert args == {"model": "models/qwen3-tiny", "served_model_name": "m", "num_replicas": 2,
                    "stream_batching_interval_ms": 20,
                    "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
                    "engine": {"tp": 1, "kv_block_size": 4, "max_batch_size": 8, "num_kv_blocks": 0.5,
                               "dtype": "float16", "cuda_graphs": False},
                    "ray_actor_options": {"accelerator_type": "A10G", "runtime_env": {"env_vars": {"X": "1"}}}}


def test_refused_fields_name_themselves():
    from deployments.llm import LLMConfig, build_openai_app

    base = {"model_loading_config": {"model_id": "m", "model_source": str(ROOT / "models" / "qwen3-tiny")}}
    for extra, name in (({"lora_config": {"max_num_adapters_per_replica": 2}}, "lora_config"),
                        ({"engine_kwargs": {"no_such_knob": 1}}, "no_such_knob"),
                        ({"engine_kwargs": {"block_size": 0}}, "engine_kwargs.block_size"),
                        ({"deployment_config": {"user_config": {}}}, "user_config"),
                        ({"experimental_configs": {"num_ingress_replicas": 2}}, "num_ingress_replicas"),
                        ({"experimental_configs": {"stream_batching_interval_ms": -1}}, "stream_batching_interval_ms")):
        with pytest.raises(ValueError, match=name):
            build_openai_app({"llm_configs": [LLMConfig.model_validate(base | extra)]})
    with pytest.raises(ValueError, match="unique"):
        build_openai_app({"llm_configs": [base, base]})



def test_health_of_several_models_is_200_when_all_are_ready_and_per_model_with_model(apps):
    """docs/migrate.md's readiness loop (`until curl -sf .../health`) ends on the several-model app."""
    ids = [c["model_loading_config"]["model_id"] for c in shipped_app()["args"]["llm_configs"]]
    r = httpx.get(f"{apps['yaml']}/health", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert set(r.json()["models"]) == set(ids) and all(m["status_code"] == 200 for m in r.json()["models"].values())
    for model in ids:
        one = httpx.get(f"{apps['yaml']}/health", params={"model": model}, timeout=60)
        assert one.status_code == 200 and one.json()["status"] == "ok", one.text
    unknown = httpx.get(f"{apps['yaml']}/health", params={"model": "nope"}, timeout=60)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
