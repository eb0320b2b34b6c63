"""Bad input over HTTP: a matrix of malformed, mistyped, out-of-range and
hostile requests against /generate and the OpenAI routes on a real local Ray Serve cluster, then
property-based fuzzing (hypothesis) of /generate. Every refusal is a 4xx with the error JSON naming
the field; nothing is ever a 5xx; the server keeps serving normal requests."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.http import sse_events
from tests.support.ray_env import SERVE_ENGINE

TIMEOUT = 60
MAX_LEN = SERVE_ENGINE["max_model_len"]
BODY_LIMIT = 1 << 20  # the sdar app's max_body_bytes (conftest)


def raw(text: str) -> bytes:
    return text.encode()


# (app, route, body: dict | bytes, status, param, words the message must contain)
# param None = the body as a whole is at fault; then the message must name the body / JSON.
CASES = [
    # ---- /generate: the body is not a JSON object -------------------------------------------
    ("sdar", "/generate", raw('{"prompt": "hi",'), 400, None, ["JSON"]),
    ("sdar", "/generate", b"", 400, None, ["JSON"]),
    ("sdar", "/generate", raw("null"), 400, None, ["JSON object"]),
    ("sdar", "/generate", raw('"just a string"'), 400, None, ["JSON object"]),
    ("sdar", "/generate", raw("[1, 2, 3]"), 400, None, ["JSON object"]),
    ("sdar", "/generate", b"\x80\x81\x82{}", 400, None, ["JSON"]),  # invalid UTF-8 bytes
    ("sdar", "/generate", b'{"prompt": "caf\xc3\x28"}', 400, None, ["JSON"]),  # invalid UTF-8 in a string
    ("sdar", "/generate", raw('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), 400, None, ["JSON"]),
    ("sdar", "/generate", raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400, None, ["nested"]),
    ("sdar", "/generate", b'{"prompt": "' + b"a" * (BODY_LIMIT + 10) + b'"}', 413, None, ["body", "limit"]),
    # ---- NaN / Infinity / unpaired surrogates (Python's json accepts all three) ---------------
    ("sdar", "/generate", raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature", ["finite"]),
    ("sdar", "/generate", raw('{"prompt": "hi", "top_p": Infinity}'), 400, "top_p", ["finite"]),
    ("sdar", "/generate", raw('{"prompt": "hi", "max_tokens": -Infinity}'), 400, "max_tokens", []),
    ("sdar", "/generate", raw('{"prompt": "hi", "min_p": 1e400}'), 400, "min_p", []),
    ("sdar", "/generate", raw('{"prompt": "\\ud800 hi"}'), 400, "prompt", ["Unicode"]),
    ("sdar", "/generate", raw('{"prompt": "hi", "stop": ["ok", "\\udfff"]}'), 400, "stop", ["Unicode"]),
    # ---- wrong types -----------------------------------------------------------------------
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens", []),
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": 16.5}, 400, "max_tokens", []),
    ("sdar", "/generate", {"prompt": "hi", "stream": "true"}, 400, "stream", []),
    ("sdar", "/generate", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", []),
    ("sdar", "/generate", {"prompt": 42}, 400, "prompt", []),
    ("sdar", "/generate", {"prompt": {"text": [[{"a": None}]]}}, 400, "prompt", []),  # nested garbage
    ("sdar", "/generate", {"input_ids": [[1, 2], 3]}, 400, "input_ids", []),
    ("sdar", "/generate", {"input_ids": [1, True, 3]}, 400, "input_ids", []),
    ("sdar", "/generate", {"input_ids": "1 2 3"}, 400, "input_ids", []),
    ("sdar", "/generate", {"prompt": "hi", "stop": 5}, 400, "stop", []),
    ("sdar", "/generate", {"prompt": "hi", "return_logprob": 1}, 400, "return_logprob", []),
    # ---- missing / unknown fields, empty input --------------------------------------------------
    ("sdar", "/generate", {"max_tokens": 4}, 400, "prompt", []),
    ("sdar", "/generate", {"prompt": "hi", "input_ids": [1, 2]}, 400, "input_ids", ["prompt"]),
    ("sdar", "/generate", {"prompt": "hi", "temprature": 0.5}, 400, "temprature", ["unknown"]),
    # sampling_params makes it SGLang's native body, which names its prompt `text`
    ("sdar", "/generate", {"prompt": "hi", "sampling_params": {"temperature": 0}}, 400, "prompt", ["unknown"]),
    ("sdar", "/generate", {"input_ids": []}, 400, "input_ids", ["empty"]),
    ("sdar", "/generate", {"prompt": "", "stream": True}, 400, "prompt", ["empty"]),
    # ---- out-of-vocabulary ids ---------------------------------------------------------------
    ("sdar", "/generate", {"input_ids": [5, -1]}, 400, "input_ids", ["vocabulary"]),
    ("sdar", "/generate", {"input_ids": [5, 10**30]}, 400, "input_ids", ["vocabulary"]),
    ("sdar", "/generate", {"input_ids": [5, 100_000], "stream": True}, 400, "input_ids", ["vocabulary"]),
    # ---- lengths: max_tokens and the prompt against max_model_len -------------------------------
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens", ["max_model_len"]),
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens", ["max_model_len"]),
    ("sdar", "/generate", {"input_ids": [7] * (MAX_LEN + 1), "max_tokens": 1}, 400, "max_tokens",
     ["prompt", "max_model_len"]),
    ("sdar", "/generate", {"prompt": "hello " * 600, "max_tokens": 1, "stream": True}, 400, "max_tokens",
     ["prompt", "max_model_len"]),
    # ---- negative / absurd values --------------------------------------------------------------
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", []),
    ("sdar", "/generate", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", []),
    ("sdar", "/generate", {"prompt": "hi", "top_p": 0}, 400, "top_p", []),
    ("sdar", "/generate", {"prompt": "hi", "top_k": -5}, 400, "top_k", []),
    ("sdar", "/generate", {"prompt": "hi", "top_k": 2**40}, 400, "top_k", []),
    ("sdar", "/generate", {"prompt": "hi", "min_p": 1.5}, 400, "min_p", []),
    ("sdar", "/generate", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", []),
    ("sdar", "/generate", {"prompt": "hi", "repetition_penalty": 1e30}, 400, "repetition_penalty", []),
    ("sdar", "/generate", {"prompt": "hi", "seed": -1}, 400, "seed", []),
    ("sdar", "/generate", {"prompt": "hi", "seed": 2**64}, 400, "seed", []),
    # ---- logprobs -------------------------------------------------------------------------------
    ("sdar", "/generate", {"prompt": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, 400,
     "top_logprobs_num", []),
    ("sdar", "/generate", {"prompt": "hi", "top_logprobs_num": 3}, 400, "top_logprobs_num", ["return_logprob"]),
    ("sdar", "/generate", {"prompt": "hi", "logprob_start_len": -2}, 400, "logprob_start_len", []),
    ("sdar", "/generate", {"input_ids": [1, 2, 3], "logprob_start_len": 0, "return_logprob": True}, 400,
     "logprob_start_len", ["AR"]),  # input-token logprobs of a DLLM
    ("sdar", "/generate", {"input_ids": [1, 2, 3], "max_tokens": 0, "return_logprob": True}, 400,
     "max_tokens", ["AR", "scoring"]),  # scoring a DLLM without logprob_start_len: max_tokens is the problem
    # ---- SGLang's native body ---------------------------------------------------------------------
    ("sdar", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400,
     "sampling_params.max_new_tokens", ["max_new_tokens"]),
    ("sdar", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}, 400,
     "sampling_params.max_new_tokens", ["max_model_len"]),
    ("sdar", "/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params", ["2 prompts"]),
    ("sdar", "/generate", {"text": "hi", "input_ids": [1, 2]}, 400, "input_ids", ["not both"]),
    ("sdar", "/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 0.5}}, 400,
     "sampling_params.frequency_penalty", ["repetition_penalty"]),
    ("sdar", "/generate", {"text": "hi", "sampling_params": {"n": 0}}, 400, "sampling_params.n", ["n"]),
    ("qwen3", "/generate", {"input_ids": [1, 2, 3], "max_tokens": 0, "return_logprob": True,
                            "logprob_start_len": 2}, 400, "logprob_start_len", []),  # nothing left to score
    ("qwen3", "/generate", {"input_ids": [1, 2, 3], "max_tokens": 0, "return_logprob": True,
                            "logprob_start_len": 10**6}, 400, "logprob_start_len", []),
    ("qwen3", "/generate", {"prompt": "some text", "max_tokens": 0, "return_logprob": True,
                            "logprob_start_len": 0}, 400, "input_ids", ["token"]),
    ("qwen3", "/generate", {"input_ids": [1, 2, 3], "max_tokens": 0}, 400, "max_tokens", ["scoring"]),
    ("qwen3", "/generate", {"input_ids": [1, 2, 3, 4], "max_tokens": 0, "logprob_start_len": 1}, 400,
     "return_logprob", []),
    # ---- stop lists: at most 64 strings of at most 1024 characters, 1024 token ids ----------------
    ("sdar", "/generate", {"prompt": "hi", "stop": [f"w{i}" for i in range(5000)]}, 400, "stop", ["64"]),
    ("sdar", "/generate", {"prompt": "hi", "stop": "x" * 2000}, 400, "stop", ["1024"]),
    ("sdar", "/generate", {"prompt": "hi", "stop": ["ok", ""]}, 400, "stop", ["empty"]),
    ("sdar", "/generate", {"prompt": "hi", "stop_token_ids": list(range(5000))}, 400, "stop_token_ids", ["1024"]),
    ("sdar", "/generate", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", []),
    ("sdar", "/generate", {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids", ["vocab"]),
    # ---- /v1/completions -------------------------------------------------------------------------
    ("qwen3", "/v1/completions", {}, 400, "prompt", []),
    ("qwen3", "/v1/completions", {"prompt": 5}, 400, "prompt", []),
    ("qwen3", "/v1/completions", {"prompt": []}, 400, "prompt", ["empty"]),
    ("qwen3", "/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt", ["empty"]),
    ("qwen3", "/v1/completions", {"prompt": [3, 10**7]}, 400, "prompt", ["vocabulary"]),
    ("qwen3", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", []),
    ("qwen3", "/v1/completions", {"prompt": "hi", "max_tokens": 10**6, "stream": True}, 400, "max_tokens",
     ["max_model_len"]),
    ("qwen3", "/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400, "logprobs", []),
    ("sdar", "/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo",
     ["not autoregressive", "block diffusion"]),
    ("qwen3", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", []),
    ("qwen3", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", []),
    ("qwen3", "/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", []),
    ("qwen3", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias", []),
    ("qwen3", "/v1/completions", {"prompt": "hi", "max_tokens": 10, "min_tokens": 100}, 400, "min_tokens",
     ["max_tokens"]),
    ("qwen3", "/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     400, "stream_options", []),
    ("qwen3", "/v1/completions", raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature", ["finite"]),
    ("qwen3", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", ["gpt-4"]),
    # ---- /v1/chat/completions -----------------------------------------------------------------------
    ("qwen3", "/v1/chat/completions", {}, 400, "messages", []),
    ("qwen3", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", []),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", ["content"]),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages", []),
    ("qwen3", "/v1/chat/completions", raw('{"messages": [{"role": "user", "content": "\\ud83d"}]}'), 400,
     "messages", ["Unicode"]),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", ["logprobs"]),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                       "top_logprobs": 500}, 400, "top_logprobs", []),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "max_completion_tokens": 0}, 400, "max_completion_tokens", []),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6,
                                       "stream": True}, 400, "max_tokens", ["max_model_len"]),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400,
     "tools", ["unknown"]),
]


def _id(i: int, case) -> str:
    app, route, body, status, param, _ = case
    return f"{i:02d}-{app}{route.replace('/', '_')}-{status}-{param or 'body'}"


def send(url: str, body, headers: dict | None = None) -> tuple[int, dict, httpx.Headers]:
    """POST a body (bytes as is, else JSON); a stream's refusal is the plain error JSON too."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    with httpx.stream("POST", url, content=content, headers=headers, timeout=TIMEOUT) as r:
        r.read()
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            return r.status_code, {"events": sse_events(r.text.splitlines())}, r.headers
        return r.status_code, r.json(), r.headers


