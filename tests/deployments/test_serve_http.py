"""HTTP over loopback against a real local Ray Serve cluster (docs/api.md)."""

from __future__ import annotations

import httpx
import pytest

from configs import EngineConfig, GenerationConfig
from deployments.sglang.serving import fold_cumulative_chunks
from engine.offline import pipeline
from tests.support.http import close_as_json, sse_events, without_ids
from tests.support.serve import wait_idle

TIMEOUT = 120


def post(url: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT, **kw)
    return httpx.post(url, json=body, timeout=TIMEOUT, **kw)


def stream(url: str, body: dict, **kw) -> tuple[int, list]:
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT, **kw) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.status_code, sse_events(r.iter_lines())


def split_done(events: list) -> list[dict]:
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    return events[:-1]


GENERATE_CASES = [
    ("sdar", {"prompt": "Hello world", "max_tokens": 24, "temperature": 0.8, "seed": 7, "return_logprob": True,
              "top_logprobs_num": 3, "return_step_trace": True}),
    ("sdar", {"input_ids": [40, 41, 42, 43, 44, 45, 46], "max_tokens": 17, "temperature": 0}),
    ("qwen3", {"prompt": "1 + 1 = 2, 2 + 2 =", "max_tokens": 16, "temperature": 0, "return_logprob": True,
               "top_logprobs_num": 2, "logprob_start_len": 1}),
]


@pytest.mark.parametrize(("app", "body"), GENERATE_CASES, ids=["sdar-sampled-trace", "sdar-ids", "qwen3-logprobs"])
def test_generate_unary_and_sse_deltas_concatenate(served_apps, app, body):
    url = served_apps[app].url + "/generate"
    r = post(url, body)
    assert r.status_code == 200, r.text
    unary = r.json()
    mi = unary["meta_info"]
    n = len(unary["output_ids"])
    assert n == mi["completion_tokens"] > 0
    assert mi["finish_reason"]["type"] in ("stop", "length")
    if app == "sdar":
        assert len(mi["step_map"]) == n and min(mi["step_map"]) >= 1
    else:
        assert mi["step_map"] is None
    if body.get("return_logprob"):
        assert [row[1] for row in mi["output_token_logprobs"]] == unary["output_ids"]
        assert all(len(rows) == body["top_logprobs_num"] for rows in mi["output_top_logprobs"])
    else:
        assert mi["output_token_logprobs"] is None and mi["output_top_logprobs"] is None
    if body.get("logprob_start_len", -1) >= 0:
        assert len(mi["input_token_logprobs"]) == mi["prompt_tokens"] - body["logprob_start_len"] - 1
    else:
        assert mi["input_token_logprobs"] is None
    if body.get("return_step_trace"):
        events = mi["step_trace"]
        assert sorted(p for e in events for p in e["positions"]) == list(range(n))
    else:
        assert mi["step_trace"] is None

    status, events = stream(url, {**body, "stream": True})
    assert status == 200
    chunks = split_done(events)
    assert len(chunks) > 1
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    # SGLang's cumulative chunks: each holds everything so far (the step trace: its own events)
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
    assert without_ids(fold_cumulative_chunks(chunks)) == without_ids(unary)
    if not body.get("return_step_trace"):
        assert without_ids(chunks[-1]) == without_ids(unary)


def _flat(url: str, body: dict) -> dict:
    r = post(url, body)
    assert r.status_code == 200, r.text
    return without_ids(r.json())


# A logprob moves in its last float32 bits with what else shares the forward and with whether its
# prompt's K/V came from the prefix cache: n=3 samples batched together differ from the same seeds
# run one by one by up to 8.6e-6 on the tiny SDAR checkpoint. A defect moves a token or a logprob by
# orders of magnitude more.
LOGPROB_TOL = 1e-4


def _merged_by_index(events: list) -> dict[int, dict]:
    by_index: dict[int, list] = {}
    for d in split_done(events):
        by_index.setdefault(d.pop("index"), []).append(d)
    return {i: without_ids(fold_cumulative_chunks(ds)) for i, ds in by_index.items()}


