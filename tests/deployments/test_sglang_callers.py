"""The RL trainers that drive SGLang over HTTP, against a running server: their own request bodies
(copied as data from their sources, file and line named at each) succeed and, parsed the way each
trainer parses them, give the same tokens, logprobs and finish reasons as the unary greedy answer.
Where the caller's own code installs without its heavy tree it runs itself: sglang's bench_serving,
sglang-router and AReaL's SGLangBackend (each skipped when not installed). Also SGLang's own field
names (accepted at their defaults, refused naming the field otherwise) and SGLang's server routes."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.http import sse_events
from tests.support.ports import free_port
from tests.support.serve import engine_totals

TIMEOUT = 120
PROMPT = [40, 41, 42, 43, 44, 45, 46]
MAX_NEW = 12
REFERENCE = {"input_ids": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "return_logprob": True}


def _reference(url: str) -> tuple[list[int], list[float], str]:
    body = httpx.post(url + "/generate", json=REFERENCE, timeout=TIMEOUT).json()
    rows = body["meta_info"]["output_token_logprobs"]
    assert all(len(row) == 3 and row[2] is None for row in rows)  # SGLang's [logprob, token_id, text]
    return [r[1] for r in rows], [r[0] for r in rows], body["meta_info"]["finish_reason"]["type"]


# slime/rollout/sglang_rollout.py (THUDM/slime 624b824a), lines 95-107: GenerateState.sampling_params,
# with rollout args at their defaults and greedy decoding; line 322 adds `sampling_seed` per sample.
SLIME_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_NEW, "stop": None,
                  "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                  "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True},
                  "sampling_seed": 1234}
# lines 176-179 and 191: the payload of `generate`
SLIME_ROLLOUT = {"sampling_params": SLIME_SAMPLING, "return_logprob": True, "input_ids": PROMPT}
# slime/rollout/sglang_streaming_rollout.py, lines 71-75 and 84: the streaming rollout's payload
SLIME_STREAMING = {"sampling_params": SLIME_SAMPLING, "return_logprob": True, "stream": True, "input_ids": PROMPT}
# areal/engine/sglang_remote.py (inclusionAI/AReaL 4aef98d8), lines 56-75: `agenerate`'s payload for a
# text-only request (gconfig defaults: top_k 1e8, greedy), `image_data` None; AReaL's bridge sends [].
AREAL_GENERATE = {"input_ids": PROMPT, "image_data": None,
                  "sampling_params": {"top_p": 1.0, "top_k": 100_000_000, "max_new_tokens": MAX_NEW,
                                      "temperature": 0.0, "stop_token_ids": [], "ignore_eos": False,
                                      "skip_special_tokens": True, "frequency_penalty": 0.0},
                  "return_logprob": True, "stream": False}
# verl/workers/rollout/sglang_rollout/async_sglang_server.py (volcengine/verl b178a3cd), lines 436-443:
# the request of `generate` (`rid`, `image_data` None), with sampling params as verl's rollout config
# writes them, nulls included.
VERL_GENERATE = {"rid": "verl-request-1", "input_ids": PROMPT, "return_logprob": True, "image_data": None,
                 "logprob_start_len": None, "top_logprobs_num": None,
                 "sampling_params": {"temperature": 0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_NEW,
                                     "min_new_tokens": None, "repetition_penalty": 1.0, "stop": None,
                                     "n": 1, "ignore_eos": False}}


# sglang/benchmark/serving.py (sglang 0.5.23 on PyPI; `python -m sglang.bench_serving --backend sglang`),
# lines 700-716: `async_request_sglang_generate`'s payload with the benchmark's defaults (random token
# prompts, streamed, ignore_eos); test_sglang_bench_serving_against_the_app runs the client itself.
BENCH_SERVING = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW,
                                                          "ignore_eos": True},
                 "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
                 "logprob_start_len": -1}


def _slime(body: dict) -> tuple[list[int], list[float], str]:
    """slime's parse (sglang_rollout.py lines 206-208): item[1] the token, item[0] its logprob."""
    meta = body["meta_info"]
    return ([item[1] for item in meta["output_token_logprobs"]], [item[0] for item in meta["output_token_logprobs"]],
            meta["finish_reason"]["type"])