def test_matrix_is_large_enough():
    assert len(CASES) >= 40
    assert len({_id(i, c) for i, c in enumerate(CASES)}) == len(CASES)


@pytest.mark.parametrize(("app", "route", "body", "status", "param", "words"), CASES,
                         ids=[_id(i, c) for i, c in enumerate(CASES)])
def test_bad_input_is_a_4xx_naming_the_field(served_apps, app, route, body, status, param, words):
    code, err, _ = send(served_apps[app].url + route, body)
    assert code == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param"}, err
    message = err["error"]["message"]
    assert err["error"]["param"] == param, err
    assert message and len(message) < 2000, err  # never echoes a huge input back
    for word in ([param] if param else []) + words:
        assert word in message, (word, err)
    if param is None:
        assert re.search(r"body|JSON", message), err


def test_still_serves_after_bad_input_and_never_answered_5xx(served_apps):
    for name, app in served_apps.items():
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(app.url + "/generate", json=body, timeout=TIMEOUT)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        r = httpx.post(app.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                       timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        metrics = httpx.get(app.url + "/metrics", timeout=TIMEOUT).text
        fivexx = [line for line in metrics.splitlines()
                  if line.startswith("blockserve_requests_total{") and re.search(r'status="5\d\d"', line)]
        assert not fivexx, f"{name} answered 5xx: {fivexx}"


def test_tiny_temperature_samples_as_greedy_instead_of_overflowing(served_apps):
    """0 < temperature < 1e-5 would overflow float32 logits (NaN probabilities); it decodes greedily."""
    for app in served_apps.values():
        body = {"prompt": "Hello world", "max_tokens": 8, "seed": 3}
        greedy = httpx.post(app.url + "/generate", json={**body, "temperature": 0}, timeout=TIMEOUT).json()
        tiny = httpx.post(app.url + "/generate", json={**body, "temperature": 1e-300}, timeout=TIMEOUT)
        assert tiny.status_code == 200, tiny.text
        assert tiny.json()["output_ids"] == greedy["output_ids"]


# ---- property-based fuzzing of /generate ---------------------------------------------------------------
FIELDS = ["prompt", "input_ids", "max_tokens", "stream", "return_logprob", "logprob_start_len", "top_logprobs_num",
          "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "stop_token_ids",
          "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "return_step_trace"]

weird_text = st.one_of(st.text(max_size=12), st.sampled_from(["", "\ud800", "\x00", "<|MASK|>", "<|endoftext|>",
                                                               "é" * 50, "🙂", "\\", '"']))
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), weird_text)
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(weird_text, c, max_size=3),
                          max_leaves=12)
