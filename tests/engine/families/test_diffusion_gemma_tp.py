"""DiffusionGemma at tensor-parallel size 2 (heads, K/V heads — 2 on the full layers — the MLP and
every expert's intermediate channels split; float32 partial sums all-reduced) gives the logits of
tp=1 within 1e-4: two CPU ranks over gloo, each loading its slices through the engine's loader."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.kv.page_manager import KVPageManager, PageTable
from engine.model.checkpoint import iter_weights
from engine.model.families.diffusion_gemma.attention import CANVAS, ENCODE, GemmaAttentionMeta, GemmaPass
from engine.model.families.diffusion_gemma.config import FULL, SLIDING, load_gemma_spec
from engine.model.families.diffusion_gemma.network import DiffusionGemmaNetwork
from engine.model.layers.parallel import TPContext
from engine.model.loading import load_weights
from tests.support.ranks import gloo_rank

pytest.importorskip("transformers.models.diffusion_gemma")
PAGE = 4


def build(path: str, tp: TPContext) -> DiffusionGemmaNetwork:
    with torch.device("meta"):
        net = DiffusionGemmaNetwork(load_gemma_spec(path), tp)
    net.materialize(torch.device("cpu"), torch.float32).eval()
    load_weights(net, iter_weights(path))
    net.check_loaded()
    return net


def scenario(net: DiffusionGemmaNetwork, backend: str = "torch") -> list[torch.Tensor]:
    """Two prompts (9 and 40 tokens) prefilled together, a canvas each (one self-conditioned on the
    other's first canvas logits), a commit beside a canvas: every pass's logits, attended by `backend`."""
    gemma = net.gemma
    pools = {SLIDING: 64, FULL: 64}
    caches = net.kv_layout(PAGE, net.tp.size).allocate(pools, torch.float32, torch.device("cpu"))
    managers = {g: KVPageManager(pools[g], PAGE, enable_prefix_caching=False) for g in pools}
    tables = [{g: PageTable() for g in pools} for _ in range(2)]
    length = [0, 0]
    gen = torch.Generator().manual_seed(0)
    out: list[torch.Tensor] = []
    attention = net.attention_backend(net.spec, backend, torch.device("cpu"))

    def forward(work):
        passes, ids, positions = [], [], []
        for s, kind, tokens, soft in work:
            if kind == ENCODE:
                for g, m in managers.items():
                    assert m.allocate(tables[s][g], length[s] + len(tokens))
            passes.append(GemmaPass(kind, length[s], len(tokens), {g: t.pages for g, t in tables[s].items()}, soft))
            ids += tokens
            positions += range(length[s], length[s] + len(tokens))
        with torch.inference_mode():
            hidden = net(torch.tensor(ids), torch.tensor(positions), caches,
                         GemmaAttentionMeta(passes, PAGE, gemma.sliding_window, torch.device("cpu"), attention))
            logits = net.logits(hidden)
        for s, kind, tokens, _ in work:
            if kind == ENCODE:
                length[s] += len(tokens)
        out.append(logits)
        return logits

    def rand(n):
        return torch.randint(0, gemma.vocab_size, (n,), generator=gen).tolist()

    forward([(0, ENCODE, rand(9), None), (1, ENCODE, rand(40), None)])
    first = forward([(0, CANVAS, rand(gemma.canvas_length), None)])
    with torch.inference_mode():
        soft = net.soft_embedding(first / 0.8)
    forward([(1, CANVAS, rand(gemma.canvas_length), soft), (0, ENCODE, first.argmax(-1).tolist(), None)])
    forward([(0, CANVAS, rand(gemma.canvas_length), None)])
    return out


def _rank(rank: int, path: str, port: int, result: str, backend: str) -> None:
    with gloo_rank(rank, port):
        logits = scenario(build(path, TPContext(rank=rank, size=2)), backend)
        if rank == 0:
            torch.save(logits, result)


@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_tp2_equals_tp1(tmp_path, backend):
    """tp=2 on each attention backend (flex: eager FlexAttention) against tp=1 on the torch reference."""
    from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma

    path = str(write_tiny_diffusion_gemma(tmp_path / "tiny", num_global_key_value_heads=2))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = str(tmp_path / "tp2.pt")
    mp.spawn(_rank, args=(path, port, result, backend), nprocs=2, join=True)
    tp1 = scenario(build(path, TPContext()))
    tp2 = torch.load(result)
    assert len(tp1) == len(tp2) == 4
    for a, b in zip(tp1, tp2, strict=True):
        assert (a - b).abs().max().item() < 1e-4


def test_tp_that_does_not_divide_is_refused(tmp_path):
    from engine.errors import CheckpointError
    from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma

    path = write_tiny_diffusion_gemma(tmp_path / "tiny")  # full layers: 1 K/V head
    with pytest.raises(CheckpointError, match="layer 1 num_key_value_heads=1"):
        DiffusionGemmaNetwork(load_gemma_spec(path), TPContext(rank=0, size=2))
