"""See the decoding order: `python -m engine.trace MODEL "prompt"`.

Prints the generated text with every token tagged by the step that revealed it (coloured with ANSI
codes on a terminal, `token⟨step⟩` otherwise), plus one line per step listing what it decoded.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint directory of a block-diffusion (sdar) model")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--strategy", default=None, help="unmasking strategy (default: the model family's)")
    ap.add_argument("--threshold", type=float, default=None, help="confidence threshold (default: the family's)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps per block (default B)")
    ap.add_argument("--no-colour", action="store_true", help="no ANSI colours (the default when not a terminal)")
    ap.add_argument("--png", help="write a step_map heat strip here")
    ap.add_argument("--json", help="save the request here for the /viewer page (a /generate body with its step trace)")
    args = ap.parse_args(argv)
    given = {"dllm_unmasking_strategy": args.strategy, "dllm_confidence_threshold": args.threshold,
             "dllm_denoising_steps": args.steps}
    config = EngineConfig(**{k: v for k, v in given.items() if v is not None})  # the rest: the family's defaults
    with pipeline(args.model, config) as pipe:
        if not pipe.engine.is_dllm:
            print(f"{args.model} is an AR model: there is no decoding order to show", file=sys.stderr)
            return 2
        chunks = list(pipe.stream(args.prompt, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                 return_step_trace=True, logprobs=0)))
        response = Response.from_chunks(chunks)
        colour = not args.no_colour and sys.stdout.isatty()
        print(args.prompt + render(pipe.tokenizer, response, colour=colour))
        print()
        written: set[int] = set()  # positions written so far: a second write is a token edit
        for event in response.step_trace or []:
            pieces = [pipe.tokenizer.decode([t]) for t in event["token_ids"]]
            print(f"step {event['step']:3d}: " + ", ".join(f"{p}={s!r}" + (" (edit)" if p in written else "")
                                                        for p, s in zip(event["positions"], pieces)))
            written.update(event["positions"])
        n = len(response.token_ids)
        print(f"\n{n} tokens in {len(set(response.step_map))} steps "
              f"({n / max(1, len(set(response.step_map))):.2f} tokens/step), finish_reason={response.finish_reason}")
        if args.png:
            write_heat_strip(response, pipe.tokenizer, args.png)
            print(f"wrote {args.png}")
        if args.json:
            used = pipe.engine.config
            settings = {"dllm_unmasking_strategy": used.dllm_unmasking_strategy,
                        "dllm_confidence_threshold": used.dllm_confidence_threshold,
                        "dllm_denoising_steps": args.steps, "max_new_tokens": args.max_new_tokens, "temperature": 0}
            body = trace_body(response, pipe.tokenizer, args.prompt, args.model, pipe.engine.config.dllm_block_length,
                              settings)
            with open(args.json, "w") as f:
                json.dump(body, f, ensure_ascii=False)
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
