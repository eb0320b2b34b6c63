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


def algorithm(block_size: int, mask_id: int, delete_id: int, split_id: int, **config) -> JointThresholdInDel:
    """The released algorithm under SGLang's YAML keys `config` (threshold, edit_threshold,
    max_post_edit_steps)."""
    return JointThresholdInDel(DllmConfig(block_size, mask_id, delete_id, split_id, config))


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

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Request]:
        reqs = [Request(p, m) for p, m in zip(prompts, max_new_tokens, strict=True)]
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
        blocks = [c[s:] + [self.mask_id] * (s + b - len(c)) for c, s in zip(committed, starts, strict=True)]
        literal = any(self.mask_id in c for c in committed)
        prompt_mask = torch.tensor([[s + i < len(c) for i in range(b)] for c, s in zip(committed, starts, strict=True)])
        batch = ForwardBatch(len(reqs), torch.tensor(sum(blocks, [])), prompt_mask if literal else None)
        for r in reqs:
            r.blocks.append([])

        class Runner:
            def forward(_, fb, pp_proxy_tensors=None):
                ids = fb.input_ids.view(len(reqs), b).tolist()
                full = torch.cat([self.logits(c[:s] + block, b)[s: s + b]
                                  for c, s, block in zip(committed, starts, ids, strict=True)])
                return types.SimpleNamespace(logits_output=types.SimpleNamespace(full_logits=full),
                                             can_run_graph=False)

        step, rescans = self.algo.step, recording_rescans(self.algo)

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

        self.algo.step = recorded_step
        try:
            _, new_ids, *_ = self.algo._run_sync(Runner(), batch)
        finally:
            del self.algo.step, self.algo._apply_edit_operations
        for r, c, s, ids in zip(reqs, committed, starts, new_ids or [], strict=False):
            assert len(ids) == s + b - len(c)
            r.output += ids.tolist()
