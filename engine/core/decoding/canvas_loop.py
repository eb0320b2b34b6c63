"""Requests of a renoising-canvas model (DiffusionGemma) decoded together on one model runner.

Each forward holds one pass per active request: an *encoder pass* (the prompt, or the commit of the
request's last canvas: its emitted tokens at the canvas's positions, writing their K/V) or a
*canvas pass* (every canvas position scored, reading the committed K/V, writing nothing). The
runner keeps each request's self-conditioning between its canvas steps; the sampler runs per
request on that request's [L, V] rows (`renoising.CanvasState`), so a request's tokens depend on
its seed only, never on the batch around it.

Pages come from one page manager per layer group (sliding-window and full attention); a sliding
group's pages before the window are released after each encoder pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from configs import GenerationConfig
from engine.core.decoding.renoising import CanvasState, RenoiseKnobs, request_generator
from engine.kv.page_manager import KVPageManager, PageTable
from engine.model.families.diffusion_gemma.config import SLIDING
from engine.worker.forward_batch import ForwardBatch, ForwardOutput

ENCODE, CANVAS = "encode", "canvas"


@dataclass
class CanvasResult:
    """A finished request: its tokens (cut at the first stop id, kept, or at max_new_tokens), each
    token's settle step, per canvas {steps, stop}, the step trace and logprobs when asked."""

    request_id: str
    output_ids: list[int]
    step_map: list[int]
    finish_reason: str
    replay: list[dict]
    trace: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)


class _Request:
    def __init__(self, rid: str, prompt: list[int], params: GenerationConfig, state: CanvasState,
                 stop_ids: frozenset[int], raw_logprobs: bool):
        self.rid, self.params, self.state, self.raw_logprobs = rid, params, state, raw_logprobs
        self.stop_ids = frozenset() if params.ignore_eos else stop_ids | frozenset(params.stop_token_ids or ())
        self.pending = list(prompt)  # tokens its next encoder pass writes
        self.committed = 0
        self.tables: dict[str, PageTable] = {}
        self.result = CanvasResult(rid, [], [], "", state.replay)


class CanvasDecoder:
    """Runs renoising requests to completion through `execute` (a model runner's or executor's)."""

    def __init__(self, execute: Callable[[ForwardBatch], ForwardOutput], pools: dict[str, int], page_size: int,
                 sliding_window: int, canvas_length: int, vocab_size: int, knobs: RenoiseKnobs,
                 stop_ids: frozenset[int] = frozenset(), max_batch_size: int = 64,
                 device: torch.device | str = "cpu", max_prefill_tokens: int = 256):
        self.execute, self.page_size, self.window = execute, page_size, sliding_window
        self.canvas_length, self.vocab_size, self.knobs = canvas_length, vocab_size, knobs
        self.stop_ids, self.max_batch_size, self.device = stop_ids, max_batch_size, torch.device(device)
        self.chunk = max_prefill_tokens  # the most tokens one encoder pass writes (a long prompt goes in chunks)
        self.managers = {g: KVPageManager(n, page_size, enable_prefix_caching=False) for g, n in pools.items()}
        self.waiting: list[_Request] = []
        self.active: list[_Request] = []
        self.drop: list[str] = []

    def add(self, rid: str, prompt: list[int], params: GenerationConfig, knobs: RenoiseKnobs | None = None,
            raw_logprobs: bool = False) -> None:
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        state = CanvasState(knobs or self.knobs, request_generator(params.random_seed, self.device),
                            self.canvas_length, self.vocab_size, keep_logits=params.logprobs is not None)
        self.waiting.append(_Request(rid, prompt, params, state, self.stop_ids, raw_logprobs))

    def run(self) -> list[CanvasResult]:
        """Decode every added request; results in the order they finished."""
        done: list[CanvasResult] = []
        while self.has_unfinished():
            done += self.step()
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    def step(self) -> list[CanvasResult]:
        """One forward over every active request (admitting waiting ones first); the requests it finished."""
        while self.waiting and len(self.active) < self.max_batch_size:
            self.active.append(self.waiting.pop(0))
        groups = list(self.managers)
        batch = ForwardBatch(input_ids=[], positions=[], q_lens=[], kv_lens=[], slot_mapping=[], page_tables=[],
                             group_page_tables={g: [] for g in groups}, drop_conditioning=self.drop)
        self.drop = []
        for r in self.active:
            kind = ENCODE if r.pending else CANVAS
            tokens = r.pending[: self.chunk] if kind == ENCODE else r.state.tokens[0].tolist()
            if kind == ENCODE:
                for g, manager in self.managers.items():
                    table = r.tables.setdefault(g, PageTable())
                    if not manager.allocate(table, r.committed + len(tokens)):
                        raise RuntimeError(f"out of K/V pages in the {g} pool: lower the concurrency")
            else:
                batch.sample_rows += range(len(batch.input_ids), len(batch.input_ids) + len(tokens))
            batch.input_ids += tokens
            batch.positions += range(r.committed, r.committed + len(tokens))
            batch.q_lens.append(len(tokens))
            batch.kv_lens.append(r.committed + len(tokens))
            batch.pass_kinds.append(kind)
            for g in groups:
                batch.group_page_tables[g].append(list(r.tables[g].pages))
            canvas = kind == CANVAS
            batch.conditioning_keys.append(r.rid if canvas and r.state.canvas_step else None)
            batch.keep_conditioning.append((r.rid, r.state.temperature) if canvas else None)
        logits = self.execute(batch).logits
        finished, row = [], 0
        for r, kind, written in zip(self.active, batch.pass_kinds, batch.q_lens, strict=True):
            if kind == ENCODE:
                self._committed(r, written)
            elif self._canvas_step(r, logits[row: row + self.canvas_length].float()):
                finished.append(r)
            if kind == CANVAS:
                row += self.canvas_length
        for r in finished:
            self.active.remove(r)
            self.drop.append(r.rid)
            for g, manager in self.managers.items():
                manager.free(r.tables[g])
        return [r.result for r in finished]

    def _committed(self, r: _Request, written: int) -> None:
        r.committed += written
        del r.pending[:written]
        self.managers[SLIDING].release_before(r.tables[SLIDING], r.committed - (self.window - 1))
        if not r.pending:
            r.state.open_canvas()

    def _canvas_step(self, r: _Request, logits: torch.Tensor) -> bool:
        """Apply one canvas step; True when the request finished."""
        res, state = r.result, r.state
        base = len(res.output_ids)
        room = r.params.max_new_tokens - base
        report = state.step(logits)
        if r.params.return_step_trace:
            shown = [(p, t) for p, t in zip(report.positions, report.token_ids, strict=True) if p < room]
            res.trace.append({"step": report.step, "positions": [base + p for p, _ in shown],
                              "token_ids": [t for _, t in shown], "temperature": report.temperature,
                              "accepted": report.accepted, "mean_entropy": report.mean_entropy})
        if not report.ended:
            return False
        tokens, settle = state.close_canvas()
        new = tokens[:room]
        stop_at = next((i for i, t in enumerate(new) if t in r.stop_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
        res.output_ids += new
        res.step_map += settle[: len(new)]
        if r.params.logprobs is not None:
            res.logprobs += state.logprobs(r.raw_logprobs, r.params.logprobs)[: len(new)]
        self.drop.append(r.rid)
        if stop_at is not None or len(res.output_ids) >= r.params.max_new_tokens:
            res.finish_reason = "stop" if stop_at is not None else "length"
            return True
        r.pending = tokens
        return False
