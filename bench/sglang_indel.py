"""SGLang's released JointThresholdInDel (sglang 0.5.23, `sglang/srt/dllm/algorithm/joint_threshold_indel.py`)
and its base class's synchronous block loop (`DllmAlgorithm._run_sync`, `algorithm/base.py`), run as
released: both files are loaded from the installed package, with stand-ins for only the names their
imports bind where the real module does not import (sglang is installed without its dependencies).
`SGLangInDel` decodes whole requests with them over a full-recompute reference network, block by
block as SGLang's scheduler feeds them, and records every step. The oracle of the rule's tests and
of `python -m bench.llada2 --indel`; it needs `pip install --no-deps sglang==0.5.23` (as `.ci/run` does).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import sglang
import torch

ALGORITHM_DIR = Path(sglang.__file__).parent / "srt" / "dllm" / "algorithm"

# module -> the names base.py and joint_threshold_indel.py import from it, for the modules that do not
# import without sglang's dependencies (its server args and utils do: those are the real ones)
_STUBS = {
    "sglang.srt.dllm.algorithm": {"get_algorithm": None},
    "sglang.srt.dllm.config": {"DllmConfig": object},
    "sglang.srt.layers.logits_processor": {"LogitsProcessorOutput": object},
    "sglang.srt.model_executor.forward_batch_info": {"ForwardBatch": object},
    "sglang.srt.model_executor.model_runner": {"ModelRunner": object},
}


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _released() -> type:
    """The released `JointThresholdInDel` class, its base the released `DllmAlgorithm`."""
    saved = {name: sys.modules.get(name) for name in [*_STUBS, "sglang.srt.dllm.algorithm.base"]}
    try:
        for name, names in _STUBS.items():
            stub = types.ModuleType(name)
            stub.__dict__.update(names)
            sys.modules[name] = stub
        _load("sglang.srt.dllm.algorithm.base", ALGORITHM_DIR / "base.py")
        return _load("_released_joint_threshold_indel", ALGORITHM_DIR / "joint_threshold_indel.py").Algorithm
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


JointThresholdInDel = _released()


class _Prompt(int):
    """A block's prompt length (an int, as the released rule reads it) that also carries the
    positions a template pins past it."""

    pins: list[int]

    def __new__(cls, length: int, pins: list[int]) -> _Prompt:
        value = super().__new__(cls, length)
        value.pins = pins
        return value


class PinnedInDel(JointThresholdInDel):
    """The released rule with a template's pinned positions, extended the way blockserve serves them:
    a pinned position joins the block's prompt mask (so the released step never treats it as a mask
    and never edits it), and the rescan keeps it in place, running on each stretch of positions
    between pins on its own. Without pins it is the released rule unchanged."""

    def _block_start_list(self, forward_batch: ForwardBatch) -> list[int]:
        return forward_batch.committed_lens  # pins are not the prompt

    def init_step_state(self, forward_batch: ForwardBatch) -> list:
        states = super().init_step_state(forward_batch)
        for state, lead in zip(states, forward_batch.committed_lens, strict=True):
            index = state["prompt_index"].tolist()
            state["prompt_len"] = _Prompt(lead, [i for i in range(lead, len(index)) if index[i]])
        return states

    def _apply_edit_operations(self, block_tokens, old_block_tokens, is_orig_mask, prompt_len):
        pins = getattr(prompt_len, "pins", [])
        if not pins:
            return super()._apply_edit_operations(block_tokens, old_block_tokens, is_orig_mask, prompt_len)
        tokens, orig = list(old_block_tokens[:prompt_len]), list(is_orig_mask[:prompt_len])
        start = int(prompt_len)
        for stop in [*pins, self.block_size]:
            run, run_orig = [], []
            for i in range(start, stop):  # the released rescan, on this stretch
                if block_tokens[i] == self.delete_token_id:
                    continue
                if block_tokens[i] == self.split_token_id:
                    run += [self.mask_id, old_block_tokens[i]]
                    run_orig += [False, is_orig_mask[i]]
                else:
                    run.append(block_tokens[i])
                    run_orig.append(is_orig_mask[i])
            n = stop - start
            tokens += run[:n] + [self.mask_id] * (n - len(run))
            orig += run_orig[:n] + [False] * (n - len(run_orig))
            if stop < self.block_size:
                tokens.append(old_block_tokens[stop])
                orig.append(False)
            start = stop + 1
        return tokens, orig


@dataclass
class DllmConfig:
    """The fields of SGLang's DllmConfig the algorithm reads."""

    block_size: int
    mask_id: int
    delete_token_id: int
    split_token_id: int
    algorithm_config: dict
    first_done_first_out_mode: bool = False


