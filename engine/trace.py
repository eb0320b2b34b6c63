"""See the decoding order: `python -m engine.trace MODEL "prompt"`.

Prints the generated text with every token tagged by the step that revealed it (coloured with ANSI
codes on a terminal, `token⟨step⟩` otherwise), one line per step listing what it wrote (a rewrite of
a token under token editing marked `(edit)`), and the totals: the tokens and the steps the request
took (the response's `num_steps`, which counts the steps that wrote nothing too; an autoregressive
model takes one step per token). The decoding settings are flags (`--strategy joint_threshold
--edit-threshold 0.9`, `--block-length`, ...); those not given are the model family's.
`--png FILE` also writes a heat strip of step_map (needs matplotlib: `pip install 'blockserve[trace]'`);
`--json FILE` saves the request as a `/generate` body with `meta_info.step_trace` (plus a `trace`
object: model, prompt, block length, settings and each token's text), which the server's /viewer
page opens.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from configs import EngineConfig, GenerationConfig
from engine.carrier import Response
from engine.offline import pipeline

_COLOURS = [31, 32, 33, 34, 35, 36, 91, 92, 93, 94, 95, 96]


def render(tokenizer, response: Response, colour: bool = True) -> str:
    """The text with each token annotated by its step: coloured, or as `token⟨step⟩`."""
    parts = []
    for tok, step in zip(response.token_ids, response.step_map or []):
        piece = tokenizer.decode([tok], skip_special_tokens=False)
        if colour:
            parts.append(f"\x1b[{_COLOURS[step % len(_COLOURS)]}m{piece}\x1b[0m")
        else:
            parts.append(f"{piece}\u27e8{step}\u27e9")
    return "".join(parts)


def write_heat_strip(response: Response, tokenizer, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = response.step_map or []
    fig, ax = plt.subplots(figsize=(max(4, len(steps) * 0.35), 1.6))
    ax.imshow([steps], aspect="auto", cmap="viridis")
    ax.set_yticks([])
    ax.set_xticks(range(len(steps)))
    ax.set_xticklabels([repr(tokenizer.decode([t]))[1:-1] for t in response.token_ids], fontsize=7, rotation=90)
    for i, s in enumerate(steps):
        ax.text(i, 0, str(s), ha="center", va="center", color="white", fontsize=7)
    ax.set_title("step that revealed each token (step_map)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def trace_body(response: Response, tokenizer, prompt: str, model: str, block_length: int,
               settings: dict[str, Any]) -> dict[str, Any]:
    """The request as a `/generate` body (the fields a viewer reads) with the `trace` extras."""
    ids = set(response.token_ids) | {t for e in response.step_trace or [] for t in e["token_ids"]}
    texts = {str(t): tokenizer.decode([t], skip_special_tokens=False) for t in sorted(ids)}
    rows = [[next(iter(e.values())), t, texts[str(t)]] for e, t in zip(response.logprobs or [], response.token_ids)]
    return {
        "text": response.text,
        "output_ids": response.token_ids,
        "meta_info": {
            "finish_reason": {"type": response.finish_reason},
            "prompt_tokens": response.input_token_len,
            "completion_tokens": len(response.token_ids),
            "output_token_logprobs": rows or None,
            "step_map": response.step_map,
            "step_trace": response.step_trace,
            "dllm_num_steps": response.num_steps,
        },
        "trace": {"model": model, "prompt": prompt, "block_length": block_length, "settings": settings,
                  "token_texts": texts},
    }


# (flag, EngineConfig field, type, help): the decoding settings the command takes; unset = the family's
_SETTINGS = [
    ("--strategy", "dllm_unmasking_strategy", str, "unmasking strategy, e.g. joint_threshold (token editing)"),
    ("--threshold", "dllm_confidence_threshold", float, "confidence threshold"),
    ("--steps", "dllm_denoising_steps", int, "denoising steps per block (default: the block length)"),
    ("--entropy-threshold", "dllm_entropy_threshold", float, "entropy_bounded: the entropy bound (nats)"),
    ("--edit-threshold", "dllm_edit_threshold", float, "joint_threshold: rewrite a token above this confidence"),
    ("--max-post-edit-steps", "dllm_max_post_edit_steps", int, "joint_threshold: editing steps after the last mask"),
    ("--penalty-lambda", "dllm_penalty_lambda", float, "joint_threshold: repetition penalty inside a block"),
    ("--block-length", "dllm_block_length", int, "positions per block (must agree with the checkpoint's)"),
    ("--sub-block-length", "dllm_sub_block_length", int, "Fast-dLLM v2: positions per sub-block"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint directory (block diffusion or autoregressive)")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    for flag, field, kind, text in _SETTINGS:
        ap.add_argument(flag, dest=field, type=kind, default=None, help=f"{field}: {text} (default: the family's)")
    ap.add_argument("--no-colour", action="store_true", help="no ANSI colours (the default when not a terminal)")
    ap.add_argument("--png", help="write a step_map heat strip here")
    ap.add_argument("--json", help="save the request here for the /viewer page (a /generate body with its step trace)")
    return ap.parse_args(argv)


def step_events(response: Response) -> list[dict[str, Any]]:
    """What each step wrote: the step trace, or for an autoregressive model one token a step."""
    if response.step_trace is not None:
        return response.step_trace
    return [{"step": i + 1, "positions": [i], "token_ids": [t]} for i, t in enumerate(response.token_ids)]


def num_steps(response: Response) -> int:
    """The steps the request took (the response's `num_steps`; one per token when autoregressive)."""
    return response.num_steps if response.num_steps is not None else len(response.token_ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = {field: getattr(args, field) for _, field, _, _ in _SETTINGS if getattr(args, field) is not None}
    config = EngineConfig(**given)  # the rest: the family's defaults
    with pipeline(args.model, config) as pipe:
        chunks = list(pipe.stream(args.prompt, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                 return_step_trace=True, logprobs=0)))
        response = Response.from_chunks(chunks)
        if response.step_map is None:  # autoregressive: every token is its own step
            response.step_map = list(range(1, len(response.token_ids) + 1))
        colour = not args.no_colour and sys.stdout.isatty()
        print(args.prompt + render(pipe.tokenizer, response, colour=colour))
        print()
        written: set[int] = set()  # positions written so far: a second write is a token edit
        for event in step_events(response):
            pieces = [pipe.tokenizer.decode([t]) for t in event["token_ids"]]
            print(f"step {event['step']:3d}: " + ", ".join(f"{p}={s!r}" + (" (edit)" if p in written else "")
                                                        for p, s in zip(event["positions"], pieces)))
            written.update(event["positions"])
        n, steps = len(response.token_ids), num_steps(response)
        print(f"\n{n} tokens in {steps} steps ({n / max(1, steps):.2f} tokens/step), "
              f"finish_reason={response.finish_reason}")
        if args.png:
            write_heat_strip(response, pipe.tokenizer, args.png)
            print(f"wrote {args.png}")
        if args.json:
            used = pipe.engine.config
            settings = {"dllm_unmasking_strategy": used.dllm_unmasking_strategy,
                        "dllm_confidence_threshold": used.dllm_confidence_threshold,
                        "dllm_denoising_steps": args.dllm_denoising_steps, **given,
                        "max_new_tokens": args.max_new_tokens, "temperature": 0}
            body = trace_body(response, pipe.tokenizer, args.prompt, args.model, used.dllm_block_length, settings)
            with open(args.json, "w") as f:
                json.dump(body, f, ensure_ascii=False)
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
