"""CUDA-graph bucketing, padding and persistent buffers (engine.worker.cuda_graphs), on the CPU.

Capture itself needs a GPU; everything around it runs here with a stand-in capture that records the
forward as a function of the persistent input buffers and "replays" it by running it again into the
persistent output -- so a step whose inputs were not copied into those buffers, or a padded dummy
sequence that touched a real page, shows up as a different output. Engine runs with graphs give the
same tokens and step maps as without; the flash backend (through the kernel substitute) sees the same
shapes at every replay of a graph, as a real capture requires.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from test_flash_kernels import KERNELS

from engine import EngineConfig, GenerationConfig, pipeline
from engine.worker.cuda_graphs import StepGraphs, _Graph, batch_buckets, graph_entries, pad_batch
from engine.worker.forward_batch import ForwardBatch
from ops.attention import FlashAttention


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
                        slot_mapping=slots, page_tables=pages, sample_rows=[0, 1], **extra)


def test_buckets():
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(1) == [1]
    graphs = StepGraphs(100, 8, 128, eager_capture)
    assert [graphs.bucket(n) for n in (1, 3, 17, 97, 100, 101)] == [1, 4, 24, 100, 100, None]


@pytest.mark.parametrize("q_lens, kv_lens, block, shape", [
    ([1, 1, 1], [5, 9, 30], None, (3, 1)),  # AR decode: an entry per sequence
    ([1, 7], [5, 9], None, None),  # a prefill chunk next to a decode row
    ([4, 4, 4], [8, 36, 4], 4, (3, 4)),  # denoising steps: an entry per block
    ([8, 8], [8, 16], 4, (4, 4)),  # fused commit + next block: two entries each
    ([4, 8, 4], [8, 16, 12], 4, (4, 4)),  # both in one step
    ([4, 4], [10, 16], 4, None),  # not on a block boundary
    ([12], [12], 4, None),  # a prefill of three blocks
])
def test_which_steps_replay_a_graph(q_lens, kv_lens, block, shape):
    assert graph_entries(batch(q_lens, kv_lens), block) == shape


def test_scoring_and_kv_copies_run_eagerly():
    assert graph_entries(batch([1, 1], [5, 9], score_rows=[0], score_targets=[1]), None) is None
    assert graph_entries(batch([1, 1], [5, 9], kv_copy_src=[1], kv_copy_dst=[2]), None) is None


def test_padding_appends_dummies_in_the_null_page_only():
    b = batch([4, 8], [8, 16])
    padded = pad_batch(b, 5, 4, null_page=99, page_size=16)
    assert padded.q_lens == [4, 8] + [4] * 5 and padded.kv_lens == [8, 16] + [4] * 5
    assert padded.page_tables[:2] == b.page_tables and padded.page_tables[2:] == [[99]] * 5
    assert padded.slot_mapping[:12] == b.slot_mapping
    assert padded.slot_mapping[12:] == [99 * 16 + p for p in range(4)] * 5
    assert padded.positions[12:] == [0, 1, 2, 3] * 5 and len(padded.input_ids) == 32
    assert padded.sample_rows == b.sample_rows
    with pytest.raises(ValueError, match="null page"):
        pad_batch(batch([32], [32]), 2, 32, null_page=99, page_size=16)


def with_graphs(runner, max_entries: int = 16) -> StepGraphs:
    """Graphs (stand-in capture) on a CPU runner, with the extra KV page as the null page."""
    runner.graphs = StepGraphs(max_entries, -(-256 // runner.config.kv_block_size) + 4, 320, eager_capture)
    runner.null_page = runner.num_pages
    runner.kv_caches = runner._allocate_kv()
    return runner.graphs


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


def serve(path: str, graphs: bool, gen: GenerationConfig, backend=None, **engine):
    config = EngineConfig(kv_block_size=16, num_kv_blocks=64, max_model_len=256, max_prefill_token_num=24, **engine)
    with pipeline(path, engine_config=config) as pipe:
        runner = pipe.engine.executor.runner
        assert runner.graphs is None, "no graphs on the CPU unless a test installs them"
        if backend is not None:
            runner.backend = backend
        steps = with_graphs(runner) if graphs else None
        outs = pipe(prompts([30, 9, 17, 5, 12], seed=1), gen_config=gen)
    return outs, steps


def same(a, b) -> bool:
    return all((x.token_ids, x.step_map) == (y.token_ids, y.step_map) for x, y in zip(a, b, strict=True))


FLASH = FlashAttention(KERNELS["bundled"])  # graphs run with the flash backend (here its substitute, bfloat16)


def test_dllm_outputs_with_graphs_equal_outputs_without(dllm_ckpt):
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    eager, _ = serve(dllm_ckpt, False, gen, backend=FLASH, dtype="bfloat16", dllm_block_length=4)
    graphed, graphs = serve(dllm_ckpt, True, gen, backend=FLASH, dtype="bfloat16", dllm_block_length=4)
    assert same(graphed, eager)
    assert graphs.replays > len(graphs._graphs), "graphs replayed with new inputs, not only captured"
    assert all(size in batch_buckets(16) and rows == 4 for size, rows in graphs._graphs)
    for (size, _), graph in graphs._graphs.items():  # the captured shapes: what every replay copies into
        assert graph.inputs["input_ids"].shape == (size * 4,)
        assert graph.inputs["plan.cu_seqlens_q"].shape == (size + 1,)
        assert graph.inputs["page_tables"].shape == (size * graphs.table_width,)


def test_ar_outputs_with_graphs_equal_outputs_without(ar_ckpt):
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    eager, _ = serve(ar_ckpt, False, gen, backend=FLASH, dtype="bfloat16")
    graphed, graphs = serve(ar_ckpt, True, gen, backend=FLASH, dtype="bfloat16")
    assert same(graphed, eager)
    assert graphs.replays > len(graphs._graphs) and {rows for _, rows in graphs._graphs} == {1}


def test_graphs_of_another_model_or_cache_are_dropped():
    """Weights or KV cache released and resumed make new objects: the first step over them captures anew."""
    graphs = StepGraphs(4, 2, 32, eager_capture)
    replayed = []
    graph = _Graph({"input_ids": torch.zeros(4)}, lambda: replayed.append(1), torch.zeros(1))

    class Model:
        pass

    model, cache = Model(), torch.zeros(2)
    for owners in [(Model(), cache), (model, torch.zeros(2))]:
        graphs._graphs[(4, 1)] = graph  # as if captured over (model, cache)
        graphs._owners = [weakref.ref(model), weakref.ref(cache)]
        replayed.clear()
        assert graphs.run((4, 1), {"input_ids": torch.ones(4)}, None, None, (model, cache)) is graph.out
        assert replayed == [1] and torch.equal(graph.inputs["input_ids"], torch.ones(4))
        with pytest.raises(AttributeError):  # captures anew (and this test's meta is None)
            graphs.run((4, 1), {"input_ids": torch.ones(4)}, None, None, owners)
        assert graphs._graphs == {}