@dataclass
class ForwardBatch:
    """The fields of SGLang's ForwardBatch the algorithm reads: the blocks' ids, flattened, and the
    committed positions of each block when any committed token is a literal mask id."""

    batch_size: int
    input_ids: torch.Tensor
    dllm_prompt_mask: torch.Tensor | None = None
    #: `PinnedInDel`'s addition: each block's committed length (its prompt mask also holds the pins)
    committed_lens: list[int] | None = None


def algorithm(block_size: int, mask_id: int, delete_id: int, split_id: int, *, pinned: bool = False,
              **config) -> JointThresholdInDel:
    """The released algorithm under SGLang's YAML keys `config` (threshold, edit_threshold,
    max_post_edit_steps); `pinned`: extended to templates' pins (`PinnedInDel`)."""
    released = PinnedInDel if pinned else JointThresholdInDel
    return released(DllmConfig(block_size, mask_id, delete_id, split_id, config))


@dataclass
class Step:
    """One step of one request's block: its input block, the logits it read, its output block, and
    the block positions it wrote with a token other than the one there (DELETE / SPLIT included)."""

    before: list[int]
    logits: torch.Tensor
    after: list[int]
    writes: dict[int, int]


def recording_rescans(algo: JointThresholdInDel) -> list[tuple[list[int], list[int], list[int]]]:
    """Make `algo` record each rescan (its `_apply_edit_operations` calls, in request order within a
    step): (input block, the block with the step's writes in, the block after the rescan)."""
    calls: list[tuple[list[int], list[int], list[int]]] = []
    rescan = algo._apply_edit_operations

    def recorded(block_tokens, old_block_tokens, is_orig_mask, prompt_len):
        result = rescan(block_tokens, old_block_tokens, is_orig_mask, prompt_len)
        calls.append((list(old_block_tokens), list(block_tokens), list(result[0])))
        return result

    algo._apply_edit_operations = recorded
    return calls


def changed_writes(before: list[int], written: list[int] | None, after: list[int]) -> dict[int, int]:
    """A step's changing writes: from the block it rescanned, else from its output block."""
    block = after if written is None else written
    return {i: t for i, (a, t) in enumerate(zip(before, block, strict=True)) if a != t}


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    blocks: list[list[Step]] = field(default_factory=list)  # per block, its steps (block start: B * index)
    template: list[int | None] = field(default_factory=list)  # per output index: a pinned id, or None

    def pinned(self, g: int) -> int | None:
        return self.template[g] if g < len(self.template) else None

    @property
    def token_ids(self) -> list[int]:
        return self.output