small_ints = st.integers(-3, 6)
ids = st.lists(st.integers(-2, 400), min_size=0, max_size=12)
plausible = {
    "prompt": st.one_of(weird_text, st.just("Hello there")),
    "input_ids": st.one_of(ids, st.lists(st.integers(0, 300), min_size=1, max_size=10)),
    "max_tokens": st.one_of(small_ints, st.sampled_from([0, 10**9, 2**63, MAX_LEN])),
    "stream": st.booleans(),
    "return_logprob": st.booleans(),
    "logprob_start_len": st.one_of(small_ints, st.sampled_from([-1, 10**6])),
    "top_logprobs_num": st.one_of(small_ints, st.sampled_from([100, 101, 10**9])),
    "temperature": st.one_of(st.floats(-1, 5), st.sampled_from([0.0, 1e-300, 1e-6, 1e300])),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.one_of(small_ints, st.sampled_from([383, 384, 10**6])),
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.one_of(st.floats(-1, 3), st.sampled_from([1e-300, 0.01, 100.0, 1e9])),
    "seed": st.one_of(st.integers(-5, 2**64), st.none()),
    "stop": st.one_of(weird_text, st.lists(weird_text, max_size=5), st.none()),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 500), max_size=4), st.none()),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "return_step_trace": st.booleans(),
}
# a field's value: usually plausible, sometimes any JSON at all; sometimes a field nobody knows
field_value = {k: st.one_of(v, v, v, json_value) for k, v in plausible.items()}
bodies = st.one_of(
    st.fixed_dictionaries({}, optional={**field_value, "bogus": json_value}),
    st.fixed_dictionaries({"prompt": st.just("Hi there")},
                          optional={k: v for k, v in field_value.items() if k != "prompt"}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 300), min_size=2, max_size=8)},
                          optional={k: v for k, v in field_value.items() if k != "input_ids"}),
    json_value,
)


