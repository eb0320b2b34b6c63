"""Per-request output assembly: OutputChunk deltas of what became final since the last chunk.

The request's `StopChecker` holds the text of its final tokens and where the output ends; the
builder only cuts deltas from it, so the chunks of a request concatenate exactly to its Response
and every field describes the same prefix of tokens. Work per chunk is proportional to what is new.

A request whose caller waits for the whole result (`streamed=False`: a unary call, `pipe(...)`) gets
two chunks: the first that carries tokens, so that its caller still sees the time to the first token,
and the last. Everything in between accumulates and goes out with the last, so the two fold to the
same Response as the step-by-step deltas would. A step then builds nothing for it, and its caller is
woken twice instead of once per step: on a Serve replica each chunk costs the replica's event loop some
10 µs of host time, comparable to what the engine's step spends on the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.carrier import OutputChunk, StepEvent
from engine.core.decoding.base import Speculation
from engine.core.sequence import Sequence


class OutputBuilder:
    def __init__(self, seq: Sequence, is_dllm: bool, replay: Callable[[Sequence, int], dict[str, Any]] | None = None,
                 speculation: Speculation | None = None, streamed: bool = True):
        """`replay`: the final-block replay fields of a finished request (its decoding strategy's);
        `speculation`: a self-speculating request's counts, which its strategy keeps up to date;
        `streamed`: a chunk every step that made something new (else the first tokens and the end)."""
        self.seq = seq
        self.streamed = streamed
        self.speculation = speculation
        self.is_dllm = is_dllm and not seq.decodes_autoregressively
        self.replay = replay
        p = seq.params
        self.want_logprobs = p.logprobs is not None
        self.want_trace = self.is_dllm and p.return_step_trace
        self.want_block_steps = self.is_dllm and p.return_block_step_map
        self.want_replay = self.is_dllm and p.return_dllm_replay
        self.want_input_rows = seq.wants_input_logprobs
        decisions = seq.decisions
        #: generated index -> its allowed set's mass, when the request has sets (written by its strategy)
        self.label_masses = decisions.label_mass if decisions is not None and decisions.has_sets else None
        self.sent_tokens = 0
        self.sent_verifies = 0  # a self-speculating request's acceptance lengths sent
        self.sent_text = 0  # characters of text sent
        self.pending_trace: list[StepEvent] = []
        self.pending_input_rows: list[tuple[float, int]] = []
        self.pending_input_top: list[list[tuple[float, int]]] = []
        self.first = True
        #: a request not streamed whose first chunk went out: until it finishes, a step builds nothing
        #: for it unless the weights changed (`build` keeps every version it ran under)
        self.quiet = False
        self.version: str | None = None  # the weights of the last step this request ran
        self.pending_versions: list[str] = []  # versions run under since the last chunk

    # ---- inputs from the engine -------------------------------------------------------------
    def add_trace(self, event: StepEvent) -> None:
        if self.want_trace:
            self.pending_trace.append(event)

    def add_input_rows(self, values: list[float], targets: list[int], top: list | None) -> None:
        self.pending_input_rows += [(v, t) for v, t in zip(values, targets)]
        if top is not None:
            self.pending_input_top += [[(v, t) for v, t in row] for row in top]

    # ---- chunk ------------------------------------------------------------------------------
    def build(self, finished: bool, weight_version: str) -> OutputChunk | None:
        """The delta since the last chunk (None when there is nothing new). Tokens are final once
        the stop rule has read them; `finished` ends the request with `seq.finish_reason`;
        `weight_version` names the weights the engine runs now; every change of it is kept, so a
        request that spans an update lists both versions even when no chunk went out in between."""
        seq = self.seq
        if weight_version != self.version:
            self.version = weight_version
            self.pending_versions.append(weight_version)
        if self.quiet and not finished:
            return None  # not streamed: after the first chunk, only the last
        stop = seq.stop
        end = seq.num_output if seq.num_output is not None else stop.num_consumed
        if end == self.sent_tokens and not (finished or self.pending_trace):
            return None  # no token became final, so the text did not grow either
        if finished and stop.decision is None:  # ended from outside (abort, error)
            stop.end_from_outside()
        text_end = stop.visible_end()
        start = self.sent_tokens
        new_ids = seq.tokens[seq.prompt_len + start : seq.prompt_len + end]
        delta = stop.text_between(self.sent_text, text_end)
        if not (new_ids or delta or self.pending_trace or finished):
            return None
        if not (new_ids or finished or self.streamed):
            return None  # not streamed: the first chunk is the first to carry tokens
        if self.pending_input_rows and not (finished or seq.num_computed >= seq.score_end):
            return None  # input rows travel together, once the prompt is fully scored
        chunk = OutputChunk(request_id=seq.request_id, text=delta, token_ids=new_ids, input_token_len=seq.prompt_len,
                            generate_token_len=end, weight_version=weight_version,
                            weight_versions=self.pending_versions)
        # what the request asked for beyond text and tokens (None, the fields' default, where it did not)
        if self.is_dllm:
            chunk.step_map, chunk.num_steps = seq.out_steps[start:end], seq.step_counter
        if self.want_logprobs:
            chunk.logprobs = list(seq.out_logprobs[start:end])
        if self.want_trace:
            chunk.step_trace = self.pending_trace
        if self.want_block_steps:
            chunk.block_step_map = seq.out_block_steps[start:end]
        if self.label_masses is not None:
            chunk.label_mass = [self.label_masses.get(g) for g in range(start, end)]
        if finished:
            chunk.finish_reason, chunk.matched = seq.finish_reason, seq.matched
        if self.first and seq.admitted_at is not None:
            chunk.queue_time_s = seq.admitted_at - seq.added_at
        if self.speculation is not None:
            chunk.nfe, accepted = self.speculation.nfe, self.speculation.acceptance
            chunk.acceptance_lengths, self.sent_verifies = accepted[self.sent_verifies:], len(accepted)
        if finished and self.want_replay:
            for name, value in self.replay(seq, end).items():
                setattr(chunk, name, value)
        if self.want_input_rows:
            chunk.input_token_logprobs = self.pending_input_rows if self.first else []
            if seq.params.logprobs:
                chunk.input_top_logprobs = self.pending_input_top if self.first else []
            self.pending_input_rows, self.pending_input_top = [], []
        self.first = False
        self.quiet = not self.streamed
        self.pending_trace = []
        self.pending_versions = []
        self.sent_tokens = end
        self.sent_text = max(self.sent_text, text_end)
        return chunk
