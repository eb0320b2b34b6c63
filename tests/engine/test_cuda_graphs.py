"""CUDA graphs for every step (engine.worker.cuda_graphs), on the CPU with the `triton` backend.

Capture itself needs a GPU; everything around it runs here with a stand-in capture that records the
forward as a function of the persistent input buffers and "replays" it by running it again into the
persistent output -- so a step whose inputs were not copied into those buffers, or a padding row that
touched a real page, shows up as a different output. Engine runs with graphs give the same tokens
and step maps as without, steps that carry prefill chunks and scored rows included; every launch of
the Triton kernel at a replay has the grid and argument shapes it had at its graph's capture, as a
real capture requires; what a step uploads does not grow with `max_model_len`.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from engine.worker.cuda_graphs import TOKEN_BUCKETS, StepGraphs, _Graph, pad_tokens
from engine.worker.forward_batch import ForwardBatch, page_table_array
from ops.attention import triton_paged
from tests.support.outputs import assert_same_outputs


def eager_capture(fn):
    """The stand-in for `cuda_capture`: replay runs the recorded forward again into the same output."""
    out = fn()

    def replay():
        out.copy_(fn())

    return replay, out


def batch(q_lens, kv_lens, **extra) -> ForwardBatch:
    pages = [list(range(10 * s, 10 * s + -(-kv // 16))) for s, kv in enumerate(kv_lens)]
    positions = [p for q, kv in zip(q_lens, kv_lens, strict=True) for p in range(kv - q, kv)]
    slots = [pages[s][p // 16] * 16 + p % 16 for s, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True))
             for p in range(kv - q, kv)]
    return ForwardBatch(input_ids=[3] * len(positions), positions=positions, q_lens=q_lens, kv_lens=kv_lens,
                        slot_mapping=slots, page_tables=page_table_array(pages), sample_rows=[0, 1], **extra)


def test_buckets():
    graphs = StepGraphs(max_seqs=9, table_width=8, capture=eager_capture, max_tokens=100)
    assert graphs.buckets == [b for b in TOKEN_BUCKETS if b < 100] + [100]
    assert [graphs.bucket(n, 3, 8) for n in (1, 3, 17, 97, 100, 101)] == [1, 4, 24, 100, 100, None]
    assert graphs.bucket(4, 8, 8) == 4 and graphs.bucket(4, 9, 8) is None, "a row is kept for the padding"
    assert graphs.bucket(4, 3, 9) is None, "a table wider than the graphs' runs eagerly"


def test_padding_is_one_dummy_sequence_in_the_null_page():
    b = batch([4, 7, 1], [8, 23, 40], score_rows=[3], score_targets=[5])
    padded = pad_tokens(b, 16, null_page=99, page_size=16)
    assert padded.q_lens == [4, 7, 1, 4] and padded.kv_lens == [8, 23, 40, 1]
    assert padded.page_tables is b.page_tables, "the padding's table row is the upload's"
    assert padded.slot_mapping.tolist() == b.slot_mapping + [99 * 16] * 4
    assert padded.positions.tolist() == b.positions + [0] * 4 and padded.input_ids == b.input_ids + [0] * 4
    assert (padded.sample_rows, padded.score_rows) == (b.sample_rows, b.score_rows)
    assert pad_tokens(b, 12, null_page=99, page_size=16) is b
    with pytest.raises(ValueError, match="does not fit"):
        pad_tokens(b, 8, null_page=99, page_size=16)


def test_graphs_of_another_model_or_cache_are_dropped():
    """Weights or KV cache released and resumed make new objects: the first step over them captures anew."""
    graphs = StepGraphs(4, 2, eager_capture)
    replayed = []
    graph = _Graph({"input_ids": torch.zeros(4)}, lambda: replayed.append(1), torch.zeros(1))
    meta = type("Meta", (), {"page_tables": torch.zeros(1, 1, dtype=torch.long)})()

    class Model:
        pass

    model, cache = Model(), torch.zeros(2)
    for owners in [(Model(), cache), (model, torch.zeros(2))]:
        graphs._graphs[4] = graph  # as if captured over (model, cache)
        graphs._owners = [weakref.ref(model), weakref.ref(cache)]
        replayed.clear()
        assert graphs.run(4, {"input_ids": torch.ones(4)}, meta, None, (model, cache)) is graph.out
        assert replayed == [1] and torch.equal(graph.inputs["input_ids"], torch.ones(4))
        with pytest.raises(KeyError):  # captures anew (and this test's step has no positions)
            graphs.run(4, {"input_ids": torch.ones(4)}, meta, None, owners)
        assert graphs._graphs == {}


# ---- engine runs -----------------------------------------------------------------------------------------------
class KernelLaunches:
    """Records every launch of the Triton kernel (grid and argument shapes, strides, constexpr-deciding
    arguments) and checks, at each replay of a graph, that its launches are the ones its capture made."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        real = triton_paged.run_paged_attention

        def recorded(q, k_cache, v_cache, page_tables, positions, tiles, scale, mode, dllm_block=1, window=0):
            self.calls.append((tuple(q.shape), tuple(page_tables.shape), page_tables.stride(0),
                               tuple(positions.shape), tuple(t.shape for t in tiles.values()), mode, dllm_block,
                               window, k_cache.data_ptr(), page_tables.data_ptr()))
            return real(q, k_cache, v_cache, page_tables, positions, tiles, scale, mode, dllm_block, window)

        monkeypatch.setattr(triton_paged, "run_paged_attention", recorded)
        self.captured: dict[int, list[tuple]] = {}
        self.replays_checked = 0

    def capture(self, fn):
        """`eager_capture`, keeping the launches of the capture and comparing each replay's with them."""
        self.calls.clear()
        out = fn()
        launches = list(self.calls)
        self.captured[len(self.captured)] = launches

        def replay():
            self.calls.clear()
            out.copy_(fn())
            assert self.calls == launches, "a replay launched the kernel differently from its capture"
            self.replays_checked += 1

        return replay, out


