"""`blockserve serve`: the presets and serve_config.yaml build the same app args; the command serves a
shipped model on a Ray cluster named by RAY_ADDRESS (its own port) and answers a scoring request; a
Hugging Face model id found in a local HF cache loads with the network off."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from configs import EngineConfig
from configs.reference import reference
from deployments.app import AppArgs
from deployments.cli import app_args, build_parser
from tests.support.paths import BLOCKSERVE, ROOT
from tests.support.ports import free_port
from tests.support.processes import stop_process, wait_healthy


def cli_args(*argv: str) -> dict:
    return app_args(build_parser().parse_args(["serve", *argv]))


def test_presets_and_serve_config_build_the_same_args():
    serve_config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    assert serve_config["name"] == "blockserve" and serve_config["import_path"] == "deployments.app:build_app"
    assert cli_args("--config", "configs/sdar-tiny.yaml") == serve_config["args"]
    assert cli_args("--config", "serve_config.yaml") == serve_config["args"]
    for preset in ("sdar-tiny", "qwen3-tiny"):
        args = AppArgs.model_validate(cli_args("--config", f"configs/{preset}.yaml"))
        EngineConfig(**args.engine)
        assert Path(args.model).name == preset and (ROOT / args.model).is_dir()
    assert EngineConfig(**cli_args("--config", "configs/qwen3-tiny.yaml")["engine"]).logprobs_mode == "raw_logprobs"
    # MODEL and flags override the preset; every EngineConfig field is a kebab-case flag
    args = cli_args("other/model", "--config", "configs/qwen3-tiny.yaml", "--tp", "2", "--no-enable-prefix-caching",
                    "--num-kv-blocks", "0.5", "--logprobs-mode", "none", "--served-model-name", "m", "--api-key", "k")
    engine = EngineConfig(**args["engine"])
    assert (args["model"], engine.tp, engine.enable_prefix_caching, engine.num_kv_blocks, engine.logprobs_mode) == (
        "other/model", 2, False, 0.5, None)
    assert args["served_model_name"] == "m" and args["ingress"]["api_key"] == "k"
    assert set(cli_args("x")) == {"model"}  # nothing set: the defaults are EngineConfig's and AppArgs'
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "x", "--logprobs-mode", "everything"])


def test_config_reference_is_current():
    """docs/config-reference.md is what `python -m configs.reference` prints for today's models."""
    assert (ROOT / "docs" / "config-reference.md").read_text() == reference(), \
        "regenerate: python -m configs.reference > docs/config-reference.md"


HEAD = """
import sys, time, ray
ctx = ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="error")
print("ADDRESS " + ctx.address_info["address"], flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.system  # a cluster and `blockserve serve` in processes of their own
def test_blockserve_serve_scores_over_http_on_the_cluster_ray_address_names(stop_later):
    """(The server, then the cluster, stop while the module's next tests run.)"""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdout=subprocess.PIPE, text=True, env=env)
    server = None
    try:
        address = next(line for line in head.stdout if line.startswith("ADDRESS ")).split()[1]
        port = free_port()
        server = subprocess.Popen([str(BLOCKSERVE), "serve", "models/qwen3-tiny", "--logprobs-mode", "raw_logprobs",
                                   "--port", str(port), "--num-kv-blocks", "128"], cwd=ROOT,
                                  env={**env, "RAY_ADDRESS": address}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(server, url, "blockserve serve")
        ids = httpx.post(url + "/generate", json={"prompt": "23+58=81", "max_tokens": 1}, timeout=60).json()
        prompt_ids = [*range(40, 46), *ids["output_ids"]]
        body = {"input_ids": prompt_ids, "max_tokens": 0, "return_logprob": True, "logprob_start_len": 0}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        rows = r.json()["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in rows] == prompt_ids[1:] and all(v <= 0 for v, _, _ in rows)  # SGLang triples
        models = httpx.get(url + "/v1/models", timeout=60).json()["data"]
        assert [m["id"] for m in models] == ["qwen3-tiny"] and models[0]["max_model_len"] == 1024
    finally:
        def stop(server: subprocess.Popen | None = server) -> None:
            if server is not None:
                stop_process(server)
            stop_process(head)  # after the server: its Ctrl-C cleanup needs the cluster

        stop_later(stop)


RESOLVE = """
import sys
from engine import GenerationConfig, pipeline
from engine.model.source import resolve_model_path

path = resolve_model_path("blockserve-test/qwen3-tiny")
print("PATH " + path)
with pipeline(path) as pipe:
    print("TEXT " + pipe("23+58=", gen_config=GenerationConfig(max_new_tokens=4)).text)
try:
    resolve_model_path("blockserve-test/not-cached")
except FileNotFoundError as e:
    print("MISSING " + str(e))
"""


def test_model_id_in_a_local_hf_cache_loads_offline(tmp_path):
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--blockserve-test--qwen3-tiny"
    shutil.copytree(ROOT / "models" / "qwen3-tiny", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    assert [r.repo_id for r in scan_cache_dir(cache).repos] == ["blockserve-test/qwen3-tiny"]  # HF's own layout

    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", RESOLVE], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert lines["PATH"] == str(repo / "snapshots" / revision)
    from engine import GenerationConfig, pipeline

    with pipeline(str(ROOT / "models" / "qwen3-tiny")) as pipe:
        assert lines["TEXT"] == pipe("23+58=", gen_config=GenerationConfig(max_new_tokens=4)).text
    assert "HF_HUB_OFFLINE" in lines["MISSING"]
