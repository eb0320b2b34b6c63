"""Trajectory scoring (block diffusion): the logprob of every output token of a rollout at the step
that revealed it, computed without regenerating. Checked against what the engine logged while
generating (1e-5, float32) and against an independent rebuild of every step with Hugging Face
transformers (1e-4), for SDAR and SDAR-MoE, greedy and sampled, every unmasking strategy, stops
inside a block, max_new_tokens cuts, prompts of length B..B+3, and after a weight update."""

from __future__ import annotations

import json

import pytest
import torch

from configs.trajectory import DllmTrajectory
from engine import EngineConfig, GenerationConfig, Response, pipeline
from engine.errors import RequestError
from testing.references.sdar import block_causal_logits
from testing.tiny_checkpoint import load_hf_reference, write_tiny_checkpoint
from tests.support.lm_head import record_lm_head_rows
from tests.support.paths import ROOT
from tests.support.sampling_reference import processed_logprobs
from tests.support.trajectories import scoring_config

B = 4
# Logits of a few units, as a trained model's: float32 rounding then stays far below the tolerances
# (at the sharper DLLM_TEST_LOGIT_SCALE, generation itself is ~2e-5 off HF on unlikely tokens).
LOGIT_SCALE = 4.0
LOGGED_TOL = 1e-5
HF_TOL = 1e-4
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")


def _checkpoint(tmp_path_factory, model_type: str, seed: int) -> tuple[str, object, int]:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(f"{model_type}_{seed}"), model_type=model_type, seed=seed,
                                 logit_scale=LOGIT_SCALE)
    mask_id = json.loads((path / "config.json").read_text())["mask_token_id"]
    return str(path), load_hf_reference(path), mask_id


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return {name: _checkpoint(tmp_path_factory, name, seed) for name, seed in (("sdar", 41), ("sdar_moe", 42))}


def _engine(**kw) -> EngineConfig:
    kw = {"kv_block_size": 4, "num_kv_blocks": 256, **kw}
    return EngineConfig(max_model_len=256, dllm_block_length=B, dllm_confidence_threshold=0.6, **kw)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * n + salt) % 280 + 6 for i in range(n)]


trajectory = DllmTrajectory.from_response  # a rollout's trajectory, as a trainer sends it back


