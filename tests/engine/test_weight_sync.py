"""Weight updates (disk, tensors, SGLang's flattened_bucket, a trainer's gloo broadcast) on the
in-process engine and on a tp=2 Ray executor: after an update the engine answers exactly like a fresh
engine loaded from the new weights (prefix cache flushed), outputs carry the new weight_version, and
a refused update (wrong shape, unknown name, other architecture, a rank whose slice is bad) changes
nothing anywhere."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys

import pytest
import torch

from engine import EngineConfig, GenerationConfig, Response, pipeline
from engine.answers import ControlResult
from engine.async_engine import AsyncEngine
from engine.errors import WeightUpdateError
from engine.model.checkpoint import iter_weights
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint
from tests.support.paths import ROOT
from tests.support.ports import free_port

CONFIG = EngineConfig(max_model_len=256, num_kv_blocks=96, kv_block_size=4, logprobs_mode="raw_logprobs")
PARAMS = GenerationConfig(max_new_tokens=16, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 13, 22, 7, 8, 9, 10, 31, 4], [77, 3, 120, 9]]

# The trainer: rank 0 of the update group, broadcasting every tensor of a checkpoint in order (a
# tensor named in BAD gets one extra row). It groups the way SGLang/verl trainers do.
TRAINER = """
import json, sys, torch
import torch.distributed as dist
from engine.model.checkpoint import iter_weights
from engine.worker.update_group import init_custom_process_group

port, world, path, group_name, bad = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world, 0, group_name, timeout_s=120)
for name, weight in iter_weights(path):
    t = weight[...]
    if name == bad:
        t = torch.cat([t, t[:1]])
    dist.broadcast(t.contiguous(), src=0, group=group)
