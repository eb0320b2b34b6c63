"""The OpenAPI schema at /openapi.json (valid OpenAPI 3, the real request models), the docs page, and
an API fuzzer (schemathesis) driven by that schema against the served app: no 5xx, and no status code
or content type the schema does not document."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

from tests.support.serve_pool import QWEN3_KEY

TIMEOUT = 120
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


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


def test_fuzz_every_operation_never_5xx_nor_undocumented(served_apps):
    """Bodies generated from /openapi.json (valid and invalid ones), a bounded number per operation,
    sent over loopback: every answer is below 500, with a status code and a content type the schema
    documents for that operation."""
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
            statuses.append(case.call_and_validate(base_url=base, checks=CHECKS, timeout=TIMEOUT).status_code)

        fuzz()
    assert len(statuses) >= 3 * len(operations) and {200, 400} <= set(statuses), statuses


def test_refusals_are_documented(serve_pool):
    """On an app with an API key and a 4 KiB body limit (the pool's `qwen3_keyed`), each operation's
    refusals (401 without the key, 413 for a larger body) have a status code and a content type the
    schema documents."""
    key, app = QWEN3_KEY, serve_pool["qwen3_keyed"]
    api = schemathesis.openapi.from_url(app.url + "/openapi.json")
    answers: dict[tuple[str, str], int] = {}
    for op in (result.ok() for result in api.get_all_operations()):
        cases = [("anonymous", {}, op.Case())]
        if op.method.upper() == "POST":
            big = {"prompt": "x" * 8192, "messages": [{"role": "user", "content": "x" * 8192}]}
            cases = [("anonymous", {}, op.Case(body=big, media_type="application/json")),
                     ("too large", {"Authorization": f"Bearer {key}"},
                      op.Case(body=big, media_type="application/json"))]
        for name, headers, case in cases:
            response = case.call(base_url=app.url, headers=headers, timeout=TIMEOUT)
            case.validate_response(response, checks=CHECKS)
            answers[(op.label, name)] = response.status_code
    assert answers.pop(("GET /health", "anonymous")) == 200
    assert {status for (_, name), status in answers.items() if name == "anonymous"} == {401}
    assert {status for (_, name), status in answers.items() if name == "too large"} == {413}
