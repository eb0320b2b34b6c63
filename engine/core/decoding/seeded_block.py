"""Seeded block decoding (Nemotron-Labs-Diffusion): one causal decoder, decoded per request as its
`dllm_mode` says. Every K/V the cache keeps is causal, whatever the mode.

- `ar`: autoregressive decoding, handed to `AutoregressiveDecoding` (the request's outputs carry no
  step map, as an autoregressive model's).
- `diffusion`: the release's block diffusion. Blocks of B positions start at the prompt end (not at
  multiples of B). A *seeding forward* is causal up to a block's start and draws the block's first
  token, its *seed*, from its last row: the prompt prefill for block 0, then the forward that commits
  the previous block (it writes that block's causal K/V). The block opens as [seed, MASK x (B-1)]. Each
  *denoising pass* feeds the whole block, its rows attending bidirectionally to the block and to the
  causal prefix (`mask_kinds`); row i proposes token i. The pass writes the block's K/V slots, which
  the commit rewrites before they are final (after a pass the request's K/V are final up to the
  block's start only, and only final K/V reach the prefix cache, which also never lends a request a
  page holding its open block: `cacheable_prefix` ends before it). Per pass, as the release's
  `_get_transfer_index`:
  each masked position's candidate is the argmax of its logits, or at temperature T > 0 the argmax of
  `exp(l) / (-ln u)^T` in float64 (u uniform: a draw from softmax(l / T)); its confidence is the
  temperature-1 probability of the candidate; the mask id is a legal candidate (written back, it
  reveals nothing). Without a threshold the step's quota of most confident masked positions is
  revealed (the block's masks spread over B passes: one per pass); with one, the most confident and
  every other at least that confident. A block ends when no mask is left or after B passes (a
  position still masked then keeps the mask id, step 0, no logprob). Revealed tokens never change,
  so the output grows with the revealed prefix of the block: an eos the stop rule reads ends the
  request at the pass where no mask is left before it, as the release's early break does.

- `linear_spec`: the release's self-speculation, lossless. The prefill draws the first seed (an
  autoregressive token). Each iteration drafts the block [seed, MASK x (B-1)] by bidirectional passes
  over the causal prefix (threshold 0, the default: one pass fills every mask; with a threshold, the
  most confident and every other at least that confident, until no mask is left), then one causal
  *verify* forward over the drafted block writes its K/V and draws an autoregressive token from every
  row: row i's token is the model's next token after the seed and the first i drafts. The longest
  prefix of drafts equal to those tokens is accepted, plus one *bonus* token (the first that differs,
  or the last row's); the K/V stay final up to the last accepted draft and the bonus is the next
  seed. Every emitted token is an autoregressive token, so greedy output equals `ar`'s, and sampled
  output has the autoregressive distribution. Draws come from the request's generator in the release's
  order: the seed's multinomial, per draft pass one multinomial over the block's B rows, per verify
  one over its B rows.

`step_map`: the request's counter rises on every forward that draws a seed or denoises (linear_spec:
the prefill and every verify); a seed gets the counter of its seeding forward (block 0's: 1), every
other token that of the pass revealing it (linear_spec: of the verify that accepted it). A
linear_spec request also reports `nfe` (its forwards as the release counts them: the prefill, the
drafts and the verifies) and the number of tokens each verify accepted.
`num_steps` is the counter when the request ends. `block_step_map`: 1 for a seed, k + 1 for the k-th
pass of its block. Logprobs come from the row that revealed the token (a seed's from the causal row
before its block). Sampled requests draw from their own generator, seeded by the request, in the
release's order: per seed one multinomial over the causal row, per denoising pass one float64
uniform tensor [B, vocab]; so a request draws the same whatever its batch.
"""

from __future__ import annotations

import torch

