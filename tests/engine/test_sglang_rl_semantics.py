"""SGLang's RL-control semantics on the engine (what the HTTP routes of SGLang trainers rely on):

- `update_weights_from_distributed` with `load_format="flattened_bucket"`: one broadcast of SGLang's
  FlattenedTensorBucket layout from a real gloo trainer process equals a fresh engine on the new
  weights; a bucket that does not fit the model is refused and the engine keeps serving; an unknown
  `load_format` is refused before anything is received.
- `weight_version` stays as it was when an update names none.
- An update made while requests generate waits for them (they finish on the old weights) and holds
  requests that arrive meanwhile (they run on the new ones): one-shot updates and the commit of
  staged weights. `abort_all_requests` ends the requests in flight first; `abort_all()` ends every
  request now.
- Memory tags as SGLang's: None or [] = all, `cuda_graph` accepted.
- `init_weights_update_group` that not every member joins fails within its timeout, naming who.

Ordering is forced, never timed: a command that blocks the engine loop on an Event holds it while
the request, the update and the next request are queued behind it in that order (commands run in
arrival order; each `asyncio.sleep(0)` lets the task just created queue its command).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from engine import EngineConfig, GenerationConfig, Response, pipeline
from engine.answers import ControlResult
from engine.async_engine import AsyncEngine
from engine.errors import WeightUpdateError
from engine.model.checkpoint import iter_weights
from testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.async_engine import collect, queue_in_order, run
from tests.support.paths import ROOT
from tests.support.ports import free_port

CONFIG = EngineConfig(max_model_len=256, num_kv_blocks=96, kv_block_size=4, logprobs_mode="raw_logprobs")
LONG = GenerationConfig(max_new_tokens=48, ignore_eos=True, logprobs=0)
SHORT = GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=0)
PROMPT, OTHER = [5, 9, 13, 22, 7, 8, 9, 10, 31, 4], [77, 3, 120, 9]
WIDE = "norm.weight"  # tensors the trainer sends as float64 (exact for float32 values): a multi-dtype bucket

# The trainer: rank 0 of the update group; one broadcast of every tensor of a checkpoint flattened as
# SGLang's FlattenedTensorBucket does (python/sglang/srt/weight_sync/tensor_bucket.py: each tensor
# `flatten().view(torch.uint8)`, concatenated). A tensor named BAD gets one extra row (its metadata
# says so too); BAD = SHORT sends the bucket 64 bytes short of what the metadata announces.
TRAINER = """
import sys, torch
import torch.distributed as dist
from engine.model.checkpoint import iter_weights
from engine.worker.update_group import init_custom_process_group

port, world, path, group_name, bad, wide = sys.argv[1], int(sys.argv[2]), *sys.argv[3:7]
print("ready", flush=True)
group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world, 0, group_name, join_timeout_s=60)
parts = []
for name, weight in iter_weights(path):
    t = weight[...]
    if name == bad:
        t = torch.cat([t, t[:1]])
    if name.endswith(wide):
        t = t.double()
    parts.append(t.flatten().view(torch.uint8))