def test_sglang_native_bodies_equal_flat_ones(served_apps):
    """SGLang's native /generate body: one prompt answers the flat body; a batch (text or input_ids
    lists, per-prompt sampling_params) and n > 1 answer a list in order with `index`; streamed, the
    last (cumulative) chunk of each index is the same body."""
    url = served_apps["sdar"].url + "/generate"
    sp = {"max_new_tokens": 12, "temperature": 0.8, "seed": 7, "stop": ["zz"]}
    flat = {"max_tokens": 12, "temperature": 0.8, "seed": 7, "stop": ["zz"], "return_logprob": True,
            "top_logprobs_num": 2}
    logprob = {"return_logprob": True, "top_logprobs_num": 2}
    prompts = ["Hello world", "23+58="]
    want = [_flat(url, {**flat, "prompt": p}) for p in prompts]

    r = post(url, {"text": prompts[0], "sampling_params": sp, **logprob})
    assert r.status_code == 200
    close_as_json(without_ids(r.json()), want[0], LOGPROB_TOL)  # one prompt: the flat body, no list
    batch = {"text": prompts, "sampling_params": [sp, sp], **logprob}
    r = post(url, batch)
    assert r.status_code == 200, r.text
    bodies = r.json()
    assert [b.pop("index") for b in bodies] == [0, 1]
    close_as_json([without_ids(b) for b in bodies], want, LOGPROB_TOL)
    status, events = stream(url, {**batch, "stream": True})
    assert status == 200
    close_as_json(_merged_by_index(events), dict(enumerate(want)), LOGPROB_TOL)

    ids = [[40, 41, 42, 43, 44], [50, 51, 52]]
    r = post(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 9, "temperature": 0}})
    assert [without_ids(b) for b in r.json()] == [
        _flat(url, {"input_ids": i, "max_tokens": 9, "temperature": 0}) | {"index": k} for k, i in enumerate(ids)]

    # n samples: seeds seed, seed + 1, ... in order; the flat body's n does the same
    samples = [_flat(url, {**flat, "prompt": prompts[0], "seed": 7 + j}) | {"index": j} for j in range(3)]
    assert len({tuple(b["output_ids"]) for b in samples}) > 1
    r = post(url, {"text": prompts[0], "sampling_params": {**sp, "n": 3}, **logprob})
    close_as_json([without_ids(b) for b in r.json()], samples, LOGPROB_TOL)
    flat_n = post(url, {**flat, "prompt": prompts[0], "n": 3}).json()
    close_as_json([without_ids(b) for b in flat_n], samples, LOGPROB_TOL)
    status, events = stream(url, {"text": prompts[0], "sampling_params": {**sp, "n": 3}, "stream": True, **logprob})
    assert status == 200
    close_as_json(_merged_by_index(events), {j: {k: v for k, v in b.items() if k != "index"}
                                             for j, b in enumerate(samples)}, LOGPROB_TOL)


