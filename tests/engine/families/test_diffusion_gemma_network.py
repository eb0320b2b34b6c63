"""DiffusionGemma's network on paged per-group K/V caches against transformers'
DiffusionGemmaForBlockDiffusion (float32, CPU, SDPA, DynamicCache), pass by pass as generate() runs
them: encoder prefill, canvas passes with and without self-conditioning, commits."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import CheckpointError
from engine.kv.page_manager import KVPageManager, PageTable
from engine.model.checkpoint import iter_weights
from engine.model.families.diffusion_gemma.attention import CANVAS, ENCODE, GemmaAttentionMeta, GemmaPass
from engine.model.families.diffusion_gemma.config import FULL, SLIDING, load_gemma_spec, parse_config
from engine.model.families.diffusion_gemma.loading import load_gemma_weights
from engine.model.families.diffusion_gemma.network import DiffusionGemmaNetwork
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


@pytest.fixture(scope="module")
def network(ckpt):
    spec = load_gemma_spec(ckpt)
    net = DiffusionGemmaNetwork(spec).eval()
    load_gemma_weights(net, iter_weights(ckpt))
    return net


class PagedEngine:
    """Sequences on the network through two page managers, one per layer group; sliding-group
    pages before the window are released after every encoder pass."""

    def __init__(self, net: DiffusionGemmaNetwork, pages: int = 256):
        self.net, spec = net, net.spec
        self.window = spec.sliding_window
        self.managers = {kind: KVPageManager(pages, PAGE, enable_prefix_caching=False) for kind in (SLIDING, FULL)}
        self.caches = [tuple(torch.zeros(pages, PAGE, g.num_kv_heads, g.head_dim) for _ in range(2))
                       for g in spec.layers]
        self.tables: dict[int, dict[str, PageTable]] = {}
        self.length: dict[int, int] = {}

    def add(self, seq: int) -> None:
        self.tables[seq] = {kind: PageTable() for kind in self.managers}
        self.length[seq] = 0

    def forward(self, work: list[tuple[int, str, list[int], torch.Tensor | None]]) -> list[torch.Tensor]:
        """One forward over (seq, kind, token ids, self-conditioning logits) passes; logits per pass."""
        passes, ids, positions = [], [], []
        for seq, kind, tokens, sc in work:
            start = self.length[seq]
            if kind == ENCODE:
                for k, m in self.managers.items():
                    assert m.allocate(self.tables[seq][k], start + len(tokens))
            soft = None if sc is None else self.net.soft_embedding(sc)
            passes.append(GemmaPass(kind, start, len(tokens), {k: t.pages for k, t in self.tables[seq].items()}, soft))
            ids += tokens
            positions += range(start, start + len(tokens))
        meta = GemmaAttentionMeta(passes, PAGE, self.window, torch.device("cpu"))
        with torch.inference_mode():
            hidden = self.net(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
            logits = self.net.logits(hidden)
        out, row = [], 0
        for seq, kind, tokens, _ in work:
            out.append(logits[row: row + len(tokens)])
            row += len(tokens)
            if kind == ENCODE:
                self.length[seq] += len(tokens)
                self.managers[SLIDING].release_before(self.tables[seq][SLIDING],
                                                      self.length[seq] - (self.window - 1))
        return out


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 40])
def test_encoder_and_canvas_match_transformers(reference, network, prompt_len):
    spec = network.spec
    prompt = random_tokens(prompt_len, prompt_len, spec.vocab_size)
    canvas = random_tokens(spec.canvas_length, 100 + prompt_len, spec.vocab_size)
    ref = ReferenceSequence(reference)
    eng = PagedEngine(network)
    eng.add(0)
    assert_close(eng.forward([(0, ENCODE, prompt, None)])[0], ref.encode(prompt))
    first = ref.canvas(canvas)
    assert_close(eng.forward([(0, CANVAS, canvas, None)])[0], first)
    # the next step: a new canvas, self-conditioned on the first step's processed logits
    processed = first / 0.7
    canvas2 = random_tokens(spec.canvas_length, 200 + prompt_len, spec.vocab_size)
    assert_close(eng.forward([(0, CANVAS, canvas2, processed)])[0], ref.canvas(canvas2, processed))


def test_commit_then_second_canvas(reference, network):
    spec = network.spec
    ref, eng = ReferenceSequence(reference), PagedEngine(network)
    eng.add(0)
    prompt = random_tokens(5, 1, spec.vocab_size)
    ref.encode(prompt)
    eng.forward([(0, ENCODE, prompt, None)])
    for block in range(3):  # commits cross the window: 5 + 16 + 16 ... > 8
        draft = random_tokens(spec.canvas_length, 10 + block, spec.vocab_size)
        sc = ref.canvas(draft)
        committed = sc.argmax(-1).tolist()
        assert_close(eng.forward([(0, ENCODE, committed, None)])[0], ref.encode(committed))
        nxt = random_tokens(spec.canvas_length, 20 + block, spec.vocab_size)
        assert_close(eng.forward([(0, CANVAS, nxt, sc)])[0], ref.canvas(nxt, sc))


def test_batched_sequences_of_different_lengths(reference, network):
    """Several sequences in one forward: prefills, a canvas and a commit together equal each alone."""
    spec = network.spec
    lengths = [3, 9, 21]
    refs = [ReferenceSequence(reference) for _ in lengths]
    eng = PagedEngine(network)
    prompts = [random_tokens(n, 30 + n, spec.vocab_size) for n in lengths]
    for s in range(len(prompts)):
        eng.add(s)
    outs = eng.forward([(s, ENCODE, p, None) for s, p in enumerate(prompts)])
    for s, p in enumerate(prompts):
        assert_close(outs[s], refs[s].encode(p))
    canvases = [random_tokens(spec.canvas_length, 40 + s, spec.vocab_size) for s in range(3)]
    commit = random_tokens(spec.canvas_length, 50, spec.vocab_size)
    sc = torch.randn(spec.canvas_length, spec.vocab_size, generator=torch.Generator().manual_seed(3))
    outs = eng.forward([(0, CANVAS, canvases[0], None), (1, ENCODE, commit, None), (2, CANVAS, canvases[2], sc)])
    assert_close(outs[0], refs[0].canvas(canvases[0]))
    assert_close(outs[1], refs[1].encode(commit))
    assert_close(outs[2], refs[2].canvas(canvases[2], sc))
    outs = eng.forward([(1, CANVAS, canvases[1], None)])
    assert_close(outs[0], refs[1].canvas(canvases[1]))


def test_long_context_keeps_only_the_window_pages(reference, network):
    """3,000 committed tokens (chunked prefill of 256) on a window-8 model: the sliding group holds at
    most the pages the window needs, the full group all of them, and the canvas logits still equal."""
    spec = network.spec
    ref, eng = ReferenceSequence(reference), PagedEngine(network, pages=1024)
    eng.add(0)
    prompt = random_tokens(3000, 7, spec.vocab_size)
    window_pages = -(-(spec.sliding_window - 1) // PAGE) + 1
    for i in range(0, len(prompt), 256):
        chunk = prompt[i: i + 256]
        assert_close(eng.forward([(0, ENCODE, chunk, None)])[0], ref.encode(chunk))
        assert eng.managers[SLIDING].held_pages(eng.tables[0][SLIDING]) <= window_pages
    assert eng.managers[FULL].held_pages(eng.tables[0][FULL]) == -(-3000 // PAGE)
    canvas = random_tokens(spec.canvas_length, 8, spec.vocab_size)
    assert_close(eng.forward([(0, CANVAS, canvas, None)])[0], ref.canvas(canvas))


def test_both_config_forms_parse_alike(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    saved = parse_config(cfg)  # per_layer_config, as save_pretrained wrote it
    text = dict(cfg["text_config"])
    del text["per_layer_config"]
    text |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    assert parse_config({**cfg, "text_config": text}) == saved
    assert [g.kind for g in saved.layers] == [SLIDING, FULL, SLIDING, SLIDING, FULL]
    assert [(g.head_dim, g.num_kv_heads, g.has_v_proj) for g in saved.layers[:2]] == [(16, 2, True), (32, 1, False)]


@pytest.mark.parametrize("field, value", [
    ("use_bidirectional_attention", "all"), ("hidden_activation", "silu"), ("attention_bias", True),
    ("tie_word_embeddings", False), ("attn_logit_softcapping", 50.0), ("num_kv_shared_layers", 2)])
def test_math_changing_fields_refused_by_name(ckpt, field, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"][field] = value
    with pytest.raises(CheckpointError, match=field):
        parse_config(cfg)


def test_unequal_layer_scalars_refused(ckpt, network):
    weights = dict(iter_weights(ckpt))
    name = "model.encoder.language_model.layers.2.layer_scalar"
    weights[name] = weights[name][...] + 0.5
    with pytest.raises(CheckpointError, match=r"layers\.2\.layer_scalar"):
        load_gemma_weights(DiffusionGemmaNetwork(network.spec), weights.items())


def test_release_configuration_shapes(tmp_path):
    """The release's config.json (tools.published_checkpoints): 25 sliding layers (head 256, 8 K/V
    heads, window 1024) and 5 full ones (head 512, 2 K/V heads, V from k_proj), and at reduced depth
    the tensor names and shapes transformers writes."""
    from tools.published_checkpoints import PUBLISHED, _with_depth

    release = PUBLISHED["DiffusionGemma-26B-A4B"]
    gemma = parse_config(release)
    kinds = [g.kind for g in gemma.layers]
    assert kinds.count(SLIDING) == 25 and kinds.count(FULL) == 5 and gemma.sliding_window == 1024
    assert {(g.kind, g.head_dim, g.num_kv_heads, g.has_v_proj, g.rotated_pairs) for g in gemma.layers} == {
        (SLIDING, 256, 8, True, 128), (FULL, 512, 2, False, 64)}
    with torch.device("meta"):
        net = DiffusionGemmaNetwork(parse_config(_with_depth(release, 2)))
    shapes = {name: tuple(p.shape) for name, p in net.named_parameters()}
    assert shapes["model.decoder.embed_tokens.weight"] == (262144, 2816)
    assert shapes["model.decoder.layers.0.experts.gate_up_proj"] == (128, 1408, 2816)
    assert shapes["model.decoder.layers.0.experts.down_proj"] == (128, 2816, 704)
    assert shapes["model.decoder.layers.0.self_attn.v_proj.weight"] == (8 * 256, 2816)
    assert shapes["model.decoder.layers.1.self_attn.q_proj.weight"] == (16 * 512, 2816)
    assert shapes["model.decoder.layers.1.self_attn.k_proj.weight"] == (2 * 512, 2816)
    assert "model.decoder.layers.1.self_attn.v_proj.weight" not in shapes