bucket = torch.cat(parts)
dist.broadcast(bucket[:-64] if bad == "SHORT" else bucket, src=0, group=group)
print("broadcast done", flush=True)
sys.stdin.readline()  # the engine has left the group: leave too (the trainer hosts the group's store)
dist.destroy_process_group(group)
"""


def bucket_metadata(path: str, bad: str = "") -> tuple[list[str], list[str], list[list[int]]]:
    names, dtypes, shapes = [], [], []
    for name, weight in iter_weights(path):
        shape = list(weight.get_shape())
        names.append(name)
        dtypes.append("float64" if name.endswith(WIDE) else "float32")
        shapes.append([shape[0] + (name == bad), *shape[1:]])
    return names, dtypes, shapes


def start_trainer(port: int, world: int, path: str, group: str, bad: str = "") -> subprocess.Popen:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(world), path, group, bad or "-", WIDE],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=ROOT)
    assert trainer.stdout.readline().strip() == "ready"
    return trainer


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rl")
    return {k: str(write_tiny_checkpoint(root / k, model_type="qwen3", seed=seed, logit_scale=2.0))
            for k, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def expected(ckpts) -> dict[str, dict[str, Response]]:
    out = {}
    for k, path in ckpts.items():
        with pipeline(path, CONFIG) as pipe:
            out[k] = {"long": pipe(PROMPT, LONG), "short": pipe(OTHER, SHORT)}
    assert out["a"]["long"].token_ids != out["b"]["long"].token_ids
    return out


@pytest.fixture
def engine(ckpts):
    eng = AsyncEngine(ckpts["a"], CONFIG)
    yield eng
    eng.shutdown()


def assert_same(got: Response, want: Response, version: str, abs_tol: float = 1e-5) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert [v for e in got.logprobs for v in e.values()] == pytest.approx(
        [v for e in want.logprobs for v in e.values()], abs=abs_tol)
    assert got.weight_version == version


# ---- flattened_bucket broadcasts ------------------------------------------------------------------
def flat_update(eng: AsyncEngine, ckpt: str, version: str, bad: str = "", group: str = "flat") -> ControlResult:
    """The trainer broadcasts one bucket to every engine rank (ranks 1..tp); AReaL sends the port as a string."""
    port, world = free_port(), 1 + eng.config.tp
    trainer = start_trainer(port, world, ckpt, group, bad)
    try:
        run(eng.init_weights_update_group("127.0.0.1", str(port), 1, world, group, "gloo", timeout_s=60))
        names, dtypes, shapes = bucket_metadata(ckpt, bad)
        try:
            return run(eng.update_weights_from_distributed(names, dtypes, shapes, group, weight_version=version,
                                                           load_format="flattened_bucket"))
        finally:
            run(eng.destroy_weights_update_group(group))
            out, _ = trainer.communicate("\n", timeout=120)
            assert trainer.returncode == 0 and "broadcast done" in out, out
    finally:
        trainer.kill()


def served(eng: AsyncEngine) -> dict[str, Response]:
    async def main():
        return {"long": await collect(eng, PROMPT, LONG), "short": await collect(eng, OTHER, SHORT)}

    return run(main())


def test_a_flattened_bucket_broadcast_equals_a_fresh_engine(engine, ckpts, expected):
    assert flat_update(engine, ckpts["b"], "flat").weight_version == "flat"
    got = served(engine)
    for k in ("long", "short"):
        assert_same(got[k], expected["b"][k], "flat")
    bad = "model.layers.0.mlp.down_proj.weight"  # the bucket holds it with one row too many
    with pytest.raises(WeightUpdateError, match=re.escape(f"tensor '{bad}' has shape [65, 128]")):
        flat_update(engine, ckpts["a"], "refused", bad=bad)  # the trainer's broadcast still completes
    got = served(engine)
    for k in ("long", "short"):
        assert_same(got[k], expected["b"][k], "flat")
    with pytest.raises(WeightUpdateError, match="holds non-finite values"):  # the bytes that never came
        flat_update(engine, ckpts["a"], "short", bad="SHORT")
    assert_same(served(engine)["short"], expected["b"]["short"], "flat")


def test_tp2_a_flattened_bucket_reaches_every_rank(serve_cluster, ckpts, expected):
    from engine.executor.ray_tp import RayTPExecutor

    eng = AsyncEngine(ckpts["a"], CONFIG.model_copy(update={"tp": 2}), RayTPExecutor)
    try:
        assert flat_update(eng, ckpts["b"], "flat-tp2").weight_version == "flat-tp2"
        got = served(eng)
    finally:
        eng.shutdown()
    for k in ("long", "short"):  # tp=1 vs tp=2: reduction order
        assert_same(got[k], expected["b"][k], "flat-tp2", abs_tol=1e-4)


def test_an_unknown_load_format_is_refused_before_anything_is_received(engine, ckpts, expected):
    for load_format in ("direct", "bucket"):
        with pytest.raises(WeightUpdateError, match=f"load_format={load_format!r} is not supported"):
            run(engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "no-group",
                                                       load_format=load_format))
        with pytest.raises(WeightUpdateError, match=f"load_format={load_format!r} is not supported"):
            run(engine.update_weights_from_tensor([("model.norm.weight", None)], load_format=load_format))
    with pytest.raises(WeightUpdateError, match="load_format='pt' is not supported for checkpoints"):
        run(engine.update_weights_from_disk(ckpts["b"], load_format="pt"))
    assert run(engine.update_weights_from_disk(ckpts["a"], load_format="auto")).weight_version == "default"
    assert_same(served(engine)["short"], expected["a"]["short"], "default")


# ---- weight_version -------------------------------------------------------------------------------
def test_an_update_without_a_version_keeps_the_version(engine, ckpts, expected):
    named = [(n, w[...]) for n, w in iter_weights(ckpts["b"])]
    assert run(engine.update_weights_from_tensor(named[:3], weight_version="v7")).weight_version == "v7"
    assert run(engine.update_weights_from_tensor(named[3:])).weight_version == "v7"  # one call per bucket
    assert_same(served(engine)["short"], expected["b"]["short"], "v7")
    assert run(engine.update_weights_from_disk(ckpts["a"])).weight_version == "v7"
    assert engine.stats().weight_version == "v7"
    assert_same(served(engine)["short"], expected["a"]["short"], "v7")


# ---- updates and requests in flight ---------------------------------------------------------------
def test_an_update_waits_for_requests_in_flight_and_holds_new_ones(engine, ckpts, expected):
    long, update, new = run(queue_in_order(
        engine, collect(engine, PROMPT, LONG),
        engine.update_weights_from_disk(ckpts["b"], weight_version="new"),
        collect(engine, OTHER, SHORT)))
    assert_same(long, expected["a"]["long"], "default")  # generated entirely by the old weights
    assert update.weight_version == "new"
    assert_same(new, expected["b"]["short"], "new")  # held until the update was done


def test_a_commit_of_staged_weights_waits_for_requests_in_flight(engine, ckpts, expected):
    from engine.worker.weight_sources import DiskWeights

    token = run(engine.stage_weights(DiskWeights(ckpts["b"])))  # staging overlaps generation
    long, commit, new = run(queue_in_order(
        engine, collect(engine, PROMPT, LONG), engine.commit_weights(token, "committed"),
        collect(engine, OTHER, SHORT)))
    assert_same(long, expected["a"]["long"], "default")
    assert commit.weight_version == "committed"
    assert_same(new, expected["b"]["short"], "committed")


def test_abort_all_requests_ends_the_requests_in_flight_before_the_update(engine, ckpts, expected):
    long, update = run(queue_in_order(
        engine, collect(engine, PROMPT, LONG),
        engine.update_weights_from_disk(ckpts["b"], weight_version="b", abort_all_requests=True)))
    assert long.finish_reason == "abort" and long.weight_version == "default"
    assert update.weight_version == "b"
    assert_same(served(engine)["long"], expected["b"]["long"], "b")


def test_abort_all_ends_every_request_held_ones_included(engine, ckpts, expected):
    first, update, held, aborted = run(queue_in_order(
        engine, collect(engine, PROMPT, LONG), engine.update_weights_from_disk(ckpts["b"], weight_version="b"),
        collect(engine, OTHER, SHORT), engine.abort_all()))
    assert aborted == ControlResult("aborted 2 requests", requests=2)
    assert first.finish_reason == held.finish_reason == "abort"
    assert update.weight_version == "b"  # nothing left in flight: the update ran
    assert_same(served(engine)["short"], expected["b"]["short"], "b")
    assert run(engine.abort_all()).requests == 0


# ---- memory tags ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tags", [None, [], ["weights", "kv_cache", "cuda_graph"]])
def test_memory_tags_none_and_empty_mean_all_and_cuda_graph_is_accepted(engine, expected, tags):
    released = run(engine.release_memory_occupation(tags))
    assert released.released == ["kv_cache", "weights"] and engine.stats().state == "released"
    # what the tag did, true of this engine: one without CUDA graphs (CPU) has none to drop
    graphs = engine.stats().load.executor.cuda_graphs
    held = graphs is not None and graphs.state == "on"
    note = "cuda_graph: captured CUDA graphs dropped" if held else "cuda_graph: nothing to release (no CUDA graphs: "
    assert note in released.message, released.message
    resumed = run(engine.resume_memory_occupation(tags))
    assert resumed.released == [] and engine.stats().state == "serving"
    assert_same(served(engine)["short"], expected["a"]["short"], "default")
    only_graphs = run(engine.release_memory_occupation(["cuda_graph"]))
    assert only_graphs.released == [] and engine.stats().state == "serving"


# ---- update groups that do not form ---------------------------------------------------------------
def test_a_group_nobody_joins_fails_within_its_timeout_naming_the_trainer(engine, expected):
    port = free_port()
    with pytest.raises(WeightUpdateError, match=re.escape(
            f"weight update group 'lonely' at tcp://127.0.0.1:{port} (world_size 2): rank 0 (the trainer) "
            "never connected within 1s")):
        run(engine.init_weights_update_group("127.0.0.1", port, 1, 2, "lonely", "gloo", timeout_s=1))
    assert_same(served(engine)["short"], expected["a"]["short"], "default")  # alive, and nothing left joined
    with pytest.raises(WeightUpdateError, match="no weight update group 'lonely'"):
        run(engine.destroy_weights_update_group("lonely"))


def test_a_group_missing_an_engine_rank_names_it_and_can_be_formed_again(engine, ckpts, expected):
    port = free_port()
    trainer = start_trainer(port, 3, ckpts["b"], "g")  # waits for ranks 1 and 2; only rank 1 comes
    try:
        with pytest.raises(WeightUpdateError, match=re.escape(
                f"weight update group 'g' at tcp://127.0.0.1:{port} (world_size 3) did not form within 10s: "
                "rank 2 never joined")):
            run(engine.init_weights_update_group("127.0.0.1", port, 1, 3, "g", "gloo", timeout_s=10))
    finally:
        trainer.kill()
        trainer.communicate()
    assert flat_update(engine, ckpts["b"], "v", group="g").weight_version == "v"  # the same name, formed now
    assert_same(served(engine)["short"], expected["b"]["short"], "v")
