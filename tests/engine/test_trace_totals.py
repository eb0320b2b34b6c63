"""`python -m engine.trace` on every family: its totals are the response's token count and `num_steps`
(the steps that write nothing included: LLaDA2's editing steps and commits, Fast-dLLM v2's inherited
tokens), its step lines are the step trace, and the editing knobs and the block length are flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from configs import EngineConfig, GenerationConfig
from engine.carrier import Response
from engine.offline import pipeline
from engine.trace import main
from testing.tiny_checkpoint import write_tiny_checkpoint
from testing.tiny_fast_dllm import write_tiny_fast_dllm
from testing.tiny_llada2 import write_tiny_llada2

PROMPT, NEW = "23+58=", 20
FAMILIES = {  # name: (writer, flags)
    "sdar": (lambda p: write_tiny_checkpoint(p, model_type="sdar"), []),
    "qwen3": (lambda p: write_tiny_checkpoint(p, model_type="qwen3"), []),
    "llada2_editing": (lambda p: write_tiny_llada2(p, use_qkv_bias=True, use_bias=True),
                       ["--block-length", "8", "--strategy", "joint_threshold", "--threshold", "0.95",
                        "--edit-threshold", "0.5", "--max-post-edit-steps", "2", "--penalty-lambda", "0.5"]),
    "fast_dllm_v2": (write_tiny_fast_dllm, ["--block-length", "8", "--sub-block-length", "4", "--threshold", "0.7"]),
}
FLAG_FIELDS = {"--block-length": "dllm_block_length", "--strategy": "dllm_unmasking_strategy",
               "--threshold": "dllm_confidence_threshold", "--edit-threshold": "dllm_edit_threshold",
               "--max-post-edit-steps": "dllm_max_post_edit_steps", "--penalty-lambda": "dllm_penalty_lambda",
               "--sub-block-length": "dllm_sub_block_length"}


def _served(path: Path, flags: list[str]) -> Response:
    """The same request through the pipeline, with the flags as EngineConfig fields."""
    fields = {FLAG_FIELDS[f]: v for f, v in zip(flags[::2], flags[1::2])}
    with pipeline(str(path), EngineConfig(**fields)) as pipe:
        gen = GenerationConfig(max_new_tokens=NEW, return_step_trace=True, logprobs=0)
        return Response.from_chunks(list(pipe.stream(PROMPT, gen)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trace_totals_are_the_responses(family, tmp_path, capsys):
    writer, flags = FAMILIES[family]
    path = writer(tmp_path / family)
    assert main([str(path), PROMPT, "--max-new-tokens", str(NEW), "--no-colour", *flags]) == 0
    out = capsys.readouterr().out
    expected = _served(path, flags)
    steps = expected.num_steps if expected.num_steps is not None else len(expected.token_ids)
    tokens, shown = map(int, re.search(r"^(\d+) tokens in (\d+) steps", out, re.M).groups())
    assert (tokens, shown) == (len(expected.token_ids), steps)
    lines = re.findall(r"^step +(\d+): ", out, re.M)
    if expected.step_trace is None:  # autoregressive: one step per token
        assert lines == [str(i) for i in range(1, tokens + 1)]
    else:
        assert lines == [str(e["step"]) for e in expected.step_trace]
        assert max(map(int, lines)) <= shown
    if family == "llada2_editing":
        assert shown > len(set(expected.step_map))  # steps that rewrote or wrote nothing count too