def _verl(body: dict) -> tuple[list[int], list[float], str]:
    """verl's parse (async_sglang_server.py lines 454-456): three values per row."""
    log_probs, token_ids = zip(*[(lp, t) for lp, t, _ in body["meta_info"]["output_token_logprobs"]], strict=True)
    return list(token_ids), list(log_probs), body["meta_info"]["finish_reason"]["type"]


def _same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] == pytest.approx(want[1], abs=1e-5)


def test_trainer_rollout_bodies_give_the_greedy_answer(served_apps):
    url = served_apps["sdar"].url
    want = _reference(url)
    for body in (SLIME_ROLLOUT, AREAL_GENERATE, AREAL_GENERATE | {"image_data": []}, VERL_GENERATE):
        r = httpx.post(url + "/generate", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, (body, r.text)
        _same(_slime(r.json()), want)
        _same(_verl(r.json()), want)
    assert httpx.post(url + "/generate", json=VERL_GENERATE, timeout=TIMEOUT).json()["meta_info"]["id"] == \
        VERL_GENERATE["rid"]
    # slime's streaming rollout replaces its state with each (cumulative) chunk
    # (sglang_streaming_rollout.py lines 118-136)
    with httpx.stream("POST", url + "/generate", json=SLIME_STREAMING, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        state: dict = {}
        for line in r.iter_lines():
            data = line[len("data:"):].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                chunk = json.loads(data)
                state = {"text": chunk.get("text", ""), "parsed": _slime(chunk) if chunk["meta_info"]["finish_reason"]
                         else None, "tokens": [i[1] for i in chunk["meta_info"]["output_token_logprobs"]]}
    _same(state["parsed"], want)
    assert state["tokens"] == want[0]


def test_bench_serving_stream_counts_what_the_server_generated(served_apps):
    """bench_serving's parse (serving.py lines 744-783): each chunk's `text` replaces the text so far,
    `meta_info.completion_tokens` is the output length so far; the last chunk's equal the unary answer."""
    url = served_apps["sdar"].url
    unary = httpx.post(url + "/generate", json=BENCH_SERVING | {"stream": False}, timeout=TIMEOUT).json()
    generated_text, output_len, counts = "", 0, []
    with httpx.stream("POST", url + "/generate", json=BENCH_SERVING, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            data = line[6:] if line.startswith("data: ") else line
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk["text"]:
                generated_text, output_len = chunk["text"], chunk["meta_info"]["completion_tokens"]
                counts.append(output_len)
    assert counts == sorted(counts) and output_len == len(unary["output_ids"]) == MAX_NEW
    assert generated_text == unary["text"]


def test_explicit_nulls_and_lax_types_are_sglang_defaults(served_apps):
    url = served_apps["sdar"].url
    nulls = {"input_ids": PROMPT, "return_logprob": None, "logprob_start_len": None, "stream": None,
             "sampling_params": {"max_new_tokens": None, "temperature": 0, "stop": None, "top_k": None}}
    r = httpx.post(url + "/generate", json=nulls, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["output_token_logprobs"] is None  # return_logprob null: off
    assert len(r.json()["output_ids"]) == 128 or r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    lax = {"input_ids": PROMPT, "return_logprob": "true", "logprob_start_len": "-1", "top_logprobs_num": "2",
           "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = httpx.post(url + "/generate", json=lax, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert [row[1] for row in meta["output_token_logprobs"]] == r.json()["output_ids"]
    assert all(isinstance(row[2], str) for row in meta["output_token_logprobs"])  # text with the rows
    assert all(len(top) == 2 and all(len(e) == 3 for e in top) for top in meta["output_top_logprobs"])


@pytest.mark.parametrize(("body", "param"), [
    ({"input_ids": PROMPT, "lora_path": "adapter"}, "lora_path"),
    ({"input_ids": PROMPT, "image_data": "http://example.com/cat.png"}, "image_data"),
    ({"input_ids": PROMPT, "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": PROMPT, "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"input_ids": PROMPT, "sampling_params": {"not_a_field": 1}}, "sampling_params.not_a_field"),
    ({"input_ids": PROMPT, "not_a_field": 1}, "not_a_field"),
    ({"input_ids": [], "sampling_params": [{}]}, "input_ids"),
    ({"text": "hi", "sampling_params": {"sampling_seed": 1, "seed": 2}}, "sampling_params.seed"),
])
def test_features_it_lacks_and_unknown_names_are_400_naming_the_field(served_apps, body, param):
    r = httpx.post(served_apps["sdar"].url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_sglang_defaults_of_unsupported_fields_are_accepted(served_apps):
    """What sglang-router and sglang's bench_serving send with every request, at its defaults."""
    body = {"input_ids": PROMPT, "model": None, "return_text_in_logprobs": False, "log_metrics": True,
            "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
            "return_entropy": False, "lora_path": None, "return_routed_experts": False, "logprob_start_len": -1,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(served_apps["sdar"].url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4


def _slime_discovers(info: dict) -> None:
    """slime's external-engine discovery (slime/backends/sglang_utils/external.py, THUDM/slime 624b824a,
    lines 29-43 and 86-118) and server-args check (sglang_engine.py lines 157-168 with the fields of
    `_compute_server_args`, lines 527-573, that `_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS` does not skip, for a
    regular worker without --offload-rollout)."""
    pp_size = int(info.get("pp_size") or info.get("pipeline_parallel_size") or 1)
    tp_size = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
    assert int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp_size * pp_size) == tp_size == 1
    assert not info.get("encoder_only") and info.get("disaggregation_mode") not in ("prefill", "decode")
    assert info.get("disaggregation_bootstrap_port") is None
    assert int(info.get("ep_size") or info.get("expert_parallel_size") or 1) == 1
    assert int(info.get("moe_dp_size") or info.get("moe_data_parallel_size") or 1) == 1
    for name, expected in {"enable_memory_saver": False}.items():
        assert info.get(name) == expected, name


def test_server_and_model_info(served_apps):
    app = served_apps["qwen3"]  # two engine replicas
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(app.url + path, timeout=TIMEOUT).json()
        assert info["model_path"] == app.model and info["tp_size"] == 1 and info["dp_size"] == 2
        assert info["context_length"] == app.engine["max_model_len"] and info["max_total_num_tokens"] > 0
        assert info["incremental_streaming_output"] is False and "weight_version" in info
        # per replica: how its forwards run, and why CUDA graphs do not replay here
        assert [s["model_type"] for s in info["internal_states"]] == ["qwen3", "qwen3"]
        for state in info["internal_states"]:
            assert state["attention_backend"] == "torch" and state["cuda_graphs"]["state"] == "off"
            assert "the device is cpu, not CUDA" in state["cuda_graphs"]["why"]
        _slime_discovers(info)
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(app.url + path, timeout=TIMEOUT).json()
        assert info["model_path"] == app.model and info["is_generation"] is True
        assert info["model_type"] == "qwen3" and info["weight_version"] == "default"
    assert httpx.get(app.url + "/health_generate", timeout=TIMEOUT).status_code == 200


# The abort-all bodies: slime/backends/sglang_utils/server_control.py (THUDM/slime 624b824a) line 34, and
# verl/workers/rollout/sglang_rollout/http_server_engine.py (verl 0.9.1 on PyPI) lines 564-574, which
# sends the default rid "" with it. The abort by rid is slime/agent/adapters/common.py line 508.
@pytest.mark.parametrize("abort_all", [{"abort_all": True}, {"rid": "", "abort_all": True}], ids=["slime", "verl"])
def test_abort_request_by_rid_and_all(served_apps, abort_all):
    url = served_apps["sdar"].url
    long = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}

    async def stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> dict:
        async with client.stream("POST", url + "/generate", json=body) as r:
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                started.set()
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        return events[-2]

    async def main() -> list:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            events = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.ensure_future(stream(client, long | {"rid": f"abort-me-{i}"}, e))
                     for i, e in enumerate(events)]
            await asyncio.gather(*(e.wait() for e in events))
            one = (await client.post(url + "/abort_request", json={"rid": "abort-me-0"})).json()
            first = await tasks[0]
            rest = (await client.post(url + "/abort_request", json=abort_all)).json()
            return [one, first, rest, *await asyncio.gather(*tasks[1:])]

    one, first, rest, *others = asyncio.run(main())
    assert one["success"] is True and one["requests"] == 1
    assert rest["success"] is True and rest["requests"] >= 1
    for last in (first, *others):
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(last["output_ids"]) < 400


def test_verl_adapter_memory_and_cache_calls(served_apps):
    """verl's HTTP adapter (verl/workers/rollout/sglang_rollout/http_server_engine.py, verl 0.9.1 on PyPI):
    `release_memory_occupation` / `resume_memory_occupation` post `{"tags": tags}` with tags None or a
    list (lines 540-562), `flush_cache` is a GET retried until 200 (lines 507-535); generation after
    them is the greedy answer again."""
    url = served_apps["sdar"].url
    want = _reference(url)
    for tags in (None, ["weights", "kv_cache"]):
        for op in ("release_memory_occupation", "resume_memory_occupation"):
            r = httpx.post(f"{url}/{op}", json={"tags": tags}, timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["success"] is True, (op, tags, r.text)
    assert httpx.get(url + "/flush_cache", timeout=TIMEOUT).status_code == 200
    _same(_reference(url), want)


@pytest.mark.system  # sglang-router in a process of its own
def test_sglang_router_in_front_returns_what_the_app_returns(served_apps, tmp_path):
    """sglang-router (the package trainers put in front of SGLang servers) registers the app as its
    worker and forwards /generate with its own extra fields; the answers equal the app's own."""
    pytest.importorskip("sglang_router")
    app = served_apps["qwen3"]  # two engine replicas behind one ingress
    port = free_port()
    log = (tmp_path / "router.log").open("w")
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                               "--port", str(port), "--worker-urls", app.url, "--policy", "round_robin",
                               "--log-level", "warn", "--worker-startup-timeout-secs", "120"],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "return_logprob": True}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-4000:]
            try:
                r = httpx.post(url + "/generate", json=body, timeout=TIMEOUT)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-4000:]
            time.sleep(1)
        direct = httpx.post(app.url + "/generate", json=body, timeout=TIMEOUT).json()
        for _ in range(2):  # round robin over both replicas behind the ingress: the same answer
            routed = httpx.post(url + "/generate", json=body, timeout=TIMEOUT)
            assert routed.status_code == 200, routed.text
            got = routed.json()
            assert got["output_ids"] == direct["output_ids"] and got["text"] == direct["text"]
            assert got["meta_info"]["finish_reason"] == direct["meta_info"]["finish_reason"]
            assert [r[1] for r in got["meta_info"]["output_token_logprobs"]] == direct["output_ids"]
    finally:
        router.terminate()
        try:
            router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            router.kill()
        log.close()


# sglang.benchmark.serving imports one constant, FAKE_BOOTSTRAP_HOST, from sglang's server runtime
# (sglang/srt/disaggregation/utils.py line 53, used only with --pd-separated). That module imports
# sglang.srt.configs, which imports torchvision (sglang/srt/multimodal/internvl_utils.py line 5), and
# PyPI's torchvision is a CUDA build that does not load on a CPU torch. The launcher gives the constant
# its value and runs sglang's own CLI unchanged.
BENCH_LAUNCHER = """
import runpy, sys, types
runtime = types.ModuleType("sglang.srt.disaggregation.utils")
runtime.FAKE_BOOTSTRAP_HOST = "2.2.2.2"
sys.modules[runtime.__name__] = runtime
sys.argv[0] = "sglang.bench_serving"
runpy.run_module("sglang.bench_serving", run_name="__main__")
"""


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="sglang is not installed (pip install --no-deps sglang==0.5.23, then its client's "
                           "imports; see docs/rl.md)")
def test_sglang_bench_serving_against_the_app(served_apps, tmp_path):
    """`python -m sglang.bench_serving --backend sglang` (sglang's own client, random dataset, streamed,
    ignore_eos) completes every request, and the token counts it reads from the server's chunks are what
    was asked and what the engines generated (warm-up request included)."""
    app = served_apps["qwen3"]  # AR: one generated token per engine step, so the engine totals count outputs
    num, inp, out = 6, 12, 8
    before = engine_totals("qwen3")["generated_tokens"]
    result, conversations = tmp_path / "bench.jsonl", tmp_path / "sharegpt.json"
    # the random dataset cuts its prompts from ShareGPT conversations; a local file in that format
    # keeps the run offline
    conversations.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"question {i} " * 9},
                                                            {"from": "gpt", "value": f"answer {i}"}]}
                                         for i in range(num)]))
    run = subprocess.run(
        [sys.executable, "-c", BENCH_LAUNCHER, "--backend", "sglang", "--base-url", app.url, "--model", app.model,
         "--tokenizer", app.model, "--dataset-name", "random", "--dataset-path", str(conversations),
         "--num-prompts", str(num), "--random-input-len", str(inp), "--random-output-len", str(out),
         "--random-range-ratio", "1", "--request-rate", "inf", "--warmup-requests", "1", "--seed", "3",
         "--disable-tqdm", "--output-file", str(result), "--output-details"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    got = json.loads(result.read_text())
    assert got["completed"] == num and got["errors"] == [""] * num, got["errors"]
    assert got["output_lens"] == [out] * num and got["total_output_tokens"] == num * out
    assert all(n > 0 for n in got["input_lens"]) and got["total_input_tokens"] == sum(got["input_lens"])
    assert all(got["generated_texts"])
    assert engine_totals("qwen3")["generated_tokens"] - before == (num + 1) * out


def test_areal_sglang_backend_against_the_app(served_apps, monkeypatch):
    """AReaL's own client code (areal 1.0.4, areal/engine/sglang_remote.py `SGLangBackend`, and the
    sender its RemoteInfEngine uses, areal/infra/utils/http.py `arequest_with_retry`): its generation
    requests (image_data None and []) parse to the greedy answer, its disk update succeeds, and its
    group request (master_port a string) is read field by field (here refused for its world size: this
    app has one replica)."""
    # areal's getLogger swaps in a new logging root and manager on every call; afterwards
    # logging.getLogger would hand this process's later tests loggers that caplog never sees
    monkeypatch.setattr(logging.Logger, "manager", logging.Logger.manager)
    monkeypatch.setattr(logging.Logger, "root", logging.Logger.root)
    remote = pytest.importorskip("areal.engine.sglang_remote", reason="areal is not installed (pip install "
                                 "--no-deps areal==1.0.4, then its client's imports; see docs/rl.md)")
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest, WeightUpdateMeta
    from areal.infra.utils.http import arequest_with_retry

    app = served_apps["sdar"]
    want = _reference(app.url)
    backend = remote.SGLangBackend()
    addr = app.url.removeprefix("http://")  # host:port/prefix: AReaL then sends to http://{addr}{endpoint}

    async def send(request) -> dict:
        return await arequest_with_retry(addr=addr, endpoint=request.endpoint, payload=request.payload,
                                         method=request.method, max_retries=1, timeout=TIMEOUT)

    gconfig = GenerationHyperparameters(max_new_tokens=MAX_NEW, greedy=True)
    for image_data in (None, []):
        request = backend.build_generation_request(ModelRequest(input_ids=PROMPT, gconfig=gconfig,
                                                                image_data=image_data), with_lora=False, version=0)
        assert request.payload["image_data"] == image_data
        result = backend.parse_generation_response(asyncio.run(send(request)))
        _same((result.output_tokens, result.output_logprobs, result.stop_reason), want)
    [update] = backend.build_disk_weight_update_requests(WeightUpdateMeta(type="disk", path=app.model)).requests
    answer = asyncio.run(send(update))
    assert answer["success"] is True and update.payload["abort_all_requests"] is True, answer
    meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str("sglang:d2"),
                            nccl_master_address="127.0.0.1", nccl_master_port=29500, nccl_group_name="areal")
    group = backend.build_init_weights_group_request(addr, 0, meta)
    assert group.payload["master_port"] == "29500" and group.payload["world_size"] == 3
    r = httpx.post(app.url + group.endpoint, json=group.payload, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "world_size", r.text
    _same(_reference(app.url), want)  # the same weights after the update