@settings(max_examples=60, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(app=st.sampled_from(["sdar", "qwen3"]), body=bodies)
def test_fuzz_generate_never_5xx(served_apps, app, body):
    content = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals included
    url = served_apps[app].url + "/generate"
    with httpx.stream("POST", url, content=content, headers={"content-type": "application/json"},
                      timeout=TIMEOUT) as r:
        r.read()
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text.splitlines())
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] in ("stop", "length"), events[-2]
    elif r.status_code == 200:
        assert r.json()["meta_info"]["finish_reason"]["type"] in ("stop", "length"), r.text[:500]
    else:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param"} and err["message"], err
        assert err["param"] is None or isinstance(err["param"], str)


openai_fields = {
    "model": st.one_of(st.just("qwen3"), weird_text), "max_tokens": plausible["max_tokens"],
    "temperature": plausible["temperature"], "top_p": plausible["top_p"], "seed": plausible["seed"],
    "stop": plausible["stop"], "n": small_ints, "stream": st.booleans(), "logprobs": json_value,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_value),
    "min_tokens": small_ints, "presence_penalty": st.floats(-1, 1), "echo": st.booleans(), "user": json_value,
    "top_logprobs": st.one_of(small_ints, json_value), "max_completion_tokens": plausible["max_tokens"],
}
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
     "content": st.one_of(weird_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": weird_text}),
                                               max_size=2), json_value)}), max_size=3)
openai_bodies = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": st.one_of(weird_text, plausible["input_ids"], st.lists(plausible["input_ids"], max_size=2))},
        optional={k: st.one_of(v, v, json_value) for k, v in openai_fields.items()})),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": messages}, optional={k: st.one_of(v, v, json_value) for k, v in openai_fields.items()})),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), json_value),
)


@settings(max_examples=40, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=openai_bodies)
def test_fuzz_openai_routes_never_5xx(served_apps, case):
    route, body = case
    content = json.dumps(body, allow_nan=True).encode()
    with httpx.stream("POST", served_apps["qwen3"].url + route, content=content,
                      headers={"content-type": "application/json"}, timeout=TIMEOUT) as r:
        r.read()
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text.splitlines())
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    elif r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param"} and err["message"], err


def test_health_after_fuzzing(served_apps):
    for app in served_apps.values():
        r = httpx.get(app.url + "/health", timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
