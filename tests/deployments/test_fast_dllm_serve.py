"""Fast-dLLM v2 served: SGLang `/generate` bodies on a tensor-parallel (tp=2) replica answer exactly what
the in-process pipeline (tp=1) gives: tokens, step_map, raw logprobs, finish reasons; a knob that does
not apply to the family is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from engine import EngineConfig, GenerationConfig, pipeline
from testing.tiny_fast_dllm import FAST_DLLM_TEST_LOGIT_SCALE, write_tiny_fast_dllm
from tests.support.serve import deploy

ENGINE = {"max_model_len": 256, "num_kv_blocks": 128, "kv_block_size": 8, "max_batch_size": 8,
          "logprobs_mode": "raw_logprobs"}
CASES = [  # (prompt length, max_new_tokens, threshold)
    (5, 40, 0.9), (32, 37, 0.5), (33, 6, 0.3), (1, 20, 0.7),
]


def make_prompt(length: int) -> list[int]:
    return [(5 * i + 3 * length) % 300 + 1 for i in range(length)]


@pytest.fixture(scope="module")
def fast_dllm_tp2(serve_cluster, tmp_path_factory):
    path = write_tiny_fast_dllm(tmp_path_factory.mktemp("fast_dllm_serve"), tie_word_embeddings=True, seed=21,
                                logit_scale=FAST_DLLM_TEST_LOGIT_SCALE)
    app = deploy(serve_cluster, "fast_dllm_tp2", path, dict(ENGINE, tp=2))
    yield app
    serve.delete(app.name)


def test_http_tp2_equals_pipeline_tp1(fast_dllm_tp2):
    stats = serve.get_app_handle(fast_dllm_tp2.name).engine_stats.remote().result()
    assert [(s["tp"], s["executor"]) for s in stats] == [(2, "ray_tp")]
    prompts = [make_prompt(n) for n, _, _ in CASES]
    params = [GenerationConfig(max_new_tokens=m, dllm_confidence_threshold=t, logprobs=0) for _, m, t in CASES]
    with pipeline(fast_dllm_tp2.model, EngineConfig(**ENGINE)) as pipe:
        want = pipe(prompts, params)
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": m, "temperature": 0, "dllm_confidence_threshold": t}
                                for _, m, t in CASES]}
    got = httpx.post(fast_dllm_tp2.url + "/generate", json=body, timeout=180)
    assert got.status_code == 200, got.text
    for out, ref in zip(got.json(), want, strict=True):
        meta = out["meta_info"]
        assert out["output_ids"] == ref.token_ids
        assert meta["step_map"] == ref.step_map
        assert meta["finish_reason"]["type"] == ref.finish_reason
        rows = meta["output_token_logprobs"]
        assert [r[1] for r in rows] == ref.token_ids
        assert [r[0] for r in rows] == pytest.approx([e[t] for e, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)


@pytest.mark.parametrize(("field", "value"), [("dllm_unmasking_strategy", "sequential"),
                                              ("dllm_denoising_steps", 4)])
def test_knob_that_does_not_apply_is_a_400(fast_dllm_tp2, field, value):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, field: value}}
    r = httpx.post(fast_dllm_tp2.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
