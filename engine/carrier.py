"""The carrier: plain-data deltas that cross every process boundary intact.

An `OutputChunk` is what one engine step adds to one request. A `Response` is the sum of a
request's chunks. Both hold only built-in types (no tensors), so they pickle through Ray and
serialise to JSON unchanged.

The None / [] rule: a field is None when it was not requested or does not apply
(e.g. `step_map` for an AR model, `logprobs` without `logprobs=k`), and a list -- possibly empty --
when it was requested. Every chunk of a request follows the same rule, so concatenating chunks
keeps it: `Response.from_chunks(chunks)` equals the unary response exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FinishReason = str  # "stop" | "length" | "abort" | "error"
StepEvent = dict[str, Any]  # {"step": int, "positions": list[int], "token_ids": list[int]}
TokenLogprobs = dict[int, float]  # chosen token first, then the top-k in descending order
InputRow = tuple[float, int]  # (value, token_id)


def _extend(acc: list | None, delta: list | None) -> list | None:
    if delta is None:
        return acc
    if acc is None:
        return list(delta)
    acc.extend(delta)
    return acc


@dataclass
class _CarrierFields:
    """The fields a delta and a whole response share (a Response is the sum of its deltas)."""

    request_id: str | None = None  # the request's id (a sample's: `<id>-<i>`)
    text: str = ""  # the detokenized output
    token_ids: list[int] = field(default_factory=list)  # the output tokens, in order
    # per token (block diffusion): the request's step counter (rising on each step that writes a
    # token) at the token's last write
    step_map: list[int] | None = None
    logprobs: list[TokenLogprobs] | None = None  # per output token, with logprobs=k
    # per prompt token from logprob_start_len on: (its logprob, its id)
    input_token_logprobs: list[InputRow] | None = None
    input_top_logprobs: list[list[InputRow]] | None = None  # per such prompt token, with logprobs=k: its top-k
    step_trace: list[StepEvent] | None = None  # with return_step_trace: what each step fixed
    block_step_map: list[int] | None = None  # per token: 1-based step index within its own block
    # per token, when the request has allowed sets (typed decisions): the raw probability mass its slot's
    # set held when it was written (None where the position had no set)
    label_mass: list[float | None] | None = None
    # self-speculation (linear_spec): the forwards so far as its release counts them (cumulative), and the
    # tokens each verify accepted (a delta lists the verifies new since the previous one)
    nfe: int | None = None  # forwards so far (cumulative)
    acceptance_lengths: list[int] | None = None  # per verify: the tokens it accepted
    finish_reason: FinishReason | None = None  # None until the request's last delta
    matched: int | str | None = None  # with finish_reason "stop": the stop id or stop string
    error: str | None = None  # with finish_reason "error": what failed
    input_token_len: int = 0  # the prompt's tokens
    generate_token_len: int = 0  # cumulative: tokens generated so far
    num_steps: int | None = None  # cumulative (block diffusion): denoising steps taken so far
    weight_version: str | None = None  # the weights that produced this delta
    # the versions the request ran under since the previous delta, in order (a step that emitted no
    # delta counts too), so the sum of the deltas lists every version a sample mixed
    weight_versions: list[str] | None = None
    # final block replay (block diffusion, on request; in the last chunk only)
    dllm_replay_token_ids: list[int] | None = None
    dllm_replay_step_maps: list[int] | None = None  # the step that revealed each position, 0 where never
    dllm_stop_length: int | None = None  # how many of the block's positions are output tokens (the first ones)
    # renoising (on request; in the last chunk only): per canvas {"steps": its steps, "stop": "stable" | "max_steps"}
    dllm_replay_canvases: list[dict[str, Any]] | None = None
    queue_time_s: float | None = None  # first chunk only: seconds from add_request to first admission
    entropy: list[float] | None = None  # per token (trajectory scoring, on request): entropy in nats

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _fold(self, chunk: OutputChunk) -> None:
        """Fold the delta `chunk`, which comes after what this holds, in (in place): its lists extend
        these, and every other field takes its value where it has one (cumulative counts, the finish)."""
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.step_map = _extend(self.step_map, chunk.step_map)
        self.logprobs = _extend(self.logprobs, chunk.logprobs)
        self.input_token_logprobs = _extend(self.input_token_logprobs, chunk.input_token_logprobs)
        self.input_top_logprobs = _extend(self.input_top_logprobs, chunk.input_top_logprobs)
        self.step_trace = _extend(self.step_trace, chunk.step_trace)
        self.block_step_map = _extend(self.block_step_map, chunk.block_step_map)
        self.label_mass = _extend(self.label_mass, chunk.label_mass)
        self.acceptance_lengths = _extend(self.acceptance_lengths, chunk.acceptance_lengths)
        self.entropy = _extend(self.entropy, chunk.entropy)
        self.weight_versions = _extend(self.weight_versions, chunk.weight_versions)
        for name in ("finish_reason", "matched", "error", "num_steps", "nfe", "weight_version", "dllm_replay_token_ids",
                     "dllm_replay_step_maps", "dllm_stop_length", "dllm_replay_canvases", "queue_time_s"):
            value = getattr(chunk, name)
            if value is not None:
                setattr(self, name, value)
        self.input_token_len = chunk.input_token_len
        self.generate_token_len = chunk.generate_token_len


@dataclass
class OutputChunk(_CarrierFields):
    """One delta of one request. Lists hold only what is new since the previous chunk."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, later: OutputChunk) -> OutputChunk:
        """This delta and the one after it as one delta (in place; returns self): a stream that batches
        its deltas sends what arrived together as one."""
        self._fold(later)
        return self


@dataclass
class Response(_CarrierFields):
    """The whole result of one request: the sum of its deltas."""

    index: int = 0  # which of the request's n samples this is

    def add(self, chunk: OutputChunk) -> Response:
        """Fold one delta in (in place) and return self."""
        self._fold(chunk)
        return self

    @classmethod
    def from_chunks(cls, chunks: list[OutputChunk]) -> Response:
        resp = cls()
        for chunk in chunks:
            resp.add(chunk)
        return resp
