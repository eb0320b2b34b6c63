"""Renoising decoding (DiffusionGemma) as a decoding strategy: a canvas of L positions after the
committed tokens, refined as a whole until it stops, then committed and followed by the next. L is
the model's canvas length, or a narrower one a request (or the engine config) sets with
`dllm_canvas_length`; requests of different widths share a forward.

A request's tokens are the prompt, the emitted tokens of its finished canvases and its open canvas
(the tokens its next canvas pass is fed: uniform noise at first, then each step's accepted samples
and fresh noise). Per canvas:

- *canvas passes*: `feed_target` is (canvas end, True); the forward scores every canvas position,
  reads the committed K/V and writes none (`computed_after` stays at the canvas start). The picked
  rows are the raw logits of the L positions: this strategy samples them itself
  (`samples_logits`), with the request's own generator (`renoising.CanvasState`), so its draws never
  depend on the batch around it;
- when the canvas stops, its emitted tokens (the last step's argmax) replace it, each with its settle
  step and (when asked) its logprob; they are final (`num_final`), so the stop rule cuts the output
  at a stop id or `max_new_tokens`;
- if the request goes on, `after_step` opens the next canvas after them and the next forward is an
  *encoder pass* over the emitted tokens (`feed_target` (next canvas start, False)): the commit,
  which writes their K/V.

The prompt prefill is an encoder pass too, so a request costs its canvas passes plus one encoder pass
per canvas. The network's layer groups need what `pass_fields` adds to each forward: the pass kind
and the self-conditioning each canvas pass reads and keeps (the runner keeps it per request, under
the request id, from one canvas pass to the next; `release` drops it).

Typed decisions (`Sequence.decisions`) act on the canvases through `renoising.CanvasDecisions`:
- the template is the first canvas's initial state: its ids are pinned there for the whole canvas
  (fed as themselves every step, with zero self-conditioning -- `pass_fields` names their rows --,
  emitted as themselves, settle step 0); its slots start as the usual noise. It must fit the
  canvas; later canvases start from noise as always;
- an allowed set restricts its position's row in whichever canvas holds the position (every
  position of every canvas when one set is given without a template); the position's label mass
  goes to `decisions.label_mass` when its canvas ends. The sets act on the full-vocabulary logits
  rank 0 reads, so they hold at any tensor-parallel size;
- a read (the engine already cut its output to the template) stops its canvas after k steps at
  the latest; the canvas ends the output, so the request finishes (reason `read`) with no commit.
"""

from __future__ import annotations

from typing import Any

import torch

from configs import EngineConfig, GenerationConfig
from engine.carrier import StepEvent
from engine.core.decisions import Decisions
from engine.core.decoding.base import DecodingStrategy, Finalize, PickedRows
from engine.core.decoding.renoising import (
    CanvasDecisions,
    CanvasState,
    RenoiseKnobs,
    request_generator,
    step_canvases,
)
from engine.core.sequence import Sequence
from engine.errors import RequestError
from engine.model.spec import ModelSpec
from engine.worker.forward_batch import ForwardBatch
from engine.worker.runner import resolve_device

ENCODE, CANVAS = "encode", "canvas"
#: the most float32 logits one group of canvases is stepped with at once (a canvas alone may hold more)
GROUP_LOGITS_BYTES = 128 << 20


