"""See the decoding order: `python -m engine.trace MODEL "prompt"`.

Prints the generated text with every token tagged by the step that revealed it (coloured with ANSI
codes on a terminal, `token⟨step⟩` otherwise), one line per step listing what it wrote (a rewrite of
a token under token editing marked `(edit)`; a step of insert/delete editing also says how many tokens
it moved and which positions it emptied), and the totals: the tokens and the steps the request
took (the response's `num_steps`, which counts the steps that wrote nothing too; an autoregressive
model takes one step per token). A renoising model (DiffusionGemma) rewrites a whole canvas each step:
its step lines come under a line per canvas (its positions, steps and why it stopped).

The decoding settings are flags, one per knob of `configs.knobs` (`--strategy joint_threshold
--edit-threshold 0.9`, `--block-length`, `--delete-token-id` / `--split-token-id` for a checkpoint that
names no edit tokens, `--stop-entropy` and the other renoising knobs, ...); those not given are the
model family's, and a knob the model's paradigm does not read is refused. `--seed` seeds the request
(a renoising model samples: without it a seed is drawn, and printed so that the run can be repeated).
`--png FILE` also writes a heat strip of step_map (needs matplotlib: `pip install 'blockserve[trace]'`);
`--json FILE` saves the request as a `/generate` body with `meta_info.step_trace` (and, for a renoising
model, `block_step_map` and `dllm_replay_canvases`) plus a `trace` object: model, prompt, paradigm,
block length (for a renoising model: `canvas_length` and its `canvases`), the settings that decoded
it (the knobs its paradigm reads, as a request names them) and each token's text, which the server's
/viewer page opens.

A refusal (a knob the model does not read, a checkpoint that lacks what a rule needs, a bad value) is
one line on stderr and exit status 2 for the flags, 1 for the model's; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from typing import Any, NoReturn

from pydantic import ValidationError

from configs import EngineConfig, GenerationConfig
from configs.knobs import DIFFUSION, KNOBS, Knob
from engine.carrier import Response
from engine.offline import pipeline

_COLOURS = [31, 32, 33, 34, 35, 36, 91, 92, 93, 94, 95, 96]
PROG = "python -m engine.trace"


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


def canvases(response: Response, canvas_length: int) -> list[dict[str, Any]]:
    """A renoising request's canvases in order: `canvas` (1, 2, ..., as the viewer names them), the output
    `positions` [first, end) it holds, its `steps` [first, last] (the request's step counter) and why it
    `stop`ped. The k-th holds output positions [(k-1)L, kL) wherever the prompt ends, cut at the output's
    end."""
    out, first = [], 1
    for k, canvas in enumerate(response.dllm_replay_canvases or []):
        start = k * canvas_length
        end = min(start + canvas_length, len(response.token_ids))
        out.append({"canvas": k + 1, "positions": [start, end], "steps": [first, first + canvas["steps"] - 1],
                    "stop": canvas["stop"]})
        first += canvas["steps"]
    return out


def trace_body(response: Response, tokenizer, prompt: str, model: str, block_length: int | None,
               settings: dict[str, Any], paradigm: str | None = None) -> dict[str, Any]:
    """The request as a `/generate` body (the fields a viewer reads) with the `trace` extras. A renoising
    model's body also carries `block_step_map` (each token's step within its canvas, which is how the
    viewer tells the canvases apart) and `dllm_replay_canvases`; its extras name the canvas length and
    the canvases instead of a block length (its canvases follow the prompt wherever it ends)."""
    ids = set(response.token_ids) | {t for e in response.step_trace or [] for t in e["token_ids"]}
    texts = {str(t): tokenizer.decode([t], skip_special_tokens=False) for t in sorted(ids)}
    rows = [[next(iter(e.values())), t, texts[str(t)]] for e, t in zip(response.logprobs or [], response.token_ids)]
    meta = {
        "finish_reason": {"type": response.finish_reason},
        "prompt_tokens": response.input_token_len,
        "completion_tokens": len(response.token_ids),
        "output_token_logprobs": rows or None,
        "step_map": response.step_map,
        "step_trace": response.step_trace,
        "dllm_num_steps": response.num_steps,
    }
    if response.acceptance_lengths is not None:  # LinearSpec: the viewer groups the tokens by verify
        meta |= {"nfe": response.nfe, "acceptance_lengths": response.acceptance_lengths}
    extras: dict[str, Any] = {"model": model, "prompt": prompt, "paradigm": paradigm, "block_length": block_length}
    if paradigm == "renoising":
        meta |= {"block_step_map": response.block_step_map, "dllm_replay_canvases": response.dllm_replay_canvases}
        extras |= {"block_length": None, "canvas_length": block_length,
                   "canvases": canvases(response, block_length) if block_length else None}
    return {"text": response.text, "output_ids": response.token_ids, "meta_info": meta,
            "trace": {**extras, "settings": settings, "token_texts": texts}}


_METAVARS = {int: "N", float: "X"}
_FLAGS = {k.name: k.flag for k in KNOBS.values()}  # EngineConfig field -> its flag


def _add_knob(ap: argparse.ArgumentParser, knob: Knob) -> None:
    """The knob's flag, as the table declares it: its name, a value of its type (one of its choices, or
    for a switch `--x` / `--no-x`), and its meaning and readers as help. Unset: the family's."""
    text = f"{knob.name}: {knob.doc}; read by {', '.join(knob.used_by)} decoding (default: the family's)"
    options: dict[str, Any] = {"dest": knob.name, "default": None, "help": text.replace("%", "%%")}
    kind, choices = knob.value_type, knob.choices()
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif choices is not None:
        options |= {"type": str, "choices": choices}
    else:
        options |= {"type": kind, "metavar": _METAVARS.get(kind, "VALUE")}
    ap.add_argument(knob.flag, **options)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the usage (whose many flags --help lists)."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model, the prompt, a flag per knob of the table and the output options."""
    ap = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint directory (block diffusion, renoising or autoregressive)")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, help="the request's random seed (a renoising model samples; without it a "
                                             "seed is drawn and printed)")
    for knob in KNOBS.values():
        _add_knob(ap, knob)
    ap.add_argument("--no-colour", action="store_true", help="no ANSI colours (the default when not a terminal)")
    ap.add_argument("--png", help="write a step_map heat strip here")
    ap.add_argument("--json", help="save the request here for the /viewer page (a /generate body with its step trace)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def step_events(response: Response) -> list[dict[str, Any]]:
    """What each step wrote: the step trace, or for an autoregressive model one token a step."""
    if response.step_trace is not None:
        return response.step_trace
    return [{"step": i + 1, "positions": [i], "token_ids": [t]} for i, t in enumerate(response.token_ids)]


def num_steps(response: Response) -> int:
    """The steps the request took (the response's `num_steps`; one per token when autoregressive)."""
    return response.num_steps if response.num_steps is not None else len(response.token_ids)


def recorded_settings(engine, given: dict[str, Any], gen: GenerationConfig, seed: int | None) -> dict[str, Any]:
    """The settings that decoded the request, as a request names them: the knobs the model's paradigm
    reads (those of its unmasking rule, resolved as the engine resolves them: the family's and the
    rule's defaults included), the engine-wide ones only where given, then `max_new_tokens`, the
    temperature where the paradigm has one (the block paradigms decode greedily here; renoising's
    temperature is its schedule) and the seed where one was used."""
    paradigm = engine.paradigm
    unmasking = engine.unmasking_settings(gen) if paradigm in DIFFUSION else None
    settings: dict[str, Any] = {}
    for knob in KNOBS.values():
        if paradigm not in knob.used_by:
            continue
        if unmasking is not None and knob.rules is not None and unmasking.strategy not in knob.rules:
            continue  # another unmasking rule's
        if knob.per_request and not knob.fixed:
            default = getattr(engine.config, knob.name)
            settings[knob.name] = default if unmasking is None else getattr(unmasking, knob.setting, default)
        elif knob.name in given:
            settings[knob.name] = given[knob.name]
    settings["max_new_tokens"] = gen.max_new_tokens
    if paradigm != "renoising":
        settings["temperature"] = 0
    if seed is not None:
        settings["seed"] = seed
    return settings


def _one_line(e: BaseException) -> str:
    """An error as one line; a setting's bad value names its flag."""
    if isinstance(e, ValidationError):
        parts = []
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else None
            parts.append(f"argument {_FLAGS.get(field, field)}: {err['msg']} (got {err.get('input')!r})" if field
                         else err["msg"])
        return "; ".join(parts)
    return " ".join(str(e).split()) or type(e).__name__


def _fail(message: str) -> int:
    """The error line (exit status 1); the settings it names get their flags named too."""
    named = [field for field in _FLAGS if re.search(rf"\b{field}\b", message)]
    if named:
        message += " [flags: " + ", ".join(f"{_FLAGS[field]} for {field}" for field in named) + "]"
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = {name: getattr(args, name) for name in KNOBS if getattr(args, name) is not None}
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--png needs matplotlib: pip install 'blockserve[trace]'")
    try:
        config = EngineConfig(**given)  # the rest: the family's defaults
    except ValidationError as e:
        _Parser(prog=PROG).error(_one_line(e))
    try:
        return _trace(args, given, config)
    except (ValueError, OSError) as e:  # RequestError and CheckpointError are ValueErrors
        return _fail(_one_line(e))


def _trace(args: argparse.Namespace, given: dict[str, Any], config: EngineConfig) -> int:
    with pipeline(args.model, config) as pipe:
        paradigm = pipe.engine.paradigm
        renoising = paradigm == "renoising"
        seed = args.seed
        if seed is None and renoising:  # it samples: a drawn seed, printed, repeats the run
            seed = random.SystemRandom().randrange(2**31)
        fields: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, return_step_trace=True, logprobs=0,
                                      random_seed=seed)
        if renoising:
            fields |= dict(return_block_step_map=True, return_dllm_replay=True)
        else:
            fields["temperature"] = 0.0
        gen = GenerationConfig(**fields)
        response = Response.from_chunks(list(pipe.stream(args.prompt, gen)))
        if response.finish_reason == "error":
            return _fail(f"the request failed: {response.error}")
        if response.step_map is None:  # autoregressive: every token is its own step
            response.step_map = list(range(1, len(response.token_ids) + 1))
        colour = not args.no_colour and sys.stdout.isatty()
        print(args.prompt + render(pipe.tokenizer, response, colour=colour))
        print()
        length = pipe.engine.config.dllm_block_length
        if renoising:  # the canvas the request ran on: --canvas-length narrows the model's
            length = pipe.engine.config.dllm_canvas_length or length
        heads = {c["steps"][0]: c for c in canvases(response, length)} if renoising else {}
        written: set[int] = set()  # positions written so far: a second write is a token edit
        for event in step_events(response):
            if event["step"] in heads:
                c = heads[event["step"]]
                print(f"canvas {c['canvas']}: positions {c['positions'][0]}-{c['positions'][1] - 1}, "
                      f"steps {c['steps'][0]}-{c['steps'][1]} ({c['stop']})")
            pieces = [pipe.tokenizer.decode([t]) for t in event["token_ids"]]
            moved = (f" | insert/delete: {len(event.get('moves', []))} tokens moved, positions "
                     f"{event.get('deleted', [])} emptied" if "moves" in event or "deleted" in event else "")
            print(f"step {event['step']:3d}: " + ", ".join(f"{p}={s!r}" + (" (edit)" if p in written else "")
                                                        for p, s in zip(event["positions"], pieces)) + moved)
            written.update(event["positions"])
        n, steps = len(response.token_ids), num_steps(response)
        extra = f", {len(heads)} canvas{'es' * (len(heads) != 1)} of {length}, seed {seed}" if renoising else ""
        print(f"\n{n} tokens in {steps} steps ({n / max(1, steps):.2f} tokens/step){extra}, "
              f"finish_reason={response.finish_reason}")
        if args.png:
            write_heat_strip(response, pipe.tokenizer, args.png)
            print(f"wrote {args.png}")
        if args.json:
            settings = recorded_settings(pipe.engine, given, gen, seed)
            body = trace_body(response, pipe.tokenizer, args.prompt, args.model, length, settings, paradigm)
            with open(args.json, "w") as f:
                json.dump(body, f, ensure_ascii=False)
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