class SGLangInDel:
    """Whole requests decoded by the released rule and loop over `logits(ids, B)` (a full recompute of
    the sequence so far), as SGLang's scheduler runs them: the committed tokens, then one block of B
    at a time (the prompt's partial block completed by masks), each block's generated ids appended
    to the output, which ends at a stop id or at max_new_tokens (decoding whole blocks, then cut)."""

    def __init__(self, logits, block_size: int, mask_id: int, delete_id: int, split_id: int,
                 stop_ids: set[int], **config):
        self.logits, self.b, self.mask_id, self.stop_ids = logits, block_size, mask_id, stop_ids
        self.algo = algorithm(block_size, mask_id, delete_id, split_id, **config)
        self.pinned_algo = algorithm(block_size, mask_id, delete_id, split_id, pinned=True, **config)

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int],
                 templates: list[list[int | None]] | None = None) -> list[Request]:
        """`templates`: per request, its template's pinned ids by output index (None at a slot): a
        block opens with them in place, and the rule runs as `PinnedInDel`."""
        reqs = [Request(p, m, template=t or []) for p, m, t in
                zip(prompts, max_new_tokens, templates or [None] * len(prompts), strict=True)]
        while live := [r for r in reqs if r.finish_reason is None]:
            self._round(live)
            for r in live:
                self._cut(r)
        return reqs

    def _cut(self, r: Request) -> None:
        for j, token in enumerate(r.output[: r.max_new_tokens]):
            if token in self.stop_ids:
                r.output, r.finish_reason = r.output[: j + 1], "stop"
                return
        if len(r.output) >= r.max_new_tokens:
            r.output, r.finish_reason = r.output[: r.max_new_tokens], "length"

    def _round(self, reqs: list[Request]) -> None:
        """One block of every request, in one batch."""
        b = self.b
        committed = [r.prompt + r.output for r in reqs]
        starts = [len(c) // b * b for c in committed]
        blocks, fixed = [], []  # each block's ids, and its positions the rule must not write
        for r, c, s in zip(reqs, committed, starts, strict=True):
            pins = [None] * (len(c) - s) + [r.pinned(i - len(r.prompt)) for i in range(len(c), s + b)]
            blocks.append(c[s:] + [self.mask_id if pins[i] is None else pins[i] for i in range(len(c) - s, b)])
            fixed.append([s + i < len(c) or pins[i] is not None for i in range(b)])
        pinned = any(r.template for r in reqs)
        literal = pinned or any(self.mask_id in c for c in committed)
        batch = ForwardBatch(len(reqs), torch.tensor(sum(blocks, [])), torch.tensor(fixed) if literal else None,
                             [len(c) - s for c, s in zip(committed, starts, strict=True)])
        algo = self.pinned_algo if pinned else self.algo
        for r in reqs:
            r.blocks.append([])

        class Runner:
            def forward(_, fb, pp_proxy_tensors=None):
                ids = fb.input_ids.view(len(reqs), b).tolist()
                full = torch.cat([self.logits(c[:s] + block, b)[s: s + b]
                                  for c, s, block in zip(committed, starts, ids, strict=True)])
                return types.SimpleNamespace(logits_output=types.SimpleNamespace(full_logits=full),
                                             can_run_graph=False)

        step, rescans = algo.step, recording_rescans(algo)

        def recorded_step(fb, full_logits, states):
            before = fb.input_ids.view(len(reqs), b).tolist()
            live = [not s["finished"] for s in states]
            rescans.clear()
            done = step(fb, full_logits, states)
            after = fb.input_ids.view(len(reqs), b).tolist()
            calls = iter(rescans)
            call = next(calls, None)
            for i, r in enumerate(reqs):
                written = None
                if call is not None and call[0] == before[i] and call[2] == after[i]:
                    written, call = call[1], next(calls, None)
                if live[i]:
                    r.blocks[-1].append(Step(before[i], full_logits[i * b:(i + 1) * b], after[i],
                                             changed_writes(before[i], written, after[i])))
            assert call is None, "every rescan belongs to a request"
            return done

        algo.step = recorded_step
        try:
            _, new_ids, *_ = algo._run_sync(Runner(), batch)
        finally:
            del algo.step, algo._apply_edit_operations
        for r, c, s, ids in zip(reqs, committed, starts, new_ids or [], strict=False):
            assert len(ids) == s + b - len(c)
            r.output += ids.tolist()