from configs import EngineConfig, GenerationConfig
from engine.core.decisions import Decisions
from engine.core.decoding.autoregressive import AutoregressiveDecoding
from engine.core.decoding.base import DecodingStrategy, Finalize, PickedRows, Speculation
from engine.core.decoding.renoising import request_generator
from engine.core.decoding.rules import write_pinned
from engine.core.decoding.seeded_speculation import LinearSpeculation
from engine.core.decoding.seeded_state import SeededSettings, SeededState
from engine.core.decoding.unmasking import tokens_this_step
from engine.core.input_processing import check_knobs
from engine.core.logprobs import token_logprobs
from engine.core.sampler import RowGroup, allowed_mass, allowed_rows, within_allowed
from engine.core.sequence import Sequence
from engine.core.step_plan import Feed, SampleSlice
from engine.core.trajectory_plan import TrajectoryGeometry
from engine.errors import RequestError
from engine.model.spec import ModelSpec
from engine.worker.forward_batch import MASK_BIDIRECTIONAL, MASK_CAUSAL, ForwardBatch
from engine.worker.runner import resolve_device

# what a diffusion-mode request may not ask for: the release's loop has no such processing
_DIFFUSION_REFUSES = {
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0, "min_new_tokens": lambda p: p.min_new_tokens > 0,
    "top_k": lambda p: p.top_k > 0, "top_p": lambda p: p.top_p < 1.0, "min_p": lambda p: p.min_p > 0.0}


def _diffusing(seq: Sequence) -> bool:
    return isinstance(seq.state, SeededState)


