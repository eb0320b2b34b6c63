"""DiffusionGemma through ModelRunner and ForwardBatch: encoder and canvas passes of several requests
of different lengths in one forward, self-conditioning kept on the rank between canvas steps, the
two layer groups' pools sized by the runner and filled through the page manager; logits equal
transformers' DiffusionGemmaForBlockDiffusion (float32, CPU, SDPA, DynamicCache) within 1e-4."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig
from engine.kv.page_manager import KVPageManager, PageTable
from engine.model.checkpoint import load_model_spec
from engine.model.families.diffusion_gemma.config import FULL, SLIDING
from engine.worker.forward_batch import NO_TABLES, ForwardBatch
from engine.worker.runner import ModelRunner
from testing.references.diffusion_gemma import (
    ReferenceSequence,
    assert_close,
    random_tokens,
)

pytest.importorskip("transformers.models.diffusion_gemma")
PAGE = 4


@pytest.fixture(scope="module")
def ckpt(gemma_ckpt):
    return gemma_ckpt


@pytest.fixture(scope="module")
def reference(gemma_reference):
    return gemma_reference


@pytest.fixture(scope="module", params=["torch", "flex"])
def runner(ckpt, request):
    """A runner on each attention backend (flex eager on the CPU), each checked against transformers."""
    config = EngineConfig(device="cpu", kv_block_size=PAGE, num_kv_blocks=1024, max_batch_size=4,
                          max_prefill_token_num=256, attention_backend=request.param)
    runner = ModelRunner(load_model_spec(ckpt), config)
    assert runner.backend.name == request.param
    return runner


class Driver:
    """Requests on the runner: per-group page tables from one page manager per pool; sliding pages
    before the window released after each encoder pass."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.window = runner, runner.model.gemma.sliding_window
        pools = runner.layer_groups.pools
        self.managers = {g: KVPageManager(pools[g], PAGE, enable_prefix_caching=False) for g in (SLIDING, FULL)}
        self.tables: dict[str, dict[str, PageTable]] = {}
        self.length: dict[str, int] = {}

    def forward(self, work: list[tuple[str, str, list[int], str | None, float | None]]) -> list[torch.Tensor]:
        """(request, "encode"/"canvas", tokens, self-conditioning key read, temperature kept) passes."""
        batch = ForwardBatch(input_ids=[], positions=[], q_lens=[], kv_lens=[], slot_mapping=[], page_tables=NO_TABLES,
                             group_page_tables={SLIDING: [], FULL: []})
        for req, kind, tokens, read, keep in work:
            tables = self.tables.setdefault(req, {g: PageTable() for g in self.managers})
            start = self.length.setdefault(req, 0)
            if kind == "encode":
                for g, manager in self.managers.items():
                    assert manager.allocate(tables[g], start + len(tokens))
            batch.sample_rows += range(len(batch.input_ids), len(batch.input_ids) + len(tokens))
            batch.input_ids += tokens
            batch.positions += range(start, start + len(tokens))
            batch.q_lens.append(len(tokens))
            batch.kv_lens.append(start + len(tokens))
            batch.pass_kinds.append(kind)
            for g in self.managers:
                batch.group_page_tables[g].append(list(tables[g].pages))
            batch.conditioning_keys.append(read)
            batch.keep_conditioning.append(None if keep is None else (req, keep))
        logits = self.runner.execute(batch).logits
        out, row = [], 0
        for req, kind, tokens, _, _ in work:
            out.append(logits[row: row + len(tokens)])
            row += len(tokens)
            if kind == "encode":
                self.length[req] += len(tokens)
                self.managers[SLIDING].release_before(self.tables[req][SLIDING], self.length[req] - (self.window - 1))
        return out


def test_flash_attention_refused_by_name(ckpt):
    """No flash kernel takes a canvas pass or head_dim 32 beside 16: asking for one is refused at engine
    start, naming the field and what to use instead."""
    config = EngineConfig(device="cpu", kv_block_size=PAGE, num_kv_blocks=64, attention_backend="flash")
    with pytest.raises(ValueError, match=r"attention_backend='flash' cannot run a diffusion_gemma model.*"
                                         r"head_dim \[16, 32\].*'flex', 'torch' or 'auto'"):
        ModelRunner(load_model_spec(ckpt), config)


def test_pools_know_the_groups(runner):
    layout, pools = runner.layer_groups.layout, runner.layer_groups.pools
    assert pools[FULL] == 1024 and pools[SLIDING] == 4 * layout.window_pages(256) < pools[FULL]
    for geo, (k, v) in zip(runner.model.gemma.layers, runner.kv_caches, strict=True):
        assert k.shape == v.shape == (pools[geo.kind], PAGE, geo.num_kv_heads, geo.head_dim)


def test_requests_of_different_lengths_in_one_forward(runner, reference):
    vocab, canvas_len = runner.model.gemma.vocab_size, runner.model.gemma.canvas_length
    driver = Driver(runner)
    prompts = {"a": random_tokens(1, 1, vocab), "b": random_tokens(9, 2, vocab), "c": random_tokens(40, 3, vocab)}
    refs = {r: ReferenceSequence(reference) for r in prompts}
    outs = driver.forward([(r, "encode", p, None, None) for r, p in prompts.items()])
    for out, (r, p) in zip(outs, prompts.items(), strict=True):
        assert_close(out, refs[r].encode(p))
    temperature = 0.8
    canvases = {r: random_tokens(canvas_len, 10 + i, vocab) for i, r in enumerate(prompts)}
    outs = driver.forward([(r, "canvas", c, None, temperature) for r, c in canvases.items()])
    first = {}
    for out, (r, c) in zip(outs, canvases.items(), strict=True):
        first[r] = refs[r].canvas(c)
        assert_close(out, first[r])
    # step 2 of "a" and "c" (self-conditioned on step 1 / T), "b" commits its canvas meanwhile
    nxt = {r: random_tokens(canvas_len, 20 + i, vocab) for i, r in enumerate(prompts)}
    commit_b = first["b"].argmax(-1).tolist()
    outs = driver.forward([("a", "canvas", nxt["a"], "a", None), ("b", "encode", commit_b, None, None),
                           ("c", "canvas", nxt["c"], "c", None)])
    assert_close(outs[0], refs["a"].canvas(nxt["a"], first["a"] / temperature))
    assert_close(outs[1], refs["b"].encode(commit_b))
    assert_close(outs[2], refs["c"].canvas(nxt["c"], first["c"] / temperature))
    # "b"'s second canvas after its commit
    assert_close(driver.forward([("b", "canvas", nxt["b"], None, None)])[0], refs["b"].canvas(nxt["b"]))


def test_long_context_holds_only_the_window_in_sliding_pages(runner, reference):
    vocab = runner.model.gemma.vocab_size
    driver, ref = Driver(runner), ReferenceSequence(reference)
    prompt = random_tokens(3000, 5, vocab)
    for i in range(0, len(prompt), 256):
        chunk = prompt[i: i + 256]
        assert_close(driver.forward([("long", "encode", chunk, None, None)])[0], ref.encode(chunk))
        held = driver.managers[SLIDING].held_pages(driver.tables["long"][SLIDING])
        assert held <= -(-(runner.model.gemma.sliding_window - 1) // PAGE) + 1
    canvas = random_tokens(runner.model.gemma.canvas_length, 6, vocab)
    assert_close(driver.forward([("long", "canvas", canvas, None, None)])[0], ref.canvas(canvas))