def test_scoring_over_http_matches_in_process_engine(served_apps):
    app = served_apps["qwen3"]
    with pipeline(app.model, EngineConfig(**app.engine)) as pipe:
        ids = list(pipe.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False))
        ref = pipe(ids, gen_config=GenerationConfig(max_new_tokens=0, logprob_start_len=3, logprobs=4))
    body = {"input_ids": ids, "max_tokens": 0, "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 4}
    r = post(app.url + "/generate", body)
    assert r.status_code == 200, r.text
    unary = r.json()
    mi = unary["meta_info"]
    assert unary["output_ids"] == [] and unary["text"] == "" and mi["completion_tokens"] == 0
    rows = mi["input_token_logprobs"]
    assert len(rows) == len(ids) - 4
    assert [t for _, t, _ in rows] == ids[4:] == [t for _, t in ref.input_token_logprobs]
    assert [v for v, _, _ in rows] == pytest.approx([v for v, _ in ref.input_token_logprobs], abs=1e-5)
    assert [[t for _, t, _ in row] for row in mi["input_top_logprobs"]] == \
        [[t for _, t in row] for row in ref.input_top_logprobs]

    status, events = stream(app.url + "/generate", {**body, "stream": True})
    deltas = split_done(events)
    assert status == 200 and len(deltas) == 1  # one terminal payload
    assert without_ids(deltas[0]) == without_ids(unary)


def _merge_openai(chunks: list[dict], chat: bool) -> dict:
    text, step_map, logprobs, finish, usage = "", None, [], None, None
    for c in chunks:
        if c.get("usage"):
            usage = c["usage"]
        for choice in c["choices"]:
            text += choice["delta"].get("content", "") if chat else choice["text"]
            if choice.get("step_map") is not None:
                step_map = (step_map or []) + choice["step_map"]
            if choice["logprobs"]:
                logprobs += choice["logprobs"]["content"] if chat else choice["logprobs"]["token_logprobs"]
            finish = choice["finish_reason"] or finish
    return {"text": text, "step_map": step_map, "logprobs": logprobs, "finish_reason": finish, "usage": usage}


def test_openai_completions_stream(served_apps):
    url = served_apps["sdar"].url + "/v1/completions"
    body = {"model": "sdar", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "logprobs": 2}
    r = post(url, body)
    assert r.status_code == 200, r.text
    unary = r.json()
    choice = unary["choices"][0]
    assert unary["object"] == "text_completion" and unary["model"] == "sdar"
    n = unary["usage"]["completion_tokens"]
    assert len(choice["step_map"]) == n == len(choice["logprobs"]["tokens"])
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])

    status, events = stream(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = split_done(events)
    assert status == 200 and all(c["object"] == "text_completion" for c in chunks)
    merged = _merge_openai(chunks, chat=False)
    assert merged["text"] == choice["text"]
    assert merged["step_map"] == choice["step_map"]
    assert merged["logprobs"] == choice["logprobs"]["token_logprobs"]
    assert merged["finish_reason"] == choice["finish_reason"]
    assert merged["usage"] == unary["usage"] and chunks[-1]["choices"] == []


def test_openai_chat_stream(served_apps):
    app = served_apps["qwen3"]
    url = app.url + "/v1/chat/completions"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = post(url, body)
    assert r.status_code == 200, r.text
    unary = r.json()
    choice = unary["choices"][0]
    assert unary["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["step_map"] is None  # AR model
    assert len(choice["logprobs"]["content"]) == unary["usage"]["completion_tokens"]
    with pipeline(app.model, EngineConfig(**app.engine)) as pipe:
        prompt = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert unary["usage"]["prompt_tokens"] == len(pipe.tokenizer.encode(prompt, add_special_tokens=False))

    status, events = stream(url, {**body, "stream": True})
    chunks = split_done(events)
    assert status == 200 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    merged = _merge_openai(chunks, chat=True)
    assert merged["text"] == choice["message"]["content"]
    assert merged["logprobs"] == choice["logprobs"]["content"]
    assert merged["finish_reason"] == choice["finish_reason"]


def test_models_and_health(served_apps):
    for name, app in served_apps.items():
        models = httpx.get(app.url + "/v1/models", timeout=TIMEOUT).json()
        assert models["object"] == "list" and models["data"][0]["id"] == name
        health = httpx.get(app.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(served_apps["qwen3"].url + "/health", timeout=TIMEOUT).json()["engine_replicas"] == 2


BAD_INPUTS = [
    ("sdar", "/generate", b'{"prompt": "hi", ', 400, None),
    ("sdar", "/generate", b"\xff\xfe{}", 400, None),
    ("sdar", "/generate", b"[1, 2]", 400, None),
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("sdar", "/generate", {"prompt": "hi", "bogus": 1}, 400, "bogus"),
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("sdar", "/generate", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("sdar", "/generate", {"prompt": ""}, 400, "prompt"),
    ("sdar", "/generate", {}, 400, "prompt"),
    ("sdar", "/generate", {"input_ids": [1, 10**9]}, 400, "input_ids"),
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("sdar", "/generate", {"prompt": "hi", "max_tokens": 100000, "stream": True}, 400, "max_tokens"),
    ("sdar", "/generate", {"input_ids": [1, 2, 3], "max_tokens": 0, "return_logprob": True,
                           "logprob_start_len": 0}, 400, "logprob_start_len"),
    ("qwen3", "/generate", {"input_ids": [1, 2, 3], "max_tokens": 0, "return_logprob": True,
                            "logprob_start_len": 2}, 400, "logprob_start_len"),
    ("qwen3", "/v1/completions", {"prompt": "hi", "n": 65}, 400, "n"),
    ("qwen3", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("qwen3", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("qwen3", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
]


@pytest.mark.parametrize(("app", "route", "body", "status", "param"), BAD_INPUTS,
                         ids=[f"{i}-{c[1]}-{c[4]}" for i, c in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_4xx_naming_the_field(served_apps, app, route, body, status, param):
    url = served_apps[app].url + route
    r = post(url, body) if isinstance(body, bytes) or not body.get("stream") else None
    if r is None:
        code, events = stream(url, body)
        r_status, err = code, events[0]
    else:
        r_status, err = r.status_code, r.json()
    assert r_status == status, err
    assert set(err["error"]) == {"message", "type", "param"}
    assert err["error"]["param"] == param
    assert err["error"]["message"]
    if param is not None:
        assert param in err["error"]["message"]


def test_unknown_route_and_method_use_the_error_shape(served_apps):
    base = served_apps["sdar"].url
    r = httpx.get(base + "/nope", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = httpx.get(base + "/generate", timeout=TIMEOUT)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param"}


def test_oversized_body_is_413_and_server_still_serves(served_apps):
    url = served_apps["sdar"].url + "/generate"
    r = post(url, b'{"prompt": "' + b"a" * (1 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    ok = post(url, {"prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4


@pytest.mark.parametrize("app", ["sdar", "qwen3"])
def test_disconnect_mid_stream_frees_pages(served_apps, app):
    start = wait_idle(app)
    assert start["running"] + start["waiting"] == 0
    max_tokens = 480
    body = {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "temperature": 3.0, "seed": 1,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served_apps[app].url + "/generate", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first delta: closing the response drops the connection
    end = wait_idle(app)  # aborted, or (the defect) run to completion: the token count tells which
    assert end["running"] + end["waiting"] == 0, "the aborted request is still in the engine"
    leaked = start["kv_pages_free"] - end["kv_pages_free"]
    assert leaked == 0, f"KV pages leaked: {leaked}"
    assert end["generated_tokens"] - start["generated_tokens"] < max_tokens, \
        "the request ran to completion instead of being aborted"