print("broadcast done", flush=True)
sys.stdin.readline()  # the engine has left the group: leave too (the trainer hosts the group's store)
dist.destroy_process_group(group)
"""


def broadcast_metadata(path: str, bad: str = "") -> tuple[list[str], list[str], list[list[int]]]:
    names, dtypes, shapes = [], [], []
    for name, weight in iter_weights(path):
        t = weight[...]
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append([t.shape[0] + (name == bad), *t.shape[1:]])
    return names, dtypes, shapes


def start_trainer(port: int, world: int, path: str, group: str, bad: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(world), path, group, bad or "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ws")
    return {
        "a": str(write_tiny_checkpoint(root / "a", model_type="sdar", seed=1, logit_scale=DLLM_TEST_LOGIT_SCALE)),
        "b": str(write_tiny_checkpoint(root / "b", model_type="sdar", seed=2, logit_scale=DLLM_TEST_LOGIT_SCALE)),
        "wide": str(write_tiny_checkpoint(root / "wide", model_type="sdar", seed=2, intermediate_size=192)),
    }


def tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, weight[...]) for name, weight in iter_weights(path)]


def fresh(path: str) -> list[Response]:
    with pipeline(path, CONFIG) as pipe:
        return pipe(PROMPTS, PARAMS)


def served(eng: AsyncEngine) -> list[Response]:
    async def one(prompt):
        return Response.from_chunks([c async for c in eng.generate(prompt, PARAMS)])

    async def main():
        return [await one(p) for p in PROMPTS]

    return asyncio.run(main())


def assert_same(got: list[Response], want: list[Response], version: str | None = None, abs_tol: float = 1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.step_map == w.step_map
        assert [list(e) for e in g.logprobs] == [list(e) for e in w.logprobs]  # same token ids, same order
        assert [v for e in g.logprobs for v in e.values()] == pytest.approx(
            [v for e in w.logprobs for v in e.values()], abs=abs_tol)
        if version is not None:
            assert g.weight_version == version


@pytest.fixture(scope="module")
def expected(ckpts) -> dict[str, list[Response]]:
    return {k: fresh(ckpts[k]) for k in ("a", "b")}


@pytest.fixture(scope="module")
def engine(ckpts):
    eng = AsyncEngine(ckpts["a"], CONFIG)
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_the_two_checkpoints_differ(expected):
    assert expected["a"][0].token_ids != expected["b"][0].token_ids


def test_disk_update_answers_like_a_fresh_engine_and_flushes_the_prefix_cache(engine, ckpts, expected):
    assert_same(served(engine), expected["a"], "default")  # prompts now in the prefix cache
    hits = engine.stats().load.prefix_hit_tokens
    assert served(engine) and engine.stats().load.prefix_hit_tokens > hits  # the cache is warm
    out = run(engine.update_weights_from_disk(ckpts["b"], weight_version="step-1"))
    assert out == ControlResult("weights updated to version 'step-1'", weight_version="step-1")
    hits = engine.stats().load.prefix_hit_tokens
    assert_same(served(engine), expected["b"], "step-1")
    assert engine.stats().load.prefix_hit_tokens == hits, "K/V of the old weights were reused"
    assert_same(served(engine), expected["b"], "step-1")  # the new weights' K/V are cached and reused
    run(engine.update_weights_from_disk(ckpts["a"]))
    assert_same(served(engine), expected["a"], "step-1")  # no version given: the version stays (SGLang)


def test_tensor_updates_full_partial_and_flattened_bucket(engine, ckpts, expected):
    run(engine.update_weights_from_tensor(tensors(ckpts["b"]), weight_version="t1"))
    assert_same(served(engine), expected["b"], "t1")
    # any subset: two partial updates that together cover the model land on exactly those weights
    a = tensors(ckpts["a"])
    run(engine.update_weights_from_tensor([(n, t) for n, t in a if "layers.0." not in n], weight_version="t2"))
    assert served(engine)[0].weight_version == "t2"
    run(engine.update_weights_from_tensor({n: t for n, t in a if "layers.0." in n}, weight_version="t3"))
    assert_same(served(engine), expected["a"], "t3")
    # SGLang's flattened_bucket: current byte layout (uint8, several dtypes) and the older element layout
    named = tensors(ckpts["b"])
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
    metadata, at = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        metadata.append({"name": name, "shape": list(t.shape), "dtype": "float32", "start_idx": at,
                         "end_idx": at + n, "numel": n})
        at += n
    run(engine.update_weights_from_tensor({"flattened_tensor": flat, "metadata": metadata},
                                          weight_version="bucket", load_format="flattened_bucket"))
    assert_same(served(engine), expected["b"], "bucket")
    elements = torch.cat([t.flatten() for _, t in tensors(ckpts["a"])])
    metadata, at = [], 0
    for name, t in tensors(ckpts["a"]):
        metadata.append({"name": name, "shape": list(t.shape), "dtype": torch.float32, "start_idx": at,
                         "end_idx": at + t.numel(), "numel": t.numel()})
        at += t.numel()
    run(engine.update_weights_from_tensor([{"flattened_tensor": elements, "metadata": metadata}],
                                          weight_version="bucket-old", load_format="flattened_bucket"))
    assert_same(served(engine), expected["a"], "bucket-old")


def test_refused_updates_change_nothing(engine, ckpts, expected):
    run(engine.update_weights_from_disk(ckpts["a"], weight_version="good"))
    before = served(engine)
    good = dict(tensors(ckpts["b"]))
    q = "model.layers.1.self_attn.q_proj.weight"
    nan = good[q].clone()
    nan[-1, -1] = float("nan")
    refusals = [
        ([*good.items(), (q, good[q][:-1])], f"tensor '{q}' has shape [63, 64], the serving model's is [64, 64]"),
        ([("model.layers.9.mlp.up_proj.weight", good[q])], "'model.layers.9.mlp.up_proj.weight' is not part of"),
        ([*good.items(), (q, nan)], f"tensor '{q}' holds non-finite values"),
        ([(q, good[q].long())], f"tensor '{q}' has dtype torch.int64"),
        (ckpts["wide"], "config.json intermediate_size=192 differs from the serving model's 128"),
    ]
    for payload, message in refusals:
        with pytest.raises(WeightUpdateError, match=re.escape(message)):
            if isinstance(payload, str):
                run(engine.update_weights_from_disk(payload))
            else:
                run(engine.update_weights_from_tensor(payload))
        assert_same(served(engine), before, "good")
    with pytest.raises(WeightUpdateError, match="load_format"):
        run(engine.update_weights_from_tensor(list(good.items()), load_format="direct"))
    assert engine.stats().weight_version == "good"


def test_missing_tensor_in_a_checkpoint_is_refused(tmp_path, ckpts):
    from safetensors.torch import save_file

    shutil.copytree(ckpts["b"], tmp_path / "b", ignore=shutil.ignore_patterns("*.safetensors"))
    kept = {n: t for n, t in tensors(ckpts["b"]) if n != "model.norm.weight"}
    save_file(kept, str(tmp_path / "b" / "model.safetensors"))
    with pipeline(ckpts["a"], CONFIG) as pipe:
        with pytest.raises(WeightUpdateError, match="lacks tensors: model.norm.weight"):
            pipe.update_weights_from_disk(str(tmp_path / "b"))
        assert_same(pipe(PROMPTS, PARAMS), fresh(ckpts["a"]), "default")


def test_pipeline_moe_update_by_per_expert_names(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", model_type="sdar_moe", seed=1, logit_scale=DLLM_TEST_LOGIT_SCALE,
                              router_scale=4.0)
    b = write_tiny_checkpoint(tmp_path / "b", model_type="sdar_moe", seed=2, logit_scale=DLLM_TEST_LOGIT_SCALE,
                              router_scale=4.0)
    named = tensors(str(b))
    assert any(".mlp.experts.3.down_proj.weight" in n for n, _ in named)
    with pipeline(str(a), CONFIG) as pipe:
        assert pipe.update_weights_from_tensor(named) == "default"  # no version given: unchanged
        assert_same(pipe(PROMPTS, PARAMS), fresh(str(b)), "default")
        assert pipe.update_weights_from_disk(str(a), weight_version="back") == "back"
        assert_same(pipe(PROMPTS, PARAMS), fresh(str(a)), "back")


def distributed_update(eng: AsyncEngine, ckpt: str, world: int, version: str, bad: str = "") -> ControlResult:
    """A trainer subprocess (rank 0) broadcasts `ckpt`; the engine joins, receives, leaves."""
    port, group = free_port(), f"sync-{version}"
    trainer = start_trainer(port, world, ckpt, group, bad)
    try:
        run(eng.init_weights_update_group("127.0.0.1", port, 1, world, group, "gloo"))
        names, dtypes, shapes = broadcast_metadata(ckpt, bad)
        try:
            return run(eng.update_weights_from_distributed(names, dtypes, shapes, group, weight_version=version))
        finally:
            run(eng.destroy_weights_update_group(group))
            out, _ = trainer.communicate("\n", timeout=120)
            assert trainer.returncode == 0 and "broadcast done" in out, out
    finally:
        trainer.kill()


def test_distributed_update_from_a_trainer_broadcast(engine, ckpts, expected):
    assert distributed_update(engine, ckpts["b"], 2, "bcast").weight_version == "bcast"
    assert_same(served(engine), expected["b"], "bcast")
    bad = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(WeightUpdateError, match=f"tensor '{bad}' has shape"):
        distributed_update(engine, ckpts["a"], 2, "refused", bad=bad)  # the trainer still completes
    assert_same(served(engine), expected["b"], "bcast")
    with pytest.raises(WeightUpdateError, match="no weight update group 'nope'"):
        run(engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "nope"))


# ---- tp=2 over Ray (rank 0 in this process, rank 1 a TPWorker actor, gloo) -----------------------
@pytest.fixture(scope="module")
def tp2(serve_cluster, ckpts):
    from engine.executor.ray_tp import RayTPExecutor

    eng = AsyncEngine(ckpts["a"], CONFIG.model_copy(update={"tp": 2}), RayTPExecutor)
    yield eng
    eng.shutdown()


def test_tp2_every_update_path_on_every_rank(tp2, ckpts, expected):
    fresh_a = served(tp2)  # a fresh tp=2 engine on checkpoint a
    assert_same(fresh_a, expected["a"], "default", abs_tol=1e-4)  # tp=1 vs tp=2: reduction order
    run(tp2.update_weights_from_disk(ckpts["b"], weight_version="disk"))
    assert_same(served(tp2), expected["b"], "disk", abs_tol=1e-4)
    run(tp2.update_weights_from_tensor(tensors(ckpts["a"]), weight_version="tensor"))
    assert_same(served(tp2), fresh_a, "tensor")
    distributed_update(tp2, ckpts["b"], 3, "bcast")
    assert_same(served(tp2), expected["b"], "bcast", abs_tol=1e-4)
    run(tp2.update_weights_from_disk(ckpts["a"], weight_version="back"))
    assert_same(served(tp2), fresh_a, "back")


def test_tp2_a_rank_refusing_its_slice_leaves_every_rank_on_the_old_weights(tp2, ckpts):
    run(tp2.update_weights_from_disk(ckpts["a"], weight_version="old"))
    before = served(tp2)
    named = dict(tensors(ckpts["b"]))
    q = "model.layers.0.self_attn.q_proj.weight"  # column-parallel: rank 1 holds the second half of the rows
    named[q] = named[q].clone()
    named[q][-1, 0] = float("inf")
    with pytest.raises(WeightUpdateError, match=f"tensor-parallel rank 1: tensor '{q}' holds non-finite"):
        run(tp2.update_weights_from_tensor(list(named.items()), weight_version="new"))
    assert_same(served(tp2), before, "old")
    named[q][-1, 0] = 0.0  # the same update, fixed, goes through on both ranks
    run(tp2.update_weights_from_tensor(list(named.items()), weight_version="new"))
    assert served(tp2)[0].weight_version == "new"


def test_flush_forgets_cached_pages_and_tables_from_before_never_publish():
    from engine.kv.page_manager import KVPageManager, PageTable

    kv, tokens = KVPageManager(num_pages=8, page_size=4, enable_prefix_caching=True), list(range(100, 112))
    in_flight, finished = PageTable(), PageTable()
    assert kv.allocate(in_flight, 8) and kv.allocate(finished, 4)
    kv.register(in_flight, tokens, 8)
    kv.register(finished, [7, 7, 7, 7], 4)
    kv.free(finished)  # cached, unreferenced
    kv.flush()
    assert kv.num_free_pages == 6 and kv.match_prefix(PageTable(), [7, 7, 7, 7], 4) == 0
    assert kv.allocate(in_flight, 12)
    kv.register(in_flight, tokens, 12)  # its third page sits on K/V computed before the flush
    assert kv.match_prefix(PageTable(), tokens, 12) == 0
    fresh_table = PageTable()
    assert kv.match_prefix(fresh_table, tokens, 12) == 0 and kv.allocate(fresh_table, 12)
    kv.register(fresh_table, tokens, 12)
    assert kv.match_prefix(PageTable(), tokens, 12) == 12  # computed after the flush: reused