class RenoisingDecoding(DecodingStrategy):
    paradigm = "renoising"
    needs_confidence = False
    samples_logits = True
    has_pass_fields = True

    def __init__(self, canvas_length: int, vocab_size: int, knobs: RenoiseKnobs, logprobs_mode: str | None,
                 device: str = "cpu"):
        self.canvas_length, self.vocab_size, self.knobs = canvas_length, vocab_size, knobs
        self.logprobs_mode, self.device = logprobs_mode, device
        self._dropped: list[str] = []  # requests whose kept self-conditioning the next forward drops

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int | None) -> RenoisingDecoding:
        """The strategy of the model's canvas (`dllm_block_length`, resolved from its canvas_length);
        ValueError when the engine's `dllm_canvas_length` is wider."""
        knobs = RenoiseKnobs.of_engine(config)
        if knobs.canvas_length > config.dllm_block_length:
            raise ValueError(f"dllm_canvas_length={knobs.canvas_length} is wider than the model's canvas "
                             f"({config.dllm_block_length}); set at most that, or 0 for the model's")
        return cls(config.dllm_block_length, spec.vocab_size, knobs, config.logprobs_mode, str(resolve_device(config)))

    def width(self, knobs: RenoiseKnobs) -> int:
        """The canvas length a request with these knobs decodes on: its own `canvas_length`, else the model's."""
        return knobs.canvas_length or self.canvas_length

    def check_request(self, params: GenerationConfig, settings: None) -> None:
        super().check_request(params, settings)
        if params.dllm_trajectory is not None:
            raise RequestError("dllm_trajectory scores block-diffusion rollouts and this model decodes by renoising "
                               "a canvas (its tokens come from samples of every position at every step, which a "
                               "rollout's step map does not record); leave it unset", "dllm_trajectory")
        refused = {"repetition_penalty": params.repetition_penalty != 1.0, "min_new_tokens": params.min_new_tokens > 0,
                   "min_p": params.min_p > 0.0}
        for name, given in refused.items():
            if given:
                raise RequestError(f"{name} does not apply to this model: it decodes by renoising a canvas, whose "
                                   "schedule and entropy bound decide what is sampled; leave it unset", name)
        try:
            knobs = self.knobs.for_request(params)
        except ValueError as e:
            field = "dllm_t_min" if params.dllm_t_min is not None else "dllm_t_max"
            raise RequestError(str(e), field) from None
        if knobs.canvas_length > self.canvas_length:
            raise RequestError(f"dllm_canvas_length={knobs.canvas_length} is wider than this model's canvas "
                               f"({self.canvas_length}): a request may only narrow it; set at most "
                               f"{self.canvas_length}, or leave it unset", "dllm_canvas_length")

    def check_decisions(self, params: GenerationConfig, settings: None, decisions: Decisions) -> None:
        """A template (a read's included) must fit the request's first canvas: it is that canvas's
        initial state."""
        width = self.width(self.knobs.for_request(params))
        if decisions.length > width:
            field = "dllm_template" if params.dllm_template is not None else "max_new_tokens"
            raise RequestError(f"{field}: a read or template covers {decisions.length} output positions but this "
                               f"request's canvas holds {width}: the template is the first canvas's initial state "
                               "(and a read is one canvas); shorten it or widen dllm_canvas_length", field)

    # ---- the request's state ------------------------------------------------------------------
    def start(self, seq: Sequence, settings: None) -> None:
        p, decisions = seq.params, seq.decisions
        generator, knobs = request_generator(seq.seed, self.device), self.knobs.for_request(p)
        seq.state = CanvasState(knobs, generator, self.width(knobs), self.vocab_size,
                                 top_k=p.top_k, top_p=p.top_p, logprobs=p.logprobs, logprobs_mode=self.logprobs_mode,
                                 read_steps=decisions.read_steps if decisions is not None else None)
        seq.stop_bound = p.max_new_tokens
        self._open_canvas(seq)

    def _canvas_decisions(self, seq: Sequence, first: int) -> CanvasDecisions | None:
        """The decisions of the canvas over generated indices first..first+L-1."""
        decisions, n = seq.decisions, seq.state.canvas_length
        if decisions is None:
            return None
        sets = {pos: ids for pos in range(n) if (ids := decisions.allowed(first + pos)) is not None}
        return CanvasDecisions.of(decisions.template[first: first + n], sets, n, self.device)

    def _open_canvas(self, seq: Sequence) -> None:
        seq.state.start = len(seq.tokens)
        seq.append_positions(seq.state.open_canvas(self._canvas_decisions(seq, seq.state.start - seq.prompt_len)))

    def release(self, seq: Sequence) -> None:
        self._dropped.append(seq.request_id)

    # ---- what to feed -------------------------------------------------------------------------
    def feed_target(self, seq: Sequence) -> tuple[int, bool]:
        start = seq.state.start
        if seq.num_computed < start:
            return start, False  # the prompt, or the commit of the last canvas
        return start + seq.state.canvas_length, True

    def cacheable_prefix(self, seq: Sequence) -> int:
        # committed tokens, less one: the first forward of an admitted request is an encoder pass
        # (a canvas pass is never split by the prefill budget, which admission charges)
        return seq.state.start - 1

    def is_decoding(self, seq: Sequence) -> bool:
        """A canvas pass (never split by the prefill budget), or the commit of a canvas."""
        start = seq.state.start
        if seq.num_computed >= start:
            return True
        return seq.step_counter > 0 and start - seq.num_computed <= seq.state.canvas_length

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        start = seq.state.start
        return list(range(start, start + seq.state.canvas_length))

    def computed_after(self, seq: Sequence, end: int, sampled: bool) -> int:
        return seq.state.start if sampled else end

    def pass_fields(self, batch: ForwardBatch, seq: Sequence, sample: bool) -> None:
        """The pass kind and the self-conditioning of the sequence's pass (plus, on the batch's first
        pass, the self-conditioning of requests that no longer need it)."""
        if not batch.pass_kinds:
            batch.drop_conditioning += self._dropped
            self._dropped = []
        canvas = seq.state
        batch.pass_kinds.append(CANVAS if sample else ENCODE)
        batch.conditioning_keys.append(seq.request_id if sample and canvas.canvas_step else None)
        batch.keep_conditioning.append((seq.request_id, canvas.temperature) if sample else None)
        pinned = canvas.decisions.pinned_rows if sample and canvas.decisions is not None else None
        batch.zero_conditioning.append(pinned or None)

    # ---- one canvas step ----------------------------------------------------------------------
    def apply(self, picked: list[tuple[Sequence, PickedRows]], finalize: Finalize
              ) -> list[tuple[Sequence, Exception]]:
        """Step the canvases of the pass: consecutive ones of one length together
        (`renoising.step_canvases`), as many as `GROUP_LOGITS_BYTES` of logits hold; then the default
        `apply` records each one's step (`advance`), hands it to `finalize` and opens the next canvas of
        those that go on."""
        failed: list[tuple[Sequence, Exception]] = []
        stepped: list[tuple[Sequence, PickedRows]] = []
        for group in self._groups(picked):
            try:  # each sequence's rows projected alone: the LM head's GEMM has the shape it has alone
                logits = [rows.read_logits().float() for _, rows in group]
                raw = torch.stack(logits) if len(logits) > 1 else logits[0][None]  # one canvas: no copy
                del logits
                reports = step_canvases([seq.state for seq, _ in group], raw)
                del raw
            except Exception as e:  # noqa: BLE001 - ends these requests only
                failed += [(seq, e) for seq, _ in group]
                continue
            for (seq, rows), report in zip(group, reports, strict=True):
                if isinstance(report, Exception):
                    failed.append((seq, report))
                else:
                    seq.state.report = report
                    stepped.append((seq, rows))
        return failed + super().apply(stepped, finalize)

    def _groups(self, picked: list[tuple[Sequence, PickedRows]]) -> list[list[tuple[Sequence, PickedRows]]]:
        """`picked` cut into runs of consecutive canvases of one length whose [L, V] float32 logits fit
        `GROUP_LOGITS_BYTES` together (a canvas alone when even its own do not)."""
        row_bytes = 4 * self.vocab_size
        groups: list[list[tuple[Sequence, PickedRows]]] = []
        rows = 0
        for item in picked:
            length = item[0].state.canvas_length
            if groups and groups[-1][0][0].state.canvas_length == length \
                    and (rows + length) * row_bytes <= GROUP_LOGITS_BYTES:
                groups[-1].append(item)
                rows += length
            else:
                groups.append([item])
                rows = length
        return groups

    def advance(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """Write the canvas step `apply` ran (`CanvasState.report`) into the sequence: the canvas fed
        next or, once the canvas ended, its emitted tokens with their settle steps (and logprobs, label
        masses); returns the generated indices whose argmax changed."""
        canvas, start, base = seq.state, seq.state.start, seq.prompt_len
        n, report = canvas.canvas_length, canvas.report
        seq.step_counter += 1
        seq.tokens[start: start + n] = report.canvas
        if report.ended:
            canvas_settle = canvas.settle.tolist()
            tokens, settle = canvas.close_canvas()
            seq.tokens[start: start + n] = tokens
            first = start - base
            seq.out_steps[first: first + n] = settle
            seq.out_block_steps[first: first + n] = canvas_settle
            if canvas.last_logprobs is not None:
                seq.out_logprobs[first: first + n] = canvas.last_logprobs
            if canvas.label_mass:
                seq.decisions.label_mass.update({first + pos: m for pos, m in canvas.label_mass.items()})
            canvas.ended = True
            self._dropped.append(seq.request_id)  # the next canvas starts without self-conditioning
        return [start - base + p for p in report.positions]

    def num_final(self, seq: Sequence) -> int:
        canvas = seq.state
        return canvas.start - seq.prompt_len + (canvas.canvas_length if canvas.ended else 0)

    def after_step(self, seq: Sequence) -> None:
        if seq.state.ended:
            seq.state.ended = False
            self._open_canvas(seq)

    def provisional_writes(self, seq: Sequence) -> bool:
        return True

    def trace_event(self, seq: Sequence, shown: list[int]) -> StepEvent:
        """Every canvas pass has its event (its temperature, acceptances and entropy), also when no
        argmax changed."""
        canvas, first = seq.state, seq.state.start - seq.prompt_len
        report = canvas.report
        argmax = dict(zip(report.positions, report.token_ids, strict=True))
        return {"step": report.step, "positions": shown,
                "token_ids": [argmax[g - first] for g in shown], "temperature": report.temperature,
                "accepted": report.accepted, "mean_entropy": report.mean_entropy}

    def replay(self, seq: Sequence, num_output: int) -> dict[str, Any]:
        """Per canvas of the request: its steps and why it stopped."""
        return {"dllm_replay_canvases": list(seq.state.replay)}

