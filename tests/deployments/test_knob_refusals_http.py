"""A few (family, knob) pairs the model cannot use, over real HTTP on the shared Serve applications:
a 400 whose message names the field, on SGLang's /generate (flat and native bodies) and on OpenAI's
/v1/completions (tests/engine/test_knob_refusals.py covers every pair on the engine)."""

from __future__ import annotations

import httpx
import pytest

CASES = [("qwen3", "dllm_confidence_threshold", 0.5), ("qwen3", "dllm_block_length", 4),
         ("qwen3", "dllm_unmasking_strategy", "sequential"), ("sdar", "dllm_edit_threshold", 0.5)]


@pytest.mark.parametrize(("app", "field", "value"), CASES, ids=[f"{a}-{f}" for a, f, _ in CASES])
def test_a_knob_the_model_does_not_read_is_a_400_naming_it(served_apps, app, field, value):
    base = served_apps[app].url
    bodies = (("/generate", {"input_ids": [1, 2, 3], "max_tokens": 4, field: value}),
              ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, field: value}}),
              ("/v1/completions", {"prompt": "hi", "max_tokens": 4, field: value}))
    for path, body in bodies:
        r = httpx.post(base + path, json=body, timeout=120)
        assert r.status_code == 400, (path, r.text)
        assert field in r.json()["error"]["message"], (path, r.text)