def hf_step_rows(hf, mask_id: int, prompt: list[int], out: Response) -> list[torch.Tensor]:
    """Per output token, the HF logits row of the step that revealed it, each step rebuilt from scratch
    as docs/rollouts.md defines its input (prompt + earlier revealed tokens, mask elsewhere)."""
    n = len(out.token_ids)
    if out.dllm_stop_length is None:
        gen, steps = out.token_ids, out.step_map
    else:
        first = n - out.dllm_stop_length
        gen, steps = out.token_ids[:first] + out.dllm_replay_token_ids, out.step_map[:first] + out.dllm_replay_step_maps
    rows: list[torch.Tensor | None] = [None] * n
    for step in sorted(set(out.step_map)):
        g0 = min(g for g, s in enumerate(steps) if s == step)
        end = ((len(prompt) + g0) // B + 1) * B
        visible = [t if 0 < s < step else mask_id for t, s in zip(gen, steps)]
        logits = block_causal_logits(hf, prompt + visible[: end - len(prompt)], B)
        for g in range(n):
            if steps[g] == step:
                rows[g] = logits[len(prompt) + g]
    return rows


def hf_values(hf, mask_id, prompt, out: Response, sampling: dict | None) -> list[float]:
    """raw_logprobs (sampling None) or processed_logprobs of every output token, from HF."""
    rows = hf_step_rows(hf, mask_id, prompt, out)
    values = []
    for g, (row, tok) in enumerate(zip(rows, out.token_ids)):
        if sampling is None:
            values.append(float(row.log_softmax(-1)[tok]))
            continue
        history = set(prompt) - {mask_id}
        gen = out.token_ids if out.dllm_stop_length is None else (
            out.token_ids[: len(out.token_ids) - out.dllm_stop_length] + out.dllm_replay_token_ids)
        steps = out.step_map if out.dllm_stop_length is None else (
            out.step_map[: len(out.token_ids) - out.dllm_stop_length] + out.dllm_replay_step_maps)
        history |= {t for t, s in zip(gen, steps) if 0 < s < out.step_map[g]}
        values.append(float(processed_logprobs(row, history, sampling)[tok]))
    return values


def rollouts(pipe, prompt_len: int, sampled: bool, strategy: str) -> tuple[list[int], list[GenerationConfig],
                                                                           list[Response]]:
    """A free run, runs that stop inside a block (a stop id at several offsets) and max_new_tokens cuts."""
    prompt = _prompt(prompt_len, salt=3 * sampled)
    base = GenerationConfig(max_new_tokens=17, ignore_eos=True, logprobs=2, return_dllm_replay=True,
                            dllm_unmasking_strategy=strategy, random_seed=11 if sampled else None,
                            **(SAMPLING if sampled else {}))
    free = pipe(prompt, base)
    configs = [base, base.model_copy(update={"max_new_tokens": 10}), base.model_copy(update={"max_new_tokens": 13})]
    for offset in (1, 2):
        g = next((g for g in range(B, len(free.token_ids)) if (prompt_len + g) % B == offset
                  and free.token_ids[g] not in free.token_ids[:g]), None)
        if g is not None:
            configs.append(base.model_copy(update={"stop_token_ids": [free.token_ids[g]]}))
    outs = pipe([prompt] * len(configs), configs)
    return prompt, configs, outs


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.mark.parametrize("model", ["sdar", "sdar_moe"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_scores_equal_logged_and_hf(models, model, strategy, mode):
    path, hf, mask_id = models[model]
    finishes = set()
    with pipeline(path, _engine(logprobs_mode=mode)) as pipe:
        for prompt_len, sampled in ((B, False), (B + 1, True), (B + 2, False), (B + 3, True)):
            prompt, configs, outs = rollouts(pipe, prompt_len, sampled, strategy)
            finishes |= {(o.finish_reason, (prompt_len + len(o.token_ids)) % B != 0) for o in outs}
            scored = pipe([prompt] * len(outs), [scoring_config(o, c) for o, c in zip(outs, configs)])
            for out, got in zip(outs, scored):
                assert got.token_ids == out.token_ids and got.step_map == out.step_map
                assert got.finish_reason == "length" and got.weight_version == "default"
                logged = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
                values = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
                assert _close(values, logged, LOGGED_TOL), (prompt_len, sampled, out.step_map)
                assert [list(lp) for lp in got.logprobs] == [list(lp) for lp in out.logprobs], "same top-2 ids"
                expected = hf_values(hf, mask_id, prompt, out, SAMPLING if sampled and mode != "raw_logprobs" else None)
                assert _close(values, expected, HF_TOL), (prompt_len, sampled)
    assert {("stop", True), ("length", True)} <= finishes, "stops and cuts inside a block"


def test_batch_of_trajectories_shares_the_prompt_and_bounds_the_lm_head(models):
    """n rollouts of one prompt scored in one call: the prompt is computed once (prefix cache), the LM
    head sees at most logprobs_chunk_rows rows per call and one row per output token in all."""
    path, hf, mask_id = models["sdar"]
    prompt = _prompt(2 * B + 16)
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=0, do_sample=True, temperature=1.3,
                           random_seed=5, n=6, return_dllm_replay=True)
    with pipeline(path, _engine(logprobs_mode="raw_logprobs", logprobs_chunk_rows=7, kv_block_size=8)) as pipe:
        outs = pipe(prompt, gen)
        pipe.engine.flush_cache()
        sizes = record_lm_head_rows(pipe)
        before = pipe.engine.kv.prefix_hit_tokens
        one = GenerationConfig(max_new_tokens=0, logprobs=0, do_sample=True, temperature=1.3)
        scored = pipe([prompt] * len(outs), [one.model_copy(update={"dllm_trajectory": trajectory(o)}) for o in outs])
        hits = pipe.engine.kv.prefix_hit_tokens - before
    assert hits >= (len(outs) - 1) * (len(prompt) // 8 * 8 - 8), "the prompt's pages come from the cache"
    scored_rows = [s for s in sizes if s]
    assert max(scored_rows) <= 7 and sum(scored_rows) == sum(len(o.token_ids) for o in outs)
    for out, got in zip(outs, scored):
        assert _close([lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                      [lp[t] for lp, t in zip(out.logprobs, out.token_ids)], LOGGED_TOL)


def test_one_trajectory_scores_in_two_forwards_with_the_automatic_cache_size(models):
    """The automatic KV size leaves room for a forward full of views (their scratch pages), so even a
    lone trajectory with dozens of steps runs as its context prefill plus one forward of views."""
    path, _, _ = models["sdar"]
    gen = GenerationConfig(max_new_tokens=64, ignore_eos=True, logprobs=0, return_dllm_replay=True,
                           dllm_unmasking_strategy="sequential")
    config = EngineConfig(max_model_len=256, max_batch_size=1, dllm_block_length=B, logprobs_mode="raw_logprobs")
    with pipeline(path, config) as pipe:
        out = pipe(_prompt(B + 1), gen)
        pipe.engine.flush_cache()
        before = pipe.engine.stats.forwards
        scored = pipe(_prompt(B + 1), scoring_config(out, gen))
        forwards = pipe.engine.stats.forwards - before
    assert max(out.step_map) == 64 and forwards == 2, forwards
    assert _close([lp[t] for lp, t in zip(scored.logprobs, scored.token_ids)],
                  [lp[t] for lp, t in zip(out.logprobs, out.token_ids)], LOGGED_TOL)


@pytest.mark.parametrize("page, pages", [(3, 256), (6, 256), (16, 256), (4, 12)])
def test_page_layouts_and_scarce_pages(models, page, pages):
    """Blocks that start inside a KV page (the context part of the page copied into each view's scratch
    page), and a cache so small that views run a few at a time, preempting others when needed."""
    path, _, _ = models["sdar_moe"]
    prompts = [_prompt(B + i, i) for i in range(4)]
    gen = GenerationConfig(max_new_tokens=21, ignore_eos=True, logprobs=1, return_dllm_replay=True,
                           dllm_unmasking_strategy="low_confidence_static")
    with pipeline(path, _engine(logprobs_mode="raw_logprobs", kv_block_size=page, num_kv_blocks=pages)) as pipe:
        outs = pipe(prompts, gen)
        before = pipe.engine.scheduler.num_preemptions
        scored = pipe(prompts, [scoring_config(o, gen) for o in outs])
        preempted = pipe.engine.scheduler.num_preemptions - before
    assert (preempted > 0) == (pages < 100), preempted
    for out, got in zip(outs, scored):
        assert _close([lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                      [lp[t] for lp, t in zip(out.logprobs, out.token_ids)], LOGGED_TOL)


def test_entropy_and_logits_mode(models):
    path, hf, mask_id = models["sdar_moe"]
    prompt = _prompt(B + 1)
    with pipeline(path, _engine(logprobs_mode="raw_logits")) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=11, ignore_eos=True, logprobs=0, return_dllm_replay=True))
        got = pipe(prompt, GenerationConfig(max_new_tokens=0, logprobs=0,
                                            dllm_trajectory=trajectory(out, return_entropy=True)))
    rows = hf_step_rows(hf, mask_id, prompt, out)
    assert _close([lp[t] for lp, t in zip(got.logprobs, got.token_ids)], [float(r[t]) for r, t in
                                                                          zip(rows, out.token_ids)], HF_TOL * 10)
    want = [float(torch.special.entr(r.softmax(-1)).sum()) for r in rows]
    assert _close(got.entropy, want, HF_TOL)


def test_after_a_weight_update_scores_follow_the_new_weights(models, tmp_path):
    path, _, mask_id = models["sdar"]
    new = write_tiny_checkpoint(tmp_path / "new", model_type="sdar", seed=77, logit_scale=LOGIT_SCALE)
    new_hf = load_hf_reference(new)
    prompt = _prompt(B + 2)
    gen = GenerationConfig(max_new_tokens=14, ignore_eos=True, logprobs=0, return_dllm_replay=True)
    with pipeline(path, _engine(logprobs_mode="raw_logprobs")) as pipe:
        out = pipe(prompt, gen)
        old = pipe(prompt, scoring_config(out, gen))
        assert pipe.update_weights_from_disk(str(new), weight_version="policy-2") == "policy-2"
        got = pipe(prompt, scoring_config(out, gen))
    assert old.weight_version == "default" and got.weight_version == "policy-2"
    values = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
    assert not _close(values, [lp[t] for lp, t in zip(old.logprobs, old.token_ids)], 1e-3)
    assert _close(values, hf_values(new_hf, mask_id, prompt, out, None), HF_TOL)


def test_processed_mode_reproduces_min_new_tokens_suppression(models):
    """Before min_new_tokens the sampler masks the stop ids: the scored rows are masked the same way."""
    path, _, _ = models["sdar"]
    prompt = _prompt(B + 2, 9)
    with pipeline(path, _engine(logprobs_mode="processed_logprobs")) as pipe:
        free = pipe(prompt, GenerationConfig(max_new_tokens=16, ignore_eos=True, logprobs=3))
        stop = [t for lp in free.logprobs[:8] for t in list(lp)[1:]][:3]  # likely tokens, masked early on
        gen = GenerationConfig(max_new_tokens=16, min_new_tokens=8, ignore_eos=True, logprobs=3, stop_token_ids=stop,
                               return_dllm_replay=True, random_seed=2, **SAMPLING)
        out = pipe(prompt, gen)
        got = pipe(prompt, scoring_config(out, gen))
        unmasked = pipe(prompt, scoring_config(out, gen.model_copy(update={"min_new_tokens": 0})))
    assert _close([lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                  [lp[t] for lp, t in zip(out.logprobs, out.token_ids)], LOGGED_TOL)
    assert [list(lp) for lp in got.logprobs] == [list(lp) for lp in out.logprobs]
    assert [list(lp) for lp in unmasked.logprobs] != [list(lp) for lp in out.logprobs], "the mask mattered"


# ---- validation ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout(models):
    """A rollout whose output ends inside a block (prompt B + 1, 9 tokens), with its replay."""
    path, _, _ = models["sdar"]
    prompt = _prompt(B + 1)
    with pipeline(path, _engine(logprobs_mode="raw_logprobs", dllm_unmasking_strategy="sequential")) as pipe:
        out = pipe(prompt, GenerationConfig(max_new_tokens=9, ignore_eos=True, return_dllm_replay=True))
    assert out.step_map == list(range(1, 10)) and out.dllm_stop_length == 2
    return prompt, out


def _bad(out: Response, **changes) -> dict:
    t = trajectory(out).model_dump()
    t.update(changes)
    return t


@pytest.mark.parametrize("change, param", [
    (lambda o: {"step_map": o.step_map[:-1]}, "dllm_trajectory.step_map"),
    (lambda o: {"step_map": [0] + o.step_map[1:]}, "dllm_trajectory.step_map"),
    (lambda o: {"step_map": [-1] + o.step_map[1:]}, "dllm_trajectory.step_map"),
    (lambda o: {"step_map": [1, 2, 4, 5, 6, 7, 8, 9, 10], "replay_step_maps": [9, 10] + [
        s + 1 if s else 0 for s in o.dllm_replay_step_maps[2:]]}, "dllm_trajectory.step_map"),  # step 3: nothing
    (lambda o: {"step_map": [1, 2, 3, 4, 5, 6, 3, 8, 9]}, "dllm_trajectory.step_map"),  # back across blocks
    (lambda o: {"output_ids": o.token_ids[:-1] + [10**6]}, "dllm_trajectory.output_ids"),
    (lambda o: {"replay_token_ids": None, "replay_step_maps": None, "stop_length": None},
     "dllm_trajectory.replay_token_ids"),
    (lambda o: {"replay_step_maps": None}, "dllm_trajectory.replay_step_maps"),
    (lambda o: {"replay_token_ids": o.dllm_replay_token_ids[:-1]}, "dllm_trajectory.replay_token_ids"),
    (lambda o: {"replay_step_maps": o.dllm_replay_step_maps + [0]}, "dllm_trajectory.replay_step_maps"),
    (lambda o: {"stop_length": 3}, "dllm_trajectory.stop_length"),
    (lambda o: {"replay_token_ids": [(o.dllm_replay_token_ids[0] + 1) % 300] + o.dllm_replay_token_ids[1:]},
     "dllm_trajectory.replay_token_ids"),
    (lambda o: {"replay_step_maps": [0] + o.dllm_replay_step_maps[1:]}, "dllm_trajectory.replay_step_maps"),
])
def test_invalid_trajectories_are_refused_naming_the_field(models, rollout, change, param):
    path, _, _ = models["sdar"]
    prompt, out = rollout
    with pipeline(path, _engine(logprobs_mode="raw_logprobs")) as pipe:
        with pytest.raises(RequestError) as e:
            pipe(prompt, GenerationConfig(max_new_tokens=0, logprobs=0,
                                          dllm_trajectory=DllmTrajectory(**_bad(out, **change(out)))))
    assert e.value.param == param, e.value.message


@pytest.mark.parametrize("update, param", [
    ({"max_new_tokens": 4}, "max_new_tokens"),
    ({"logprobs": None}, "logprobs"),
    ({"dllm_block_length": 8}, "dllm_block_length"),
    ({"logprob_start_len": 0}, "logprob_start_len"),
])
def test_request_rules(models, rollout, update, param):
    path, _, _ = models["sdar"]
    prompt, out = rollout
    config = GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=trajectory(out)).model_copy(update=update)
    with pipeline(path, _engine(logprobs_mode="raw_logprobs")) as pipe:
        with pytest.raises(RequestError) as e:
            pipe(prompt, config)
        with pytest.raises(RequestError) as text:
            pipe("hello", GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=trajectory(out)))
        assert pipe(prompt, GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=trajectory(out))).logprobs
    assert e.value.param == param and text.value.param == "input_ids"


def test_ar_model_is_pointed_to_logprob_start_len(tmp_path, rollout):
    path = write_tiny_checkpoint(tmp_path, model_type="qwen3", seed=3)
    prompt, out = rollout
    with pipeline(str(path), EngineConfig(max_model_len=128, num_kv_blocks=64, logprobs_mode="raw_logprobs")) as pipe:
        with pytest.raises(RequestError, match="logprob_start_len") as e:
            pipe(prompt, GenerationConfig(max_new_tokens=0, logprobs=0, dllm_trajectory=trajectory(out)))
    assert e.value.param == "dllm_trajectory"


# ---- over HTTP and the Serve handle, tensor-parallel ---------------------------------------------------
HANDLE_DRIVER = r"""
import json, sys
import ray
from ray import serve

ray.init(address=sys.argv[3], logging_level="error", log_to_driver=False)
print("RESULT " + json.dumps(serve.get_app_handle(sys.argv[1]).generate.remote(json.loads(sys.argv[2])).result()))
"""


@pytest.fixture(scope="module")
def tp2_scoring_app(serve_pool):
    """The pool's `sdar_tp2`: tp=2 with raw_logprobs scoring, behind an API key."""
    return serve_pool["sdar_tp2"]


def test_http_and_handle_at_tp2_match_the_pipeline(serve_cluster, tp2_scoring_app, tiny_checkpoints):
    import os
    import subprocess
    import sys

    import httpx

    from tests.support.http import close_as_json, without_ids
    from tests.support.ray_env import SERVE_ENGINE
    from tests.support.serve_pool import TP2_KEY

    auth = {"Authorization": f"Bearer {TP2_KEY}"}

    prompts = [_prompt(B + 1), _prompt(B + 3, 1)]
    gen = GenerationConfig(max_new_tokens=11, ignore_eos=True, logprobs=1, return_dllm_replay=True, do_sample=True,
                           temperature=0.8, random_seed=4)
    with pipeline(str(tiny_checkpoints["sdar"]), EngineConfig(**SERVE_ENGINE, logprobs_mode="raw_logprobs")) as pipe:
        outs = pipe(prompts, gen)
        local = pipe(prompts, [scoring_config(o, gen) for o in outs])
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 0, "temperature": 0.8},
            "return_logprob": True, "top_logprobs_num": 1,
            "dllm_trajectory": [trajectory(o).model_dump(exclude_none=True) for o in outs]}
    http = httpx.post(tp2_scoring_app.url + "/generate", json=body, headers=auth, timeout=180).json()
    assert isinstance(http, list) and len(http) == 2, http
    for got, want in zip(http, local):
        meta = got["meta_info"]
        assert got["output_ids"] == want.token_ids and meta["step_map"] == want.step_map
        assert [row[1] for row in meta["output_token_logprobs"]] == want.token_ids
        assert [row[0] for row in meta["output_token_logprobs"]] == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids)], abs=HF_TOL)
        assert meta["weight_version"] == "default" and len(meta["output_top_logprobs"]) == len(want.token_ids)
    proc = subprocess.run([sys.executable, "-c", HANDLE_DRIVER, tp2_scoring_app.name, json.dumps(body),
                           serve_cluster.address], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    handle = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    close_as_json([without_ids(b) for b in handle], [without_ids(b) for b in http], HF_TOL)
    bad = dict(body, dllm_trajectory=[dict(body["dllm_trajectory"][0], step_map=[1]), body["dllm_trajectory"][1]])
    r = httpx.post(tp2_scoring_app.url + "/generate", json=bad, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "dllm_trajectory.step_map", r.text


def test_bench_runs_at_toy_size():
    """`python -m bench.trajectory_scoring --toy`: both sides run and agree (the figures mean nothing)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "bench.trajectory_scoring", "--toy", "--trajectories", "4",
                           "--tokens", "16", "--prefill-tokens", "64"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["trajectories"] == 4 and out["score_forwards"] > 1 and out["max_abs_diff_scored_vs_logged"] < 1e-4