def with_graphs(runner, capture, max_seqs: int = 16) -> StepGraphs:
    """Graphs (a stand-in capture) on a CPU runner, with the extra KV page as the null page."""
    runner.graphs = StepGraphs(max_seqs, -(-(256 + 64) // runner.config.kv_block_size), capture)
    runner.null_page = runner.num_pages
    runner.kv_caches = runner._allocate_kv()
    return runner.graphs


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


def serve(path: str, capture, gen: GenerationConfig, lengths=(30, 9, 17, 5, 12), **engine):
    """Outputs of `lengths`-token prompts on the triton backend, with graphs when `capture` is given; also
    the graphs, and how many replayed steps carried a prefill chunk (more rows than two blocks)."""
    config = EngineConfig(kv_block_size=16, num_kv_blocks=64, max_model_len=256, max_prefill_token_num=24,
                          attention_backend="triton", **engine)
    with pipeline(path, engine_config=config) as pipe:
        runner = pipe.engine.executor.runner
        assert runner.graphs is None, "no graphs on the CPU unless a test installs them"
        graphs = with_graphs(runner, capture) if capture else None
        chunked_replays = []
        execute = runner.execute

        def counted(fed: ForwardBatch):
            before = graphs.replays if graphs else 0
            out = execute(fed)
            if graphs and graphs.replays > before and max(fed.q_lens) > 2 * (runner.dllm_block_length or 1):
                chunked_replays.append(fed.q_lens)
            return out

        runner.execute = counted
        outs = pipe(prompts(list(lengths), seed=1), gen_config=gen)
    return outs, graphs, chunked_replays


def same(a, b) -> bool:
    return all((x.token_ids, x.step_map, x.finish_reason) == (y.token_ids, y.step_map, y.finish_reason)
               for x, y in zip(a, b, strict=True))


def test_dllm_outputs_with_graphs_equal_outputs_without(dllm_ckpt, monkeypatch):
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    eager, _, _ = serve(dllm_ckpt, None, gen, dllm_block_length=4)
    launches = KernelLaunches(monkeypatch)
    graphed, graphs, chunked = serve(dllm_ckpt, launches.capture, gen, dllm_block_length=4)
    assert same(graphed, eager)
    assert graphs.replays > graphs.captures > 1, "graphs replayed with new inputs, not only captured"
    assert chunked, "steps carrying prefill chunks replayed graphs too"
    assert launches.replays_checked == graphs.replays
    for bucket, graph in graphs._graphs.items():  # the captured shapes: what every replay copies into
        assert bucket in graphs.buckets and graph.inputs["input_ids"].shape == (bucket,)
        rows_per_tile = triton_paged.block_q(2)  # the tiny checkpoint: 4 query heads over 2 K/V heads
        assert graph.inputs["plan.tile_rows"].shape == (triton_paged.max_tiles(bucket, 16, rows_per_tile),)


def test_ar_outputs_and_scores_with_graphs_equal_outputs_without(ar_ckpt, monkeypatch):
    """AR prefill chunks, decode rows and scored prompt rows (read from the graph's output)."""
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True, logprob_start_len=2, logprobs=2)
    eager, _, _ = serve(ar_ckpt, None, gen, logprobs_mode="raw_logprobs")
    launches = KernelLaunches(monkeypatch)
    graphed, graphs, chunked = serve(ar_ckpt, launches.capture, gen, logprobs_mode="raw_logprobs")
    assert_same_outputs(graphed, eager)  # tokens, step maps, finish reasons; logprobs within 1e-5
    assert chunked and graphs.replays > graphs.captures and launches.replays_checked == graphs.replays


def test_a_failed_capture_runs_eagerly_and_says_why(dllm_ckpt, caplog):
    def failing(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    eager, _, _ = serve(dllm_ckpt, None, gen, lengths=(9, 5), dllm_block_length=4)
    config = EngineConfig(kv_block_size=16, num_kv_blocks=64, max_model_len=256, attention_backend="triton",
                          dllm_block_length=4)
    with caplog.at_level("WARNING", logger="engine.worker.runner"), pipeline(dllm_ckpt, engine_config=config) as pipe:
        runner = pipe.engine.executor.runner
        with_graphs(runner, failing)
        outs = pipe(prompts([9, 5], seed=1), gen_config=gen)
        assert runner.graphs is None
        assert "operation not permitted when stream is capturing" in runner.graph_failure
    assert same(outs, eager)
    assert "CUDA graphs switched off" in caplog.text


def test_what_a_step_uploads_does_not_grow_with_max_model_len(dllm_ckpt):
    """The page tables travel at the width the step uses; the graphs' table is the only thing sized by
    the longest sequence, and it stays on the device."""
    uploaded: dict[int, list[int]] = {}
    for max_model_len in (128, 2048):
        config = EngineConfig(kv_block_size=16, num_kv_blocks=64, max_model_len=max_model_len,
                              max_prefill_token_num=24, attention_backend="triton", dllm_block_length=4)
        with pipeline(dllm_ckpt, engine_config=config) as pipe:
            runner = pipe.engine.executor.runner
            graphs = with_graphs(runner, eager_capture)
            graphs.table_width = -(-(max_model_len + 64) // 16)
            sizes = uploaded[max_model_len] = []
            upload = runner.uploader.upload

            def measured(fields, device, sizes=sizes, upload=upload):
                sizes.append(sum(len(values) for values in fields.values()))
                return upload(fields, device)

            runner.uploader.upload = measured
            pipe(prompts([30, 9, 17], seed=3), gen_config=GenerationConfig(max_new_tokens=12, ignore_eos=True))
            assert graphs.replays > 0
    assert uploaded[128] == uploaded[2048]