class SeededBlockDecoding(DecodingStrategy):
    paradigm = "seeded_block"
    needs_confidence = False
    has_pass_fields = True

    def __init__(self, block_length: int, mask_id: int, logprobs_mode: str | None, device: str = "cpu",
                 draft_lora: bool = False):
        self.block_length, self.mask_id = block_length, mask_id
        self.draft_lora = draft_lora  # linear_spec's drafts run the network's draft adapter
        self.logprobs_mode, self.device = logprobs_mode, device
        self.ar = AutoregressiveDecoding()
        self.linear_spec = LinearSpeculation(block_length, mask_id, self._logprobs)

    @classmethod
    def from_config(cls, config: EngineConfig, spec: ModelSpec, mask_id: int) -> SeededBlockDecoding:
        return cls(config.dllm_block_length, mask_id, config.logprobs_mode, str(resolve_device(config)),
                   config.dllm_draft_lora)

    # ---- the request ----------------------------------------------------------------------------
    def request_settings(self, params: GenerationConfig, config: EngineConfig,
                         engine_set: frozenset[str] = frozenset()) -> SeededSettings:
        """The request's mode over the engine's; its threshold, else the engine's when its user set one,
        else none (the release's default: one position per pass)."""
        threshold = params.dllm_confidence_threshold
        if threshold is None and "dllm_confidence_threshold" in engine_set:
            threshold = config.dllm_confidence_threshold
        return SeededSettings(params.dllm_mode or config.dllm_mode, threshold, params.has_decisions)

    def autoregressive(self, settings: SeededSettings) -> bool:
        return settings.autoregressive

    def check_request(self, params: GenerationConfig, settings: SeededSettings) -> None:
        check_knobs(params, self.paradigm, None)
        if params.dllm_block_length is not None and params.dllm_block_length != self.block_length:
            raise RequestError(f"dllm_block_length={params.dllm_block_length}: this model decodes blocks of "
                               f"{self.block_length} tokens and the block length cannot change per request; leave "
                               "it unset", "dllm_block_length")
        if params.dllm_trajectory is not None and settings.mode != "diffusion":
            raise RequestError(f"dllm_trajectory scores dllm_mode='diffusion' rollouts and this request has "
                               f"dllm_mode={settings.mode!r} (its tokens are autoregressive: score them with "
                               "logprob_start_len over prompt + output, max_new_tokens=0); set dllm_mode to "
                               "'diffusion'", "dllm_trajectory")
        if settings.mode == "ar":
            if params.dllm_confidence_threshold is not None:
                raise RequestError("dllm_confidence_threshold is read by dllm_mode='diffusion' only and this "
                                   "request decodes with dllm_mode='ar'; leave it unset", "dllm_confidence_threshold")
            return
        for name, given in _DIFFUSION_REFUSES.items():
            if given(params):
                raise RequestError(f"{name} does not apply to dllm_mode={settings.mode!r}: its tokens are the argmax "
                                   "or a draw at the request's temperature of the model's own logits; leave it "
                                   "unset, or use dllm_mode='ar'", name)

    def check_decisions(self, params: GenerationConfig, settings: SeededSettings, decisions: Decisions) -> None:
        """`ar` requests take templates, allowed sets and reads as an autoregressive model's, and so do
        `linear_spec` ones (they decode as `ar`: `SeededSettings.autoregressive`); `diffusion` requests as
        a mask-based block's (pins written when their block opens, the seed's too)."""
        if settings.autoregressive:
            return self.ar.check_decisions(params, settings, decisions)
        decisions.check_leaves_a_slot(params.max_new_tokens)
        return None

    def start(self, seq: Sequence, settings: SeededSettings) -> None:
        if settings.autoregressive:
            seq.decodes_autoregressively = True
            self.ar.start(seq, None)
            return
        p = seq.params
        temperature = 0.0 if p.is_greedy else p.temperature
        seq.state = SeededState(self.block_length, settings.threshold, temperature,
                                request_generator(seq.seed, self.device) if temperature else None, len(seq.tokens),
                                speculating=settings.mode == "linear_spec")
        seq.stop_bound = p.max_new_tokens
        if settings.mode == "linear_spec":
            seq.state.speculation = Speculation()

    def speculation(self, seq: Sequence) -> Speculation | None:
        return seq.state.speculation if _diffusing(seq) else None

    def cacheable_prefix(self, seq: Sequence) -> int:
        if not _diffusing(seq):
            return self.ar.cacheable_prefix(seq)
        # the row before the block is computed in the forward after admission: a seeding forward draws
        # from it, and before a denoising pass it is a causal forward the prefill budget may cut
        return seq.state.start - 1

    def sample_positions(self, seq: Sequence, end: int) -> list[int]:
        if not _diffusing(seq):
            return self.ar.sample_positions(seq, end)
        state = seq.state
        if state.seeding:
            return [state.start - 1]
        return list(range(state.start, state.end)) if state.speculating else list(state.masked)

    # ---- the step, over all its sequences ------------------------------------------------------
    def plan_feeds(self, seqs: list[Sequence]) -> list[Feed]:
        """A seeding forward up to the block's start (the prefill, or the previous block's commit), or
        the block for a denoising pass -- after a causal forward up to its start if its K/V were lost."""
        feeds = []
        for seq in seqs:
            state = seq.state
            if not _diffusing(seq):
                feeds += self.ar.plan_feeds([seq])
            elif state.seeding:
                commit = seq.step_counter > 0 and state.start - seq.num_computed <= self.block_length
                feeds.append((state.start, True, commit, state.start))
            elif seq.num_computed < state.start:
                feeds.append((state.start, False, False, state.start))
            else:
                feeds.append((state.end, True, True, state.start))
        return feeds

    def pass_fields(self, batch: ForwardBatch, seq: Sequence, sample: bool) -> None:
        """A denoising or drafting pass is bidirectional, every other forward causal; a draft runs the draft
        adapter when the engine loads one."""
        denoising = sample and _diffusing(seq) and seq.state.bidirectional
        batch.mask_kinds.append(MASK_BIDIRECTIONAL if denoising else MASK_CAUSAL)
        if self.draft_lora:
            batch.draft_rows.append(denoising and seq.state.speculating)

    def view_fields(self, batch: ForwardBatch) -> None:
        """A trajectory view is a denoising pass's block (or a seed's one position) over the causal
        context: bidirectional, with the plain weights."""
        batch.mask_kinds.append(MASK_BIDIRECTIONAL)
        if self.draft_lora:
            batch.draft_rows.append(False)

    def trajectory_geometry(self, predicts_next: bool) -> TrajectoryGeometry:
        return TrajectoryGeometry(seeded=True)

    def row_groups(self, slices: list[SampleSlice]) -> list[RowGroup]:
        """An autoregressive request's rows as `AutoregressiveDecoding` samples them; a diffusion request's
        come back as raw logits, from which `apply` draws as the release does."""
        groups = []
        for sl in slices:
            seq = sl.seq
            if _diffusing(seq):
                groups.append(RowGroup(seq.params, seq.seed, seq.num_draws, [], [], seq.stop_ids, want_logits=True))
            else:
                groups += self.ar.row_groups([sl])
        return groups

    def apply(self, picked: list[tuple[Sequence, PickedRows]], finalize: Finalize
              ) -> list[tuple[Sequence, Exception]]:
        failed = self.ar.apply([(seq, rows) for seq, rows in picked if not _diffusing(seq)], finalize)
        for seq, rows in picked:
            if not _diffusing(seq):
                continue
            try:
                state = seq.state
                if state.speculating:
                    self._speculate(seq, rows, finalize)
                    continue
                written = self._seed(seq, rows) if state.seeding else self._denoise(seq, rows)
                done = state.block_done
                if done:  # a position still masked keeps the mask id: never revealed (a seed keeps its step)
                    for g in (p - seq.prompt_len for p in state.masked):
                        if seq.out_steps[g] is None:
                            seq.out_steps[g] = seq.out_block_steps[g] = 0
                final = state.masked[0] if state.masked and not done else state.end
                if state.read_complete:
                    final = self._read_tail(seq)
                if not finalize(seq, written, final - seq.prompt_len) and done:
                    state.seeding, state.start = True, state.end
            except Exception as e:  # noqa: BLE001 - ends this request only
                failed.append((seq, e))
        return failed

    # ---- one sequence's forward ------------------------------------------------------------------
    def _speculate(self, seq: Sequence, rows: PickedRows, finalize: Finalize) -> None:
        """A linear_spec forward: the prefill's seed, a draft pass or a verify; the seed and every accepted
        token are final at once."""
        state = seq.state
        if state.seeding:
            written = self._seed(seq, rows)
        elif state.verifying:
            written = self.linear_spec.verify(seq, rows)
        else:
            self.linear_spec.draft(seq, rows)
            written = []
        state.speculation.nfe += 1
        finalize(seq, written, state.start + 1 - seq.prompt_len)

    def _seed(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """Open the block with the seed drawn from the causal row before it."""
        state, b = seq.state, self.block_length
        raw = rows.logits.float()
        decisions, g = seq.decisions, state.start - seq.prompt_len
        allowed = allowed_rows(raw, [decisions.allowed(g)] if decisions is not None and decisions.has_sets else [])
        logits = within_allowed(raw, allowed)
        seed = int(state.draw(logits)[0][0])
        block = [seed] + [self.mask_id] * (b - 1)
        seq.append_positions(block)
        seq.step_counter += 1
        state.seeding, state.passes = False, 0
        state.masked = [state.start + i for i, token in enumerate(block) if token == self.mask_id]
        state.num_masked_at_start = len(state.masked)
        # the seed's step is recorded even when it is the mask id, as the release does
        seq.out_steps[g], seq.out_block_steps[g] = seq.step_counter, 1
        seq.out_logprobs[g] = self._logprobs(seq, logits, raw, [0], [seed])[0]
        if allowed is not None:
            decisions.label_mass[g] = float(allowed_mass(raw, allowed[1])[0])
        if decisions is not None and decisions.template:
            return self._pin(seq, decisions, g)
        return [g]

    def _pin(self, seq: Sequence, decisions: Decisions, g: int) -> list[int]:
        """Write the template's pinned ids into the block just opened (its seed's too: drawn, then pinned),
        as revealed at step 0; mark a read's last block. Returns the generated indices the seed wrote."""
        state, base = seq.state, seq.prompt_len
        pinned = [j for j in range(self.block_length) if decisions.pinned(g + j) is not None]
        for j in pinned:
            write_pinned(seq, g + j, decisions.pinned(g + j))
            decisions.label_mass.pop(g + j, None)
        state.masked = [p for p in state.masked if seq.tokens[p] == self.mask_id]
        state.num_masked_at_start = len(state.masked)
        last = decisions.last_slot
        if decisions.read_steps is not None and last is not None and g <= last < g + self.block_length:
            state.read_steps, state.read_end = decisions.read_steps, base + decisions.length
            state.read_complete = not any(p < state.read_end for p in state.masked)
        return [] if 0 in pinned else [g]

    def _read_tail(self, seq: Sequence) -> int:
        """A read whose template positions are written: its pinned rest after the block (no forward needed);
        the position where the template ends."""
        decisions, first = seq.decisions, seq.num_generated_positions
        n = decisions.length - first
        if n > 0:
            seq.append_positions([self.mask_id] * n)
            for g in range(first, decisions.length):
                write_pinned(seq, g, decisions.pinned(g))
        return seq.state.read_end

    def _denoise(self, seq: Sequence, rows: PickedRows) -> list[int]:
        """One denoising pass over the block: the release's transfer rule on the masked positions' rows."""
        state, b = seq.state, self.block_length
        raw = rows.logits.float()  # one row per masked position, in order
        decisions, base = seq.decisions, state.start - seq.prompt_len
        offsets = [p - state.start for p in state.masked]
        allowed = allowed_rows(raw, [decisions.allowed(base + j) for j in offsets]
                                if decisions is not None and decisions.has_sets else [])
        logits = within_allowed(raw, allowed)
        candidates = state.candidates(logits, offsets)
        confidence = torch.full((b,), -torch.inf, device=logits.device)
        confidence[offsets] = torch.softmax(logits, -1).gather(-1, candidates[:, None])[:, 0]
        if state.threshold is None:
            # the release's `_get_num_transfer_tokens`: the block's masks spread over its B passes
            quota = tokens_this_step(state.num_masked_at_start, b, state.passes)
            chosen = torch.topk(confidence, quota).indices.tolist()
        else:
            ranked = torch.topk(confidence, len(offsets)).indices.tolist()
            sure = (confidence >= state.threshold).tolist()  # compared in float32, as the release does
            chosen = ranked[:1] + [j for j in ranked[1:] if sure[j]]
        state.passes += 1
        seq.step_counter += 1
        last = state.read_steps is not None and state.passes == state.read_steps  # a read's last pass
        if last:  # every slot of the template it still masks, the mask id too
            chosen = sorted(set(chosen) | {j for j in offsets if state.start + j < state.read_end})
        row_of = {j: i for i, j in enumerate(offsets)}
        picks = candidates.tolist()
        # a mask id written back reveals nothing (but on a read's last pass)
        revealed = sorted(j for j in chosen if picks[row_of[j]] != self.mask_id or last)
        tokens = [picks[row_of[j]] for j in revealed]
        rows_of = [row_of[j] for j in revealed]
        entries = self._logprobs(seq, logits, raw, rows_of, tokens)
        masses = {}  # the rows with a set: their set's raw mass
        if allowed is not None:
            at, keep = allowed
            masses = dict(zip(at.tolist(), allowed_mass(raw.index_select(0, at), keep).tolist(), strict=True))
        for j, token, entry in zip(revealed, tokens, entries, strict=True):
            seq.tokens[state.start + j] = token
            seq.out_steps[base + j], seq.out_block_steps[base + j] = seq.step_counter, state.passes + 1
            seq.out_logprobs[base + j] = entry
            if row_of[j] in masses:
                decisions.label_mass[base + j] = masses[row_of[j]]
        done = {state.start + j for j in revealed}
        state.masked = [p for p in state.masked if p not in done]
        if state.read_steps is not None:
            state.read_complete = last or not any(p < state.read_end for p in state.masked)
        return [base + j for j in revealed]

    def _logprobs(self, seq: Sequence, processed: torch.Tensor, raw: torch.Tensor, rows: list[int], tokens: list[int]
                  ) -> list[dict | None]:
        """The logprob entries of `tokens` in `rows` of the raw logits (processed modes: of `processed`, the
        rows within their allowed sets, at the request's temperature: the distribution its tokens are
        drawn from)."""
        logits = raw
        if self.logprobs_mode in ("processed_logprobs", "processed_logits"):
            temperature = seq.state.temperature
            logits = processed / temperature if temperature else processed
        return token_logprobs(logits, rows, tokens, seq.params.logprobs, self.logprobs_mode)
