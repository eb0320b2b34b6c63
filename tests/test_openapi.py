"""The OpenAPI schema at /openapi.json (valid OpenAPI 3, the real request models), the docs page, and
an API fuzzer (schemathesis) driven by that schema against the served app: no 5xx."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error

TIMEOUT = 120


def test_openapi_schema_is_valid_and_names_the_request_models(served_apps):
    base = served_apps["sdar"].url
    spec = httpx.get(base + "/openapi.json", timeout=TIMEOUT).json()
    validate(spec)
    assert spec["openapi"].startswith("3.")
    body = spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in body["anyOf"]} == {"GenerateRequest", "NativeGenerateRequest"}
    schemas = spec["components"]["schemas"]
    assert {"max_tokens", "return_logprob", "logprob_start_len"} <= set(schemas["GenerateRequest"]["properties"])
    assert {"echo", "logprobs", "n", "prompt"} <= set(schemas["CompletionRequest"]["properties"])
    assert "max_new_tokens" in schemas["SamplingParams"]["properties"]
    assert schemas["ErrorResponse"]["properties"].keys() == {"error"}
    docs = httpx.get(base + "/docs", timeout=TIMEOUT)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert "cdn" not in docs.text and "/sdar/openapi.json" in docs.text  # served here, under the app's prefix
    for asset, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "css")):
        assert f"/sdar/docs/static/{asset}" in docs.text
        r = httpx.get(f"{base}/docs/static/{asset}", timeout=TIMEOUT)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 1000
    assert httpx.get(base + "/docs/static/..%2Fpyproject.toml", timeout=TIMEOUT).status_code == 404
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):  # JSON, or SSE when streamed
        assert set(spec["paths"][route]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                  "text/event-stream"}
    r = httpx.get(base + "/generate", timeout=TIMEOUT)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and set(r.json()["error"]) == {
        "message", "type", "param"}


def test_fuzz_every_operation_never_5xx(served_apps):
    """Bodies generated from /openapi.json (valid and invalid ones), a bounded number per operation,
    sent over loopback: every answer is below 500."""
    base = served_apps["sdar"].url
    api = schemathesis.openapi.from_url(base + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /generate", "POST /v1/completions", "POST /v1/chat/completions",
                                                "GET /v1/models", "GET /health", "GET /metrics"}
    statuses: list[int] = []
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            statuses.append(case.call_and_validate(base_url=base, checks=[not_a_server_error],
                                                   timeout=TIMEOUT).status_code)

        fuzz()
    assert len(statuses) >= 3 * len(operations) and {200, 400} <= set(statuses), statuses
